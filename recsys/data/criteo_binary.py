"""Batches from TorchRec's binary Criteo layout: memory-mapped, sharded by rank, shuffled by
chunk, hashed to the model's table sizes.

Splits follow TorchRec's convention: with several files (day_0 .. day_23) the last one is held
out and split in halves, val then test; with one file (Kaggle's train.txt) its last
`holdout_fraction` rows are held out and split the same way. Each rank reads a contiguous
share of the split's rows in proportion to its batch size (equal shares unless a speed-aware
plan gives ranks different batches; the remainder is dropped), so every rank has the same
number of batches. Training batches are read in chunks of `shuffle_chunk_batches`
batches whose order is shuffled each epoch (seeded), so reads stay sequential within a
chunk. Like `SyntheticCriteo`, a batch is a pure function of (split, index, rank): the data
position of a run is its step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.data.multi_hot import bags_to_jagged, read_multi_hot, variable_bags
from recsys.data.prepared import (
    CriteoDataError,
    check_prepared_dir,
    model_advice,
    open_npy,
    prepare_advice,
    prepared_names,
)


class CriteoBinary:
    """Deterministic batches of prepared Criteo files for any rank of `world_size`."""

    def __init__(
        self,
        path: str | Path,
        num_embeddings_per_feature: list[int],
        feature_names: list[str],
        batch_size: int,
        world_size: int,
        holdout_fraction: float = 1 / 7,
        shuffle_chunk_batches: int = 16,
        seed: int = 0,
        batch_per_rank: list[int] | None = None,
        hotness: list[int] | None = None,
        held_out: str | None = "val",
        dense_features: int = 13,
    ) -> None:
        """`batch_size` and `world_size`: equal shares; `batch_per_rank`, if given, each
        rank's own batch size instead (a speed-aware split). `hotness`: bag sizes per table,
        read from each file's `_sparse_multi_hot.npz` (`recsys.data.multi_hot`).
        `held_out`: the split evaluations read ("val" or "test"), which must hold a batch
        (None: no evaluation is asked for)."""
        root = Path(path)
        if not root.is_dir():
            raise CriteoDataError(
                f"dataset.path '{root}' is not a directory. {prepare_advice(root)}"
            )
        self._open_files(root, dense_features, len(num_embeddings_per_feature))
        self.hotness = hotness
        # per table, per file: [rows, bag size] (loaded whole, as TorchRec's reader does);
        # bags of a multi-valued column (recsys.data.tabular) are padded with -1
        self.multi_hot = None
        self.padded = variable_bags(root)
        if hotness is not None or self.padded:
            files = [
                read_multi_hot(root, n, len(s), hotness, len(num_embeddings_per_feature))
                for n, s in zip(self.names, self.sparse, strict=True)
            ]
            self.multi_hot = [[f[t] for f in files] for t in range(len(feature_names))]
        self.batch_per_rank = list(batch_per_rank or [batch_size] * world_size)
        self.world_size = len(self.batch_per_rank)
        self._lengths = {
            b: torch.ones(len(feature_names) * b, dtype=torch.int32) for b in self.batch_per_rank
        }
        self.keys = list(feature_names)
        self.hashes_C = np.asarray(num_embeddings_per_feature, dtype=np.int64)[:, None]
        self.shuffle_chunk_batches = shuffle_chunk_batches
        self.seed = seed
        self._file_starts = np.cumsum([0] + [len(d) for d in self.dense])
        self._splits = self._split_ranges(holdout_fraction)
        for split in ("train", held_out) if held_out else ("train",):
            self._check_split(root, split, holdout_fraction)

    def _open_files(self, root: Path, dense: int, tables: int) -> None:
        """Memory-map each prepared file's arrays; refuse shapes that do not fit the model
        (`dense` features, `tables` categorical ones) and a directory its summary does not
        describe."""
        self.names = prepared_names(root)
        self.dense = [open_npy(root / f"{n}_dense.npy") for n in self.names]
        self.sparse = [open_npy(root / f"{n}_sparse.npy") for n in self.names]
        self.labels = [open_npy(root / f"{n}_labels.npy") for n in self.names]
        for n, d, s, lab in zip(self.names, self.dense, self.sparse, self.labels, strict=True):
            if d.ndim != 2 or s.ndim != 2 or len(d) != len(s) or len(lab) != len(s):
                raise CriteoDataError(f"'{root}/{n}_*.npy' have inconsistent shapes")
            if d.shape[1] != dense or s.shape[1] != tables:
                raise CriteoDataError(
                    f"'{root}/{n}_*.npy' hold {d.shape[1]} dense and {s.shape[1]} categorical "
                    f"features; the model takes {dense} and {tables}. Size the model to the "
                    f"data: {model_advice(root)}"
                )
        every = {p.name[: -len("_dense.npy")]: 0 for p in root.glob("*_dense.npy")}
        for n in every:  # the test file too: the summary lists it
            every[n] = len(open_npy(root / f"{n}_dense.npy"))
        check_prepared_dir(root, every)

    def _check_split(self, root: Path, split: str, holdout_fraction: float) -> None:
        """`split` must hold at least one batch for each rank."""
        if self.num_batches(split) >= 1:
            return
        lo, hi = self._splits[split]
        fix = "use more data or a smaller trainer.batch_size"
        if split != "train" and len(self.names) == 1:
            fix = (
                f"raise dataset.holdout_fraction (now {holdout_fraction:g}; the {split} split "
                f"is half the rows held out), use a smaller trainer.batch_size, or set "
                f"dataset.eval_batches=0 for no evaluation"
            )
        raise CriteoDataError(
            f"'{root}': the {split} split has {hi - lo:,} rows, fewer than one batch for each "
            f"rank (batches {self.batch_per_rank}); {fix}"
        )

    def _split_ranges(self, holdout_fraction: float) -> dict[str, tuple[int, int]]:
        total = int(self._file_starts[-1])
        if len(self.names) > 1:
            held = int(self._file_starts[-2])
        else:
            held = total - int(round(total * holdout_fraction))
        half = held + (total - held + 1) // 2
        return {"train": (0, held), "val": (held, half), "test": (half, total)}

    def num_batches(self, split: str) -> int:
        start, stop = self._splits[split]
        return (stop - start) // sum(self.batch_per_rank)

    def split_range(self, split: str) -> tuple[int, int]:
        """The global rows [start, stop) of `split` (train, val or test)."""
        return self._splits[split]

    def rows_read(self, split: str, rank: int, index: int = 0) -> np.ndarray:
        """The global rows the `index`-th batch of `split` on `rank` reads, in order."""
        return np.arange(*self._span(split, rank, index))

    def _span(self, split: str, rank: int, index: int) -> tuple[int, int]:
        size = self.batch_per_rank[rank]
        a = self._first_row(split, rank) + self._position(split, index) * size
        return a, a + size

    def _first_row(self, split: str, rank: int) -> int:
        """Where `rank`'s share of `split` starts: shares in proportion to batch sizes."""
        start, stop = self._splits[split]
        total, whole = stop - start, sum(self.batch_per_rank)
        return start + sum(total * b // whole for b in self.batch_per_rank[:rank])

    def _rows(self, a: int, b: int, arrays: list[np.ndarray]) -> np.ndarray:
        """Global rows [a, b) across files."""
        f = int(np.searchsorted(self._file_starts, a, side="right")) - 1
        lo = a - int(self._file_starts[f])
        if b <= self._file_starts[f + 1]:
            return arrays[f][lo : lo + (b - a)]
        parts, pos = [], a
        while pos < b:
            f = int(np.searchsorted(self._file_starts, pos, side="right")) - 1
            end = min(b, int(self._file_starts[f + 1]))
            parts.append(
                arrays[f][pos - int(self._file_starts[f]) : end - int(self._file_starts[f])]
            )
            pos = end
        return np.concatenate(parts)

    def _position(self, split: str, index: int) -> int:
        """Which batch of the rank's share the index-th batch of `split` reads."""
        n = self.num_batches(split)
        epoch, i = divmod(index, n)
        if split != "train" or self.shuffle_chunk_batches <= 0:
            return i
        chunk = self.shuffle_chunk_batches
        n_chunks = -(-n // chunk)
        order = np.random.default_rng([self.seed, epoch]).permutation(n_chunks)
        # chunks are visited in shuffled order; batches inside a chunk stay in order
        sizes = np.minimum(chunk, n - order * chunk)
        ends = np.cumsum(sizes)
        k = int(np.searchsorted(ends, i, side="right"))
        return int(order[k]) * chunk + i - int(ends[k] - sizes[k])

    def batch(self, split: str, index: int, rank: int) -> Batch:
        a, b = self._span(split, rank, index)
        size = b - a
        bags = None
        if self.multi_hot is not None:
            bags = [self._rows(a, b, arrays) for arrays in self.multi_hot]
        return assemble_batch(
            self._rows(a, b, self.dense),
            self._rows(a, b, self.labels),
            self._rows(a, b, self.sparse),
            self.hashes_C,
            self.keys,
            bags,
            self._lengths.get(size),
            self.padded,
        )

    def batches(self, split: str, start: int, stop: int, rank: int) -> Iterator[Batch]:
        if split != "train":
            stop = min(stop, self.num_batches(split))
        for index in range(start, stop):
            yield self.batch(split, index, rank)


def assemble_batch(
    dense_BI: np.ndarray,
    labels_B1: np.ndarray,
    ids_BC: np.ndarray,
    hashes_C1: np.ndarray,
    keys: list[str],
    bags: list[np.ndarray] | None = None,
    ones: torch.Tensor | None = None,
    padded: bool = False,
) -> Batch:
    """A Batch of prepared rows: ids modulo the tables' sizes (`hashes_C1`, [C, 1]); with
    `bags` (per table [B, bag size], multi-hot; -1 pads shorter bags) those instead of the
    one-hot `ids_BC`.
    `ones`: a reusable tensor of B * C one-hot lengths; `padded`: the bags may hold -1
    (a multi-valued column's), else they are fixed-size (MLPerf's) and no pass looks for it."""
    size = len(ids_BC)
    dense = torch.from_numpy(np.array(dense_BI, dtype=np.float32))
    labels = torch.from_numpy(labels_B1[:, 0].astype(np.float32))
    if bags is not None:
        if padded:  # -1 stays padding, not the table's last row
            hashed = [np.where(b >= 0, b % hashes_C1[t], -1) for t, b in enumerate(bags)]
        else:
            hashed = [b % hashes_C1[t] for t, b in enumerate(bags)]
        values, lengths = bags_to_jagged(hashed, padded)
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(lengths),
            stride=size,
        )
        return Batch(dense, kjt, labels)
    ids_CB = ids_BC.T % hashes_C1
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(np.ascontiguousarray(ids_CB).reshape(-1)),
        lengths=ones if ones is not None else torch.ones(ids_CB.size, dtype=torch.int32),
        stride=size,
        length_per_key=[size] * len(keys),
    )
    return Batch(dense, kjt, labels)
