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
    A figure the data leaves undefined is None, never a number, and `eval_undefined` says
    why: every figure when a prediction is NaN or infinite; AUC and NE when the labels are
    all of one class (NE divides by the base rate's entropy, 0 there). Else it is None.
    """
    auroc = BinaryAUROC().to(device)  # computes over every rank's predictions
    bce_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    positives = torch.zeros((), dtype=torch.float64, device=device)
    bad = torch.zeros((), dtype=torch.float64, device=device)  # predictions NaN or inf
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
            bad += (~torch.isfinite(logits)).sum()
    model.train(was_training)
    bce_sum, count = all_reduce_sum(bce_sum, device), all_reduce_sum(count, device)
    positives, bad = all_reduce_sum(positives, device), all_reduce_sum(bad, device)
    n, pos, bad = int(count), int(positives), int(bad)
    out = {
        "eval_auc": None,
        "eval_logloss": None,
        "eval_ne": None,
        "eval_samples": n,
        "eval_undefined": undefined_reason(n, pos, bad),
    }
    if bad:  # every rank decides alike: the counts are global
        return out
    out["eval_logloss"] = float(bce_sum / count)
    if 0 < pos < n:
        out["eval_auc"] = float(auroc.compute())
        out["eval_ne"] = normalized_entropy(bce_sum, count, positives)
    return out


def undefined_reason(samples: int, positives: int, non_finite: int) -> str | None:
    """Why some held-out figures are undefined (None: all are defined)."""
    if non_finite:
        return (
            f"{non_finite:,} of {samples:,} predictions are NaN or infinite: no figure is "
            f"defined (the model diverged, or the data holds NaN)"
        )
    if samples and positives in (0, samples):
        return (
            f"all {samples:,} held-out labels are {int(positives > 0)}: AUC and NE are "
            f"undefined for one class (use a split that holds both)"
        )
    return None


def normalized_entropy(
    bce_sum: torch.Tensor, count: torch.Tensor, positives: torch.Tensor
) -> float:
    """NE: the log loss over the entropy of the base rate (TorchRec's RecMetrics NE, its
    `compute_ne`, which takes the summed cross entropy in bits: `bce_sum` is in nats, as
    torch's BCE gives it). 1 predicts no better than the click rate; lower is better."""
    bits = bce_sum / math.log(2)
    return float(compute_ne(bits, count, positives, count - positives, eta=1e-12))
