"""Unequal per-rank batch shares (a speed-aware batch split) on top of TorchRec.

Every rank's KJT must have the same stride for the embedding all-to-all, so a rank whose
share b_r is below the largest share b_max pads its batch with samples that have empty
bags, zero dense features and label -1. `MaskedDLRMTrain` drops those rows right after the
embedding exchange, before any dense compute, so a rank's dense work follows its own share;
and it scales the summed loss by world / global batch, so that with DDP's and TorchRec's
gradient averaging over ranks the update equals the plain mean over the global batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class MaskedDLRMTrain(nn.Module):
    """DLRMTrain for padded batches: `(loss, (loss, logits, labels))` of the real rows only."""

    def __init__(self, model: DLRM, world_size: int, global_batch: int) -> None:
        super().__init__()
        self.model = model  # same parameter names as DLRMTrain: checkpoints carry over
        self.loss_scale = world_size / global_batch

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        real = batch.labels >= 0
        embedded_sparse = self.model.sparse_arch(batch.sparse_features)[real]
        embedded_dense = self.model.dense_arch(batch.dense_features[real])
        features = self.model.inter_arch(
            dense_features=embedded_dense, sparse_features=embedded_sparse
        )
        logits = self.model.over_arch(features).squeeze(-1)
        labels = batch.labels[real].float()
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
        loss = loss * self.loss_scale
        return loss, (loss.detach(), logits.detach(), labels.detach())


def pad_batch(batch: Batch, size: int) -> Batch:
    """`batch` grown to `size` samples: empty bags, zero dense features, label -1."""
    real = batch.labels.shape[0]
    if real == size:
        return batch
    pad = size - real
    kjt = batch.sparse_features
    lengths = kjt.lengths().view(len(kjt.keys()), real)
    padded_lengths = torch.cat([lengths, lengths.new_zeros(len(kjt.keys()), pad)], dim=1)
    return Batch(
        dense_features=torch.cat(
            [
                batch.dense_features,
                batch.dense_features.new_zeros(pad, batch.dense_features.shape[1]),
            ]
        ),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=kjt.keys(), values=kjt.values(), lengths=padded_lengths.reshape(-1)
        ),
        labels=torch.cat([batch.labels, batch.labels.new_full((pad,), -1)]),
    )


def padded(batches: Iterator[Batch], size: int) -> Iterator[Batch]:
    for b in batches:
        yield pad_batch(b, size)
