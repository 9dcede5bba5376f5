"""Faults that must neither lose what a run had nor report a wrong figure with exit 0: a
full disk during a run, a validation split that leaves its figures undefined."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import CRITEO, run_command
from support import small_disk

pytestmark = pytest.mark.slow


def test_a_full_disk_fails_the_run_in_one_line_and_keeps_what_it_had(tmp_path: Path) -> None:
    """The run directory on a small disk: the checkpoint at step 3 does not fit. The console
    names the full disk and what was being written; the summary names the failure, the
    losses so far stay, the half-written checkpoint goes (and so frees the disk)."""
    with small_disk(tmp_path / "disk", "256k") as run:
        proc = run_command(
            "recsys.train",
            "debug=tiny",
            "trainer.checkpoint_every=3",
            "trainer.tensorboard=false",
            f"hydra.run.dir={run}",
        )
        assert proc.returncode == 1, proc.stderr[-3000:]
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        ckpt = run / "checkpoints" / "step_00000003"
        assert (
            f"disk full (ENOSPC): recsys.checkpoint.CheckpointWriteError: writing checkpoint "
            f"'{ckpt}' failed: No space left on device"
        ) in proc.stderr, proc.stderr[-3000:]
        assert f"kept {run / 'summary.json'} (losses checked to step 2); no checkpoint" in (
            proc.stderr
        )
        summary = json.loads((run / "summary.json").read_text())
        assert re.match(r"rank [01]: disk full \(ENOSPC\)", summary["failed"]), summary  # either
        assert summary["last_good_step"] == 2 and summary["last_checkpoint"] is None
        lines = (run / "train_losses.csv").read_text().split()
        assert lines[0] == "step,loss" and [ln.split(",")[0] for ln in lines[1:]] == ["1", "2"]
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
            ".run.lock",
            "owner.json",
        ]


def test_a_one_class_validation_split_is_undefined_not_zero(criteo, tmp_path: Path) -> None:
    data = tmp_path / "bin"
    shutil.copytree(criteo[1], data)
    labels = np.load(data / "train_labels.npy")
    labels[1700:] = 0  # the held-out rows (the last seventh): one class
    np.save(data / "train_labels.npy", labels)
    run = tmp_path / "run"
    proc = run_command(
        "recsys.train",
        *CRITEO,
        f"dataset.path={data}",
        "trainer.max_steps=2",
        f"hydra.run.dir={run}",
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("eval AUC"))
    assert line.startswith("eval AUC n/a | eval log loss 1.1142 | NE n/a |"), proc.stdout
    held = json.loads((run / "summary.json").read_text())["eval_samples"]
    assert held == 2 * 64  # dataset.eval_batches=2 of 64 samples
    assert proc.stderr.splitlines()[-1] == (
        f"error: the evaluation is not valid: all {held} held-out labels are 0: AUC and NE are "
        f"undefined for one class (use a split that holds both)"
    )
    summary = json.loads((run / "summary.json").read_text())  # strict JSON
    assert summary["eval_auc"] is None and summary["eval_ne"] is None
    assert summary["eval_logloss"] > 0 and summary["eval_undefined"].startswith(f"all {held}")


def test_your_own_data_without_dense_columns_trains(tmp_path: Path) -> None:
    from recsys.data.tabular import TabularConfig, convert_tabular

    rng = np.random.default_rng(0)
    rows = ["click,site,app,device"] + [
        f"{int(rng.random() < 0.3)},s{rng.integers(20)},a{rng.integers(30)},d{rng.integers(5)}"
        for _ in range(600)
    ]
    (tmp_path / "avazu.csv").write_text("\n".join(rows) + "\n")
    summary = convert_tabular(
        TabularConfig(
            input=str(tmp_path / "avazu.csv"),
            output=str(tmp_path / "data"),
            label="click",
            categorical=["site", "app", "device"],
            progress=False,
        )
    )  # no dense column
    proc = run_command(
        "recsys.train",
        "debug=tiny",
        "dataset=prepared",
        f"dataset.path={tmp_path / 'data'}",
        *summary["model_override"].split(),
        "trainer.batch_size=16",
        "dataset.eval_batches=1",
        "trainer.max_steps=2",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
