"""Held-out figures the data leaves undefined are reported as undefined, never as numbers
(recsys/metrics.py), and summary.json stays strict JSON (recsys/trainer/outputs.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.metrics import evaluate
from recsys.trainer.outputs import write_summary


class _Scores(torch.nn.Module):
    """A DLRMTrain-shaped model whose logit for a sample is its first dense feature."""

    def forward(self, batch: Batch):
        logits = batch.dense_features[:, 0]
        return logits.sum(), (logits.sum(), logits, batch.labels)


def _batches(logits: list[float], labels: list[int]) -> list[Batch]:
    dense = torch.tensor(logits, dtype=torch.float32)[:, None]
    no_ids = KeyedJaggedTensor.empty()
    return [Batch(dense, no_ids, torch.tensor(labels, dtype=torch.float32))]


def test_both_classes_give_every_figure() -> None:
    out = evaluate(_Scores(), _batches([2.0, -1.0, 0.5, -3.0], [1, 0, 1, 0]), torch.device("cpu"))
    assert out["eval_auc"] == 1.0 and out["eval_undefined"] is None
    assert out["eval_logloss"] > 0 and 0 < out["eval_ne"] < 1


def test_one_class_leaves_auc_and_ne_undefined_and_says_why() -> None:
    out = evaluate(_Scores(), _batches([2.0, -1.0, 0.5], [0, 0, 0]), torch.device("cpu"))
    assert out["eval_auc"] is None and out["eval_ne"] is None
    assert out["eval_logloss"] == pytest.approx(
        sum(math.log1p(math.exp(x)) for x in (2.0, -1.0, 0.5)) / 3
    )
    assert out["eval_undefined"] == (
        "all 3 held-out labels are 0: AUC and NE are undefined for one class (use a split that "
        "holds both)"
    )


def test_a_nan_prediction_leaves_every_figure_undefined() -> None:
    out = evaluate(
        _Scores(),
        _batches([float("nan"), 1.0, float("nan"), -1.0], [1, 0, 1, 0]),
        torch.device("cpu"),
    )
    assert (out["eval_auc"], out["eval_logloss"], out["eval_ne"]) == (None, None, None)
    assert out["eval_undefined"].startswith("2 of 4 predictions are NaN or infinite")


def test_summary_json_never_holds_nan(tmp_path: Path) -> None:
    write_summary(
        tmp_path,
        {
            "eval_auc": None,
            "train_loss": float("nan"),
            "cpu": [1.0, float("inf")],
            "step_losses": [float("nan")],
        },
    )
    text = (tmp_path / "summary.json").read_text()
    assert json.loads(text) == {"eval_auc": None, "train_loss": None, "cpu": [1.0, None]}
    assert "NaN" not in text and "Infinity" not in text
