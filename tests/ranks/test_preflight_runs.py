"""A run that needs no evaluation trains on prepared files that have no eval split."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CRITEO, compose_config

from recsys.app.train import train


@pytest.mark.slow
def test_no_evaluation_needs_no_eval_split(criteo, tmp_path: Path) -> None:
    """dataset.eval_batches=0 with nothing held out trains (it was refused in the ranks)."""
    cfg = CRITEO + [
        f"dataset.path={criteo[1]}",
        "dataset.holdout_fraction=0",
        "dataset.eval_batches=0",
        "trainer.max_steps=3",
    ]
    summary = train(compose_config(cfg), tmp_path)
    assert summary["steps"] == 3 and summary["eval_auc"] is None
