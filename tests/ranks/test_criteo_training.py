"""Two ranks train on generated Criteo files, prepared by the converter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import compose_config

from recsys.app.train import train


@pytest.mark.slow
def test_two_rank_training_on_generated_files(kaggle_files, tmp_path: Path) -> None:
    _, binary = kaggle_files
    cfg = compose_config(["dataset=synthetic_criteo", f"dataset.path={binary}", "debug=tiny",
                          "trainer.batch_size=128", "trainer.max_steps=30"])  # fmt: skip
    summary = train(cfg, tmp_path)
    assert summary["world_size"] == 2 and summary["steps"] == 30
    # debug=tiny asks for 2 eval batches per rank; the val split (429 rows) holds 1 per rank
    assert summary["eval_samples"] == 2 * 1 * 128
    assert 0.0 < summary["eval_auc"] < 1.0 and np.isfinite(summary["train_loss"])
