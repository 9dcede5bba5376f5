"""Hot/cold split tables: the model side and the data side of a frequency-based row split.

TorchRec shards rows evenly by id (uneven row-wise shards are wrong in training), so a
table whose hottest rows are placed apart from the rest is split into two tables: feature
`f` becomes `f_hot` (rows = the hot ids, in sorted order) and `f_cold` (every other id, in
order). `SplitRemap` rewrites a batch's ids into the two new features; `SplitSparseArch`
sums the two pooled embeddings back into `f`. With the hot and cold rows copied from the
unsplit table (`split_weights`), the split model computes the same function.

With `sequence_cold=True` the cold parts are an EmbeddingCollection instead (sequence
embeddings, pooled after the exchange): TorchRec's all-to-all then carries one vector per
cold lookup only, where the pooled exchange carries one per sample, empty bag or not.

A large cold part can itself be split in `k` row parts `<name>_cold0` .. `<name>_cold{k-1}`
(cold row c in part c mod k, row c // k), each table-wise on its own rank, so that no one
rank sends all of a hot table's cold lookups (`cold_parts`). A table too large for any one
device is cut the same way with no hot part: its row parts stay pooled bags (each sends one
vector per sample, like TorchRec's row-wise shards, but each on the rank that has room).

Shapes: B = batch size, N = ids of one feature in the batch.
"""

from __future__ import annotations

import re

import torch
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.models.dlrm import SparseArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sharding.row_parts import cold_part_rows, cold_suffixes

HOT, COLD = "_hot", "_cold"
_COLD_SUFFIX = re.compile(r"_cold\d*")


def is_cold(name: str) -> bool:
    return re.search(r"_cold\d*$", name) is not None


def is_split(rows: int, hot: int, parts: int) -> bool:
    """A table is split into parts when it keeps a hot part apart, or its rows are cut into
    row parts (a table too large for any one device: `hot` 0, `parts` > 1)."""
    return 0 < hot < rows or (hot == 0 and parts > 1)


def split_configs(
    tables: list[EmbeddingBagConfig],
    hot_rows: dict[str, int],
    cold_parts: dict[str, int] | None = None,
) -> list[EmbeddingBagConfig]:
    """Tables with `0 < hot_rows[name] < rows` become `<name>_hot` and their cold part(s)
    (`cold_suffixes`), serving features `<feature>_hot` and `<feature>_cold[j]`; a table
    with no hot rows but `cold_parts[name]` > 1 becomes its row parts only."""
    out = []
    for t in tables:
        h = hot_rows.get(t.name, 0)
        k = (cold_parts or {}).get(t.name, 1)
        if not is_split(t.num_embeddings, h, k):
            out.append(t)
            continue
        (feature,) = t.feature_names
        cold = zip(cold_suffixes(k), cold_part_rows(t.num_embeddings - h, k), strict=True)
        parts = ([(HOT, h)] if h else []) + list(cold)
        for suffix, rows in parts:
            out.append(
                EmbeddingBagConfig(
                    name=t.name + suffix,
                    embedding_dim=t.embedding_dim,
                    num_embeddings=rows,
                    feature_names=[feature + suffix],
                    init_fn=t.init_fn,
                    data_type=t.data_type,
                )
            )
    return out


def sequence_cold_configs(
    configs: list[EmbeddingBagConfig], sequences: frozenset[str]
) -> tuple[list[EmbeddingBagConfig], list[EmbeddingConfig]]:
    """Split configs with the cold parts of the tables named in `sequences` as sequence
    tables (for an EmbeddingCollection); every other part stays a pooled bag (each sends
    one pooled vector per sample, as a whole table would)."""

    def sequence(name: str) -> bool:
        return is_cold(name) and _COLD_SUFFIX.sub("", name) in sequences

    bags = [c for c in configs if not sequence(c.name)]
    cold = [
        EmbeddingConfig(
            name=c.name,
            embedding_dim=c.embedding_dim,
            num_embeddings=c.num_embeddings,
            feature_names=c.feature_names,
            init_fn=c.init_fn,
            data_type=c.data_type,
        )
        for c in configs
        if sequence(c.name)
    ]
    return bags, cold


class SplitSparseArch(SparseArch):
    """DLRM's SparseArch over a split collection: returns B x F x D for the original F
    features, each split feature's hot and cold pooled embeddings summed (`keyed`: a dict
    of each feature's B x D instead, what DeepFM's interaction indexes by name). Cold parts
    in `ec` (an EmbeddingCollection) are pooled here, after their exchange."""

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        feature_names: list[str],
        ec: EmbeddingCollection | None = None,
        keyed: bool = False,
    ) -> None:
        super().__init__(ebc)
        self.embedding_collection = ec
        self._keyed = keyed
        bags = set(self._sparse_feature_names)
        sequences = set()
        if ec is not None:
            sequences = {f for c in ec.embedding_configs() for f in c.feature_names}
        present = bags | sequences
        self._split = [f for f in feature_names if f not in present]
        self._hot = {f: f + HOT in present for f in self._split}
        # each split feature's cold features, in part order (constant: fx tracing follows)
        self._cold = {
            f: sorted(
                (c for c in present if _COLD_SUFFIX.fullmatch(c[len(f) :]) and c.startswith(f)),
                key=lambda c: int(c[len(f + COLD) :] or 0),
            )
            for f in self._split
        }
        self._sequences = sorted(sequences)
        self._sparse_feature_names = list(feature_names)
        self.F = len(feature_names)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor | dict[str, torch.Tensor]:
        # read by key, never written into: TorchRec's pipelines trace this forward with
        # torch.fx, where the collection's output is a proxy. One split of the pooled
        # values (TorchRec's SparseArch does the same): a slice per key would cost each
        # key's backward a zeroed gradient of the whole B x (keys x D) output.
        bags = self.embedding_bag_collection(features).to_dict()
        pooled: dict = {}
        if self._sequences:  # cold parts looked up as sequences, pooled here
            sequences = self.embedding_collection(features)
            for c in self._sequences:
                jt = sequences[c]
                pooled[c] = _sum_bags(jt.values(), jt.lengths(), self.D)

        def part(name: str) -> torch.Tensor:
            return pooled[name] if name in pooled else bags[name]

        values = []
        for f in self._sparse_feature_names:
            if f not in self._split:
                values.append(part(f))
                continue
            parts = ([f + HOT] if self._hot[f] else []) + self._cold[f]
            v = part(parts[0])
            for c in parts[1:]:
                v = v + part(c)
            values.append(v)
        if self._keyed:
            return dict(zip(self._sparse_feature_names, values, strict=True))
        return torch.cat(values, dim=1).reshape(-1, self.F, self.D)


def _sum_bags(values_ND: torch.Tensor, lengths_B: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum pooling of sequence embeddings: B x D, zeros for empty bags."""
    sample_N = torch.repeat_interleave(
        torch.arange(lengths_B.numel(), device=lengths_B.device), lengths_B.long()
    )
    out_BD = values_ND.new_zeros(lengths_B.numel(), dim)
    return out_BD.index_add(0, sample_N, values_ND)


def _counts(at: torch.Tensor, sample_N: torch.Tensor | None, len_B: torch.Tensor) -> torch.Tensor:
    """Each sample's count of the ids at positions `at`, as `len_B`: `sample_N` each id's
    sample, or None where every bag holds one id (id n is sample n's)."""
    if sample_N is None:
        return torch.zeros_like(len_B).index_fill_(0, at, 1)
    counts = torch.bincount(sample_N.index_select(0, at), minlength=len(len_B))
    return counts.to(len_B.dtype)


class SplitRemap:
    """Rewrites a KJT's ids of split features into their hot and cold features.

    `hot_ids[feature]` is the sorted array of the feature's hot ids. An id equal to the k-th
    hot id becomes row k of the hot table; any other id x becomes cold row
    c = x - (hot ids below x): row c of the cold table, or with `cold_parts[feature]` = k > 1
    row c // k of part c mod k. A feature with no hot ids (an empty array) and k > 1 parts
    is a table in row parts only. Per-sample order and bag lengths are kept.
    """

    def __init__(
        self, hot_ids: dict[str, torch.Tensor], cold_parts: dict[str, int] | None = None
    ) -> None:
        self.hot_ids = {
            f: torch.as_tensor(ids, dtype=torch.int64).sort().values for f, ids in hot_ids.items()
        }
        self.cold_parts = {f: (cold_parts or {}).get(f, 1) for f in self.hot_ids}

    def __call__(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        keys, values, lengths = [], [], []
        for f, jt in kjt.to_dict().items():  # every feature's ids in one split
            ids_N, len_B = jt.values(), jt.lengths()
            hot = self.hot_ids.get(f)
            if hot is None:
                keys.append(f)
                values.append(ids_N)
                lengths.append(len_B)
                continue
            # each id's sample; None where every bag holds one id (id n is sample n's)
            one_hot = len(ids_N) == len(len_B) and bool((len_B == 1).all())
            sample_N = None
            if not one_hot:
                sample_N = torch.repeat_interleave(
                    torch.arange(len(len_B)), len_B.long(), output_size=len(ids_N)
                )
            if len(hot):
                pos_N = torch.searchsorted(hot, ids_N)
                is_hot_N = hot[pos_N.clamp(max=len(hot) - 1)] == ids_N
                hot_at = is_hot_N.nonzero().squeeze(1)
                hot_len = _counts(hot_at, sample_N, len_B)
                keys.append(f + HOT)
                values.append(pos_N.index_select(0, hot_at))
                lengths.append(hot_len)
                cold_at = (~is_hot_N).nonzero().squeeze(1)
                cold_N = (ids_N - pos_N).index_select(0, cold_at)
            else:  # row parts only: every id is cold
                hot_len = torch.zeros_like(len_B)
                cold_at, cold_N = torch.arange(len(ids_N)), ids_N
            k = self.cold_parts[f]
            if k == 1:
                keys.append(f + COLD)
                values.append(cold_N)
                lengths.append(len_B - hot_len)
                continue
            part_N = cold_N % k
            for j, suffix in enumerate(cold_suffixes(k)):
                mine = (part_N == j).nonzero().squeeze(1)
                keys.append(f + suffix)
                values.append(cold_N.index_select(0, mine) // k)
                lengths.append(_counts(cold_at.index_select(0, mine), sample_N, len_B))
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
        )


def split_weights(
    weight: torch.Tensor, hot_ids: torch.Tensor, cold_parts: int = 1
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The hot table's and each cold part's initial rows, copied from the unsplit table's."""
    hot = torch.as_tensor(hot_ids, dtype=torch.int64).sort().values
    is_hot = torch.zeros(weight.shape[0], dtype=torch.bool)
    is_hot[hot] = True
    cold = weight[~is_hot]
    return weight[hot].clone(), [cold[j::cold_parts].clone() for j in range(cold_parts)]


def merge_weights(
    hot: torch.Tensor | None, hot_ids: torch.Tensor, cold: list[torch.Tensor], rows: int
) -> torch.Tensor:
    """The unsplit table from its hot rows and cold parts: the inverse of `split_weights`
    (hot row k is id `hot_ids[k]`; cold row c, in part c mod k at row c // k, is the c-th id
    that is not hot)."""
    hot_ids = torch.as_tensor(hot_ids, dtype=torch.int64).sort().values
    parts = len(cold)
    cold_rows = sum(len(c) for c in cold)
    if len(hot_ids) + cold_rows != rows:
        raise ValueError(f"{len(hot_ids)} hot and {cold_rows} cold rows do not make {rows}")
    dim = cold[0].shape[1]
    out = torch.empty(rows, dim, dtype=torch.float32)
    is_hot = torch.zeros(rows, dtype=torch.bool)
    is_hot[hot_ids] = True
    merged_cold = torch.empty(cold_rows, dim, dtype=torch.float32)
    for j, part in enumerate(cold):
        merged_cold[j::parts] = part.float()
    out[~is_hot] = merged_cold
    if len(hot_ids):
        out[hot_ids] = hot.float()
    return out
