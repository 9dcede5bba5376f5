"""What each command prints reaches its log; piped progress is plain lines; a rank that dies
in native code leaves its reason in the run's log; a failed sweep job says why on the console."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import rank_jobs
from conftest import REPO

from recsys.launch import RankFailedError, raise_on_failure, spawn_ranks


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600, **kw
    )


@pytest.mark.slow
def test_data_commands_log_what_they_print_and_pipe_plain_lines(tmp_path: Path) -> None:
    synth = _run(
        [
            "recsys.data.synth",
            f"output={tmp_path / 'tsv'}",
            "rows=30000",
            f"hydra.run.dir={tmp_path / 's'}",
        ]
    )
    prep = _run(
        [
            "recsys.data.prepare",
            f"input={tmp_path / 'tsv'}",
            f"output={tmp_path / 'b'}",
            f"hydra.run.dir={tmp_path / 'p'}",
        ]
    )
    for proc, log, first, last in (
        (synth, tmp_path / "s" / "synth.log", "synth train.txt: rows ", "wrote "),
        (prep, tmp_path / "p" / "prepare.log", "prepare train.txt: MB ", "30,000 rows from 1"),
    ):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "\r" not in proc.stderr  # piped: lines, not a redrawn bar
        text = log.read_text()
        assert first in text and last in text, text
        assert proc.stdout.strip().splitlines()[-1] in text


@pytest.mark.slow
def test_the_training_log_holds_progress_and_the_result(tmp_path: Path) -> None:
    proc = _run(
        ["recsys.train", "debug=tiny", "trainer.progress_bar=true", f"hydra.run.dir={tmp_path}"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "train.log").read_text()
    # the run's own figures (its plan, and so its loss, follows the machine's calibration)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert f"train plain x2: step 6/6 (100%), loss {summary['train_loss']:.4f}" in log, log
    assert f"eval AUC {summary['eval_auc']:.4f}" in log  # from rank 0
    assert f"summary: {tmp_path / 'summary.json'}" in log
    assert "SplitTableBatchedEmbeddingBagsCodegen" not in log + proc.stderr  # FBGEMM's chatter


@pytest.mark.slow
def test_torchrun_shows_what_the_local_launcher_shows(tmp_path: Path) -> None:
    ok = _run(
        [
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "recsys.train",
            "debug=tiny",
            f"hydra.run.dir={tmp_path / 'ok'}",
        ]
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "SplitTableBatchedEmbeddingBagsCodegen" not in ok.stdout + ok.stderr
    assert len((ok.stdout + ok.stderr).splitlines()) < 15
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    result = f"eval AUC {summary['eval_auc']:.4f}"  # once: rank 0's, not one per rank
    assert (tmp_path / "ok" / "train.log").read_text().count(result) == 1
    wrong = _run(
        [
            "torch.distributed.run",
            "--nproc_per_node",
            "3",
            "-m",
            "recsys.train",
            "debug=tiny",
            f"hydra.run.dir={tmp_path / 'wrong'}",
        ]
    )
    errors = [ln for ln in wrong.stderr.splitlines() if ln.startswith("error:")]
    assert wrong.returncode != 0 and errors == [
        "error: cluster 'local_cpu2' has 2 ranks but 3 processes were started (torchrun "
        "--nnodes x --nproc_per_node, or Slurm's tasks); start 2, or name a cluster with 3 "
        "devices"
    ], wrong.stderr[-3000:]
    assert wrong.stderr.index(errors[0]) < 1000  # near the top, not buried


def test_a_native_abort_leaves_its_reason_in_the_log(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "train.log"
    monkeypatch.setenv("RECSYS_LOG_FILE", str(log))
    job = spawn_ranks(rank_jobs.native_abort, 1, timeout_s=60)
    assert job.exitcodes == [-6]
    says = "a native abort, e.g. NCCL's watchdog ending a collective that timed out"
    with pytest.raises(RankFailedError, match=says):
        raise_on_failure(job, "training", log)
    text = log.read_text()
    assert "collective mismatch" in text and "python side: about to abort" in text


@pytest.mark.slow
def test_a_failed_sweep_job_says_why_on_the_console(tmp_path: Path) -> None:
    proc = _run(
        [
            "recsys.train",
            "-m",
            "debug=tiny",
            "trainer.lr=1e30",
            "trainer.dense_optimizer=sgd",
            f"hydra.sweep.dir={tmp_path}",
        ]
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("job 0 failed:"))
    assert "train loss is" in line and "at step" in line, line
