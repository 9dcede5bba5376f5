"""Two ranks train on generated Criteo files, prepared by the converter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import compose_config, run_command

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


@pytest.mark.slow
def test_a_checkpoint_evaluates_on_the_whole_val_or_test_split(kaggle_files, tmp_path) -> None:
    """`python -m recsys.evaluate` loads the checkpoint a run saved and reports the run's own
    final evaluation (the whole val split: `dataset.eval_batches=null`), then the test
    split's, which the run never read; NE beside AUC and log loss."""
    _, binary = kaggle_files
    common = ["dataset=synthetic_criteo", f"dataset.path={binary}", "debug=tiny",
              "trainer.batch_size=32", "dataset.eval_batches=null"]  # fmt: skip
    run = train(compose_config(common + ["trainer.max_steps=6", "trainer.save_checkpoint=true"]),
                tmp_path / "run")  # fmt: skip
    # the val split: 429 rows, 6 whole global batches of 2 x 32
    assert run["eval_split"] == "val" and run["eval_samples"] == 6 * 64
    assert 0 < run["eval_ne"] < 2 and np.isfinite(run["eval_logloss"])
    ckpt = f"trainer.resume_from={run['checkpoint']}"
    val = run_command("recsys.evaluate", *common, ckpt, f"hydra.run.dir={tmp_path / 'val'}")
    assert val.returncode == 0, val.stderr[-2000:]
    line = f"val AUC {run['eval_auc']:.4f} | log loss {run['eval_logloss']:.4f} | NE "
    assert line in val.stdout and "384 samples | checkpoint step 6" in val.stdout
    summary = json.loads((tmp_path / "val" / "summary.json").read_text())
    assert summary["mode"] == "evaluate" and summary["eval_auc"] == run["eval_auc"]
    assert summary["eval_ne"] == pytest.approx(run["eval_ne"], rel=1e-12)
    test = run_command("recsys.evaluate", *common, ckpt, "dataset.eval_split=test",
                       f"hydra.run.dir={tmp_path / 'test'}")  # fmt: skip
    assert test.returncode == 0, test.stderr[-2000:]
    held = json.loads((tmp_path / "test" / "summary.json").read_text())
    assert held["eval_split"] == "test" and held["eval_samples"] == 6 * 64  # 428 rows
    assert held["eval_auc"] != run["eval_auc"]
    # a checkpoint at max_steps: training refuses it and says how to evaluate it instead
    again = run_command("recsys.train", *common, ckpt, "trainer.max_steps=6",
                        f"hydra.run.dir={tmp_path / 'again'}")  # fmt: skip
    assert again.returncode == 1
    assert "python -m recsys.evaluate trainer.resume_from=" in again.stderr
