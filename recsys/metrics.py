"""Held-out evaluation: AUC and log loss over all ranks' eval batches."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch


def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device) -> dict:
    """Eval AUC and log loss of a (DMP-wrapped) DLRMTrain model, synced over all ranks.

    The model must return `(loss, (loss, logits, labels))`. Restores train mode after.
    """
    auroc = BinaryAUROC().to(device)  # computes over every rank's predictions
    bce_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            _, (_, logits, labels) = model(batch)
            auroc.update(torch.sigmoid(logits), labels.int())
            bce_sum += torch.nn.functional.binary_cross_entropy_with_logits(
                logits, labels.float(), reduction="sum"
            ).double()
            count += labels.numel()
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(bce_sum)
        dist.all_reduce(count)
    return {
        "eval_auc": float(auroc.compute()),
        "eval_logloss": float(bce_sum / count),
        "eval_samples": int(count),
    }
