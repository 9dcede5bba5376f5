"""Hydra sweeps of `recsys.train -m`: every point runs; a failed job is recorded, the sweep goes
on and exits with the count of failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_command


@pytest.mark.slow
def test_multirun_sweep_runs_every_point(tmp_path: Path) -> None:
    # in this process (tests/commands/test_logs.py starts a sweep as a process)
    proc = run_command(
        "recsys.train", "-m", "trainer.lr=0.01,0.1", "debug=tiny", f"hydra.sweep.dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert len(summaries) == 2
    losses = [json.loads(p.read_text())["train_loss"] for p in summaries]
    assert losses[0] != losses[1]  # the two learning rates really differed


def test_a_sweep_records_failed_jobs_goes_on_and_exits_with_their_count(tmp_path: Path) -> None:
    proc = run_command(
        "recsys.train",
        "-m",
        "trainer.dry_run=true",
        "planner=hybrid",
        "trainer.lr=-1,0.1,nan",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    failed = (tmp_path / "0" / "failed.txt").read_text()
    assert failed.startswith("TrainConfigError: trainer.lr must be a finite number > 0, got -1.0")
    assert "Traceback" in failed
    assert (tmp_path / "1" / "summary.json").exists()  # the job after a failure still ran
    assert not (tmp_path / "1" / "failed.txt").exists()
    assert "got nan" in (tmp_path / "2" / "failed.txt").read_text()
    assert f"2 sweep job(s) failed: {tmp_path / '0'}, {tmp_path / '2'}" in proc.stderr
