"""In-memory synthetic data with Criteo's shape and a planted model, so learning is real.

Each sample has `num_dense` dense features (already normalised, N(0, 1)), one id per
categorical feature (or a bag of `hotness[f]` ids, each drawn the same way; 0: an empty bag)
drawn from a power law over the table's rows, and a label drawn from a planted logistic
model: a bias, a linear dense part, one effect per (feature, id), and dot products of
latent id vectors for a few feature pairs (what DLRM's interaction can learn); a bag
contributes the mean of its ids' effects and vectors.

Batches are a pure function of (seed, split, index, rank): the data position of a run is
just the step number, so a resumed run sees exactly the batches an uninterrupted one would.

Shapes: B = batch size per rank, F = categorical features, D = dense features.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.config import SyntheticConfig, TrainConfigError
from recsys.data.multi_hot import bags_to_jagged, resolve_hotness

_SPLITS = {"train": 0, "eval": 1}
_SCATTER_PRIME = 2_147_483_647  # hot ranks scattered over the table by k * p mod rows
_PLANTED_ROWS_CAP = 1 << 16  # planted effects repeat with period 65536 ids in huge tables
_LATENT_DIM = 4


def power_law_ranks(u: np.ndarray, rows: int, exponent: float) -> np.ndarray:
    """Inverse CDF of a continuous power law on [1, rows + 1), floored to ranks in [0, rows)."""
    if abs(exponent - 1.0) < 1e-9:
        x = np.power(rows + 1.0, u)
    else:
        e = 1.0 - exponent
        x = np.power(1.0 + u * (np.power(rows + 1.0, e) - 1.0), 1.0 / e)
    return np.minimum(x.astype(np.int64) - 1, rows - 1)


class SyntheticCriteo:
    """Deterministic batches of synthetic Criteo-shaped data for one rank."""

    def __init__(
        self,
        cfg: SyntheticConfig,
        num_embeddings_per_feature: list[int],
        feature_names: list[str],
        num_dense: int,
        batch_size: int,
    ) -> None:
        if batch_size < 1:
            raise TrainConfigError(f"batch size must be >= 1, got {batch_size}")
        if cfg.zipf_exponent <= 0:
            raise TrainConfigError(f"dataset.zipf_exponent must be > 0, got {cfg.zipf_exponent}")
        self.cfg = cfg
        self.rows = [int(n) for n in num_embeddings_per_feature]
        self.keys = list(feature_names)
        self.num_dense = num_dense
        self.batch_size = batch_size
        self.hotness = resolve_hotness(cfg.hotness, len(self.rows))  # None: one-hot
        rng = np.random.default_rng([cfg.seed, 99])
        n_feat = len(self.rows)
        self._dense_w_D = rng.normal(0.0, 1.0 / np.sqrt(num_dense), num_dense)
        self._effect_F = [rng.normal(0.0, 0.35, min(n, _PLANTED_ROWS_CAP)) for n in self.rows]
        self._latent_F = [
            rng.normal(0.0, 0.5, (min(n, _PLANTED_ROWS_CAP), _LATENT_DIM)) for n in self.rows
        ]
        self._pairs = [(f, f + 1) for f in range(0, min(n_feat, 8) - 1, 2)]
        self._offsets_F = rng.integers(0, 1 << 30, n_feat)

    def _ids(self, rng: np.random.Generator) -> np.ndarray:
        """ids_FB: one id per feature and sample, power-law hot rows scattered over the table."""
        ids_FB = np.empty((len(self.rows), self.batch_size), dtype=np.int64)
        u_FB = rng.random((len(self.rows), self.batch_size))
        for f, n in enumerate(self.rows):
            ranks_B = power_law_ranks(u_FB[f], n, self.cfg.zipf_exponent)
            ids_FB[f] = (ranks_B * _SCATTER_PRIME + self._offsets_F[f]) % n
        return ids_FB

    def _bags(self, rng: np.random.Generator) -> list[np.ndarray]:
        """Per feature, [B, hotness] ids: each drawn as a one-hot id is."""
        out = []
        for f, (n, h) in enumerate(zip(self.rows, self.hotness, strict=True)):
            ranks = power_law_ranks(rng.random(self.batch_size * h), n, self.cfg.zipf_exponent)
            out.append(
                ((ranks * _SCATTER_PRIME + self._offsets_F[f]) % n).reshape(self.batch_size, h)
            )
        return out

    def logits(self, dense_BD: np.ndarray, ids_FB) -> np.ndarray:
        """The planted model's logit for each sample (`ids_FB`: [F, B] one-hot ids, or per
        feature a [B, h] bag array: the mean of its ids' effects)."""
        z_B = dense_BD @ self._dense_w_D
        cap = [len(e) for e in self._effect_F]

        def mean(table: np.ndarray, f: int) -> np.ndarray:
            ids = ids_FB[f] % cap[f]
            if ids.ndim == 1:
                return table[ids]
            if ids.shape[1] == 0:
                return np.zeros((len(ids), *table.shape[1:]))
            return table[ids].mean(axis=1)

        for f in range(len(self.rows)):
            z_B = z_B + mean(self._effect_F[f], f)
        for f, g in self._pairs:
            z_B = z_B + (mean(self._latent_F[f], f) * mean(self._latent_F[g], g)).sum(axis=1)
        return self.cfg.bias + self.cfg.signal * z_B

    def batch(self, split: str, index: int, rank: int) -> Batch:
        rng = np.random.default_rng([self.cfg.seed, _SPLITS[split], index, rank])
        dense_BD = rng.standard_normal((self.batch_size, self.num_dense))
        ids_FB = self._ids(rng) if self.hotness is None else self._bags(rng)
        p_B = 1.0 / (1.0 + np.exp(-self.logits(dense_BD, ids_FB)))
        labels_B = (rng.random(self.batch_size) < p_B).astype(np.float32)
        if self.hotness is None:
            values, lengths = ids_FB.reshape(-1), np.ones(ids_FB.size, dtype=np.int32)
        else:
            values, lengths = bags_to_jagged(ids_FB)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths)
        )
        return Batch(
            dense_features=torch.from_numpy(dense_BD.astype(np.float32)),
            sparse_features=kjt,
            labels=torch.from_numpy(labels_B),
        )

    def batches(self, split: str, start: int, stop: int, rank: int) -> Iterator[Batch]:
        for index in range(start, stop):
            yield self.batch(split, index, rank)
