"""Held-out evaluation: AUC, log loss and normalized entropy over all ranks' eval batches."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch
from torchrec.metrics.ne import compute_ne

from recsys.collectives import all_reduce_sum


def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device) -> dict:
    """Eval AUC, log loss and NE of a (DMP-wrapped) DLRMTrain model, synced over all ranks.

    The model must return `(loss, (loss, logits, labels))`. Restores train mode after.
    """
    auroc = BinaryAUROC().to(device)  # computes over every rank's predictions
    bce_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    positives = torch.zeros((), dtype=torch.float64, device=device)
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
            positives += labels.double().sum()
    model.train(was_training)
    bce_sum, count = all_reduce_sum(bce_sum, device), all_reduce_sum(count, device)
    positives = all_reduce_sum(positives, device)
    return {
        "eval_auc": float(auroc.compute()),
        "eval_logloss": float(bce_sum / count),
        "eval_ne": normalized_entropy(bce_sum, count, positives),
        "eval_samples": int(count),
    }


def normalized_entropy(
    bce_sum: torch.Tensor, count: torch.Tensor, positives: torch.Tensor
) -> float:
    """NE: the log loss over the entropy of the base rate (TorchRec's RecMetrics NE, its
    `compute_ne`, which takes the summed cross entropy in bits: `bce_sum` is in nats, as
    torch's BCE gives it). 1 predicts no better than the click rate; lower is better."""
    bits = bce_sum / math.log(2)
    return float(compute_ne(bits, count, positives, count - positives, eta=1e-12))
