"""In-memory synthetic data with Criteo's shape and a planted model, so learning is real.

Each sample has `num_dense` dense features (already normalised, N(0, 1)), one id per
categorical feature (or a bag of `hotness[f]` ids, each drawn the same way; 0: an empty bag)
and a label drawn from the planted model of `recsys.data.planted`.

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
from recsys.data.planted import PlantedModel

_SPLITS = {"train": 0, "val": 1, "test": 2}  # each split its own stream


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
        self.model = PlantedModel(cfg, num_embeddings_per_feature, num_dense)
        self.keys = list(feature_names)
        self.num_dense = num_dense
        self.batch_size = batch_size
        self.hotness = resolve_hotness(cfg.hotness, len(self.model.rows))  # None: one-hot

    def batch(self, split: str, index: int, rank: int) -> Batch:
        rng = np.random.default_rng([self.cfg.seed, _SPLITS[split], index, rank])
        dense_BD = rng.standard_normal((self.batch_size, self.num_dense))
        if self.hotness is None:
            ids_FB = self.model.ids(rng, self.batch_size)
        else:
            ids_FB = self.model.bags(rng, self.batch_size, self.hotness)
        p_B = 1.0 / (1.0 + np.exp(-self.model.logits(dense_BD, ids_FB)))
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

    def num_batches(self, split: str) -> None:
        """Synthetic data has no end."""
        return None

    def batches(self, split: str, start: int, stop: int, rank: int) -> Iterator[Batch]:
        for index in range(start, stop):
            yield self.batch(split, index, rank)
