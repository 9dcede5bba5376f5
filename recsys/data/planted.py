"""The planted model of synthetic Criteo-shaped data, in numpy alone (`recsys.data.synth`
writes text files with it without importing torch).

Ids are drawn from a power law over a table's rows, the hot ranks scattered over the table.
A label is drawn from a planted logistic model: a bias, a linear dense part, one effect per
(feature, id), and dot products of latent id vectors for a few feature pairs (what DLRM's
interaction can learn); a bag contributes the mean of its ids' effects and vectors.

Shapes: B = samples, F = categorical features, D = dense features.
"""

from __future__ import annotations

import numpy as np

from recsys.config import SyntheticConfig

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


class PlantedModel:
    """The ids and the labels' logistic model of `cfg` (its seed, signal, bias and power
    law) for tables of `rows` rows and `num_dense` dense features."""

    def __init__(self, cfg: SyntheticConfig, rows: list[int], num_dense: int) -> None:
        self.cfg = cfg
        self.rows = [int(n) for n in rows]
        rng = np.random.default_rng([cfg.seed, 99])
        n_feat = len(self.rows)
        self._dense_w_D = rng.normal(0.0, 1.0 / np.sqrt(num_dense), num_dense)
        self._effect_F = [rng.normal(0.0, 0.35, min(n, _PLANTED_ROWS_CAP)) for n in self.rows]
        self._latent_F = [
            rng.normal(0.0, 0.5, (min(n, _PLANTED_ROWS_CAP), _LATENT_DIM)) for n in self.rows
        ]
        self._pairs = [(f, f + 1) for f in range(0, min(n_feat, 8) - 1, 2)]
        self._offsets_F = rng.integers(0, 1 << 30, n_feat)

    def _scatter(self, ranks: np.ndarray, f: int) -> np.ndarray:
        return (ranks * _SCATTER_PRIME + self._offsets_F[f]) % self.rows[f]

    def ids(self, rng: np.random.Generator, samples: int) -> np.ndarray:
        """ids_FB: one id per feature and sample."""
        ids_FB = np.empty((len(self.rows), samples), dtype=np.int64)
        u_FB = rng.random((len(self.rows), samples))
        for f, n in enumerate(self.rows):
            ids_FB[f] = self._scatter(power_law_ranks(u_FB[f], n, self.cfg.zipf_exponent), f)
        return ids_FB

    def bags(self, rng: np.random.Generator, samples: int, hotness: list[int]) -> list:
        """Per feature, [B, hotness] ids: each drawn as a one-hot id is."""
        out = []
        for f, (n, h) in enumerate(zip(self.rows, hotness, strict=True)):
            ranks = power_law_ranks(rng.random(samples * h), n, self.cfg.zipf_exponent)
            out.append(self._scatter(ranks, f).reshape(samples, h))
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
