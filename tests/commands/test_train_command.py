"""`python -m recsys.train` refusing bad input in one line (a zero timeout, a planner value out
of range, missing data), ending cleanly when no figure can be computed, and forking its
ranks' server only where ranks may start."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import CRITEO, run_command

from recsys.app import train as app


@pytest.mark.slow
def test_the_cli_prints_a_data_error_once(criteo, tmp_path: Path) -> None:
    raw = criteo[0]
    proc = run_command("recsys.train", *CRITEO, f"dataset.path={raw}", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: no prepared Criteo files "), errors
    assert not (tmp_path / "plan_layout.json").exists()  # what rank 0 writes first


def test_the_cli_refuses_a_zero_timeout_in_one_line(tmp_path: Path) -> None:
    proc = run_command("recsys.train", "trainer.dist_timeout_s=0", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: trainer.dist_timeout_s must be a finite number > 0, got 0.0"
    )


@pytest.mark.parametrize(
    "command", [["recsys.train"], ["recsys.train", "planner=hybrid"], ["sharding.plan"]]
)
def test_a_planner_value_out_of_range_is_one_line(tmp_path: Path, command: list[str]) -> None:
    """TorchRec's planner (the default) plans in the ranks, ours in the parent, the plan
    command in-process: each refuses the value in one line."""
    proc = run_command(*command, "planner.storage_reservation=1.0", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: planner.storage_reservation is the share of each device's memory kept free"
        )
    )


@pytest.mark.slow
def test_a_run_without_timed_steps_or_evaluation_ends_cleanly(tmp_path: Path) -> None:
    proc = run_command(
        "recsys.train",
        "trainer.max_steps=3",
        "trainer.warmup_steps=3",
        "dataset.eval_batches=0",
        "trainer.progress_bar=false",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval AUC n/a | eval log loss n/a" in proc.stdout and "n/a samples/s" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["samples_per_s"] is None and summary["eval_auc"] is None
    assert summary["host_page_faults_per_step"] is None
    assert summary["cpu_ms_per_step_by_rank"] is None
    assert summary["quota_throttled_share_by_rank"] is None
    assert summary["steps"] == 3 and summary["train_loss"] is not None


@pytest.mark.parametrize(
    ("args", "forks"),
    [(["--help"], 0), (["--cfg", "job"], 0), (["--cfg=job"], 0), (["trainer.max_steps=1"], 1)],
)
def test_the_command_forks_its_ranks_server_only_where_ranks_may_start(
    monkeypatch, args, forks
) -> None:
    """`python -m recsys.train` (`cli(serve_forks=True)`): its fork server is forked before a
    run, not for Hydra's options that only print; an in-process call never forks it."""
    calls = []
    monkeypatch.setattr(app.launch, "serve_forks_from_here", lambda: calls.append(1))
    monkeypatch.setattr(app, "main", lambda: None)
    monkeypatch.setattr(sys, "argv", ["recsys.train", *args])
    for serve, expected in ((True, forks), (False, 0)):
        calls.clear()
        with pytest.raises(SystemExit):
            app.cli(serve_forks=serve)
        assert len(calls) == expected, (serve, args)
