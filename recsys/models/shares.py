"""Unequal per-rank batch shares (a speed-aware batch split) on top of TorchRec.

TorchRec's sharded embedding modules take a different batch size on every rank (the
input all-to-all carries each rank's stride; checked here: sharded outputs equal the
unsharded module's with 3 and 5 samples on two ranks). What changes is the loss: DDP and
TorchRec average gradients over ranks, so each rank's summed loss is scaled by
world / global batch and the update equals the plain mean over the global batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM

from sharding.api import ShareWeightedLoss


class SharedBatchDLRMTrain(nn.Module):
    """DLRMTrain for a rank holding `b_r` of `global_batch` samples: `(loss, (loss, logits,
    labels))`, the loss summed over the rank's samples and scaled by world / global batch
    (`sharding.ShareWeightedLoss`, what `HybridShardingPlan.prepare` gives a user's model)."""

    def __init__(self, model: DLRM, world_size: int, global_batch: int) -> None:
        super().__init__()
        self.model = model  # same parameter names as DLRMTrain: checkpoints carry over
        self.loss_fn = ShareWeightedLoss(nn.BCEWithLogitsLoss(), world_size, global_batch)
        self.loss_reduction = "sum"  # a scaled sum over samples (pipelines.nested reads it)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        labels = batch.labels.float()
        loss = self.loss_fn(logits, labels)
        return loss, (loss.detach(), logits.detach(), labels.detach())
