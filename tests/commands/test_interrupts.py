"""Ctrl-C, SIGTERM (what Docker, Kubernetes and Slurm send) and a killed launcher: every
command stops its ranks or workers, removes partial outputs, says in one line what was kept
and exits 130 / 143; no child outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO
from support import descendants, sigint_default

from recsys.checkpoint import verified_checkpoint
from recsys.data.synthetic_files import SynthConfig, synthesize

pytestmark = pytest.mark.slow


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])
    except OSError:
        return None


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(p)
    return alive


def _start(args: list[str], until: Callable[[], bool], timeout_s: float = 120):
    """Start a command in its own process group; return it once `until()` holds."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=sigint_default,
    )
    deadline = time.monotonic() + timeout_s
    while not until():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"never got there (exit {proc.returncode}): {err[-3000:]}")
        time.sleep(0.1)
    return proc


def _train(run: Path, *extra: str):
    args = [
        "recsys.train",
        "debug=tiny",
        "trainer.max_steps=100000",
        "trainer.log_every=5",
        "trainer.checkpoint_every=20",
        f"hydra.run.dir={run}",
        *extra,
    ]
    return _start(args, lambda: (run / "checkpoints" / "step_00000020" / ".metadata").exists())


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pids)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_training_stops_every_rank_keeps_the_summary_so_far(tmp_path: Path, sig, code) -> None:
    run = tmp_path / "run"
    proc = _train(run)
    ranks = descendants(proc.pid)
    assert len(_alive(ranks)) >= 3, ranks  # the ranks, the fork server (and its helper)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the whole process group
    else:
        proc.send_signal(sig)  # SIGTERM: to the launcher alone, as Docker sends it
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-3000:]
    assert _gone_within(ranks, 5)
    name = signal.Signals(sig).name
    lines = [ln for ln in err.splitlines() if ln.startswith("interrupted")]
    assert lines == [
        f"interrupted ({name}): every rank stopped; kept the summary so far "
        f"({json.loads((run / 'summary.json').read_text())['steps_done']} steps): "
        f"{run / 'summary.json'}; last checkpoint: {run / 'checkpoints'}/"
        f"step_{lines[0].split('step_')[-1]}"
    ], err[-3000:]
    assert "Traceback" not in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] == name and summary["steps_done"] >= 20
    assert Path(summary["last_checkpoint"]).name.startswith("step_")
    whole = sorted((run / "checkpoints").glob("step_*"))  # verified: every file as written
    assert whole and all(verified_checkpoint(p) == p for p in whole)
    assert not list((run / "checkpoints").glob(".step_*"))  # nothing half-written left
    losses = (run / "train_losses.csv").read_text().split()[1:]
    assert len(losses) >= 20 and losses[0].startswith("1,")


def test_ranks_end_when_their_launcher_is_killed(tmp_path: Path) -> None:
    proc = _train(tmp_path / "run")
    ranks = descendants(proc.pid)
    assert _alive(ranks)
    proc.kill()  # SIGKILL: nothing of the launcher runs
    proc.communicate(timeout=30)
    assert _gone_within(ranks, 10), _alive(ranks)


def test_a_killed_rank_fails_the_run_naming_it_and_keeps_what_it_had(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _train(run, "trainer.dist_timeout_s=20")
    try:
        direct = [p for p in descendants(proc.pid) if _parent(p) == proc.pid]
        ranks = [p for p in descendants(proc.pid) if _parent(p) in direct]  # the fork server's
        assert ranks, descendants(proc.pid)
        os.kill(ranks[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # whatever failed above: no run left training
    assert proc.returncode == 1, err[-3000:]
    assert "killed by SIGKILL" in err and "first failure: rank" in err, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert "SIGKILL" in summary["failed"], summary
    assert Path(summary["last_checkpoint"]).name >= "step_00000020"
    assert verified_checkpoint(summary["last_checkpoint"])
    assert summary["last_good_step"] >= 20 and not list((run / "checkpoints").glob(".step_*"))
    rows = (run / "train_losses.csv").read_text().split()[1:]
    assert len(rows) == summary["last_good_step"]


def test_sigterm_to_prepare_removes_the_partial_output_and_its_workers(tmp_path: Path) -> None:
    src = tmp_path / "tsv"
    synthesize(SynthConfig(output=str(src), rows=400_000, scale=1000))
    proc = _start(
        [
            "recsys.data.prepare",
            f"input={src}",
            f"output={tmp_path / 'bin'}",
            "workers=2",
            "chunk_mb=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        lambda: bool(list(tmp_path.glob(".bin.partial-*/*"))),
    )
    workers = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert (
        f"interrupted (SIGTERM): removed the partial output; '{tmp_path / 'bin'}' is unchanged"
        in err
        and "Traceback" not in err
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "tsv"]
    assert _gone_within(workers, 10), _alive(workers)


def test_every_command_body_stops_on_sigterm_in_one_line(capsys) -> None:
    """`recsys.console.command()`, which the data commands and `sharding.plan`, `profile` and
    `predict` run in: SIGTERM mid-work is one line and exit 143."""
    from recsys.console import command

    with pytest.raises(SystemExit) as e, command():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        pytest.fail("SIGTERM did not stop the command")
    assert e.value.code == 143
    assert capsys.readouterr().err.strip() == "interrupted (SIGTERM): nothing was written"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored after the command


def test_a_swallowed_interrupt_is_raised_again() -> None:
    """The handler can run where Python ignores exceptions (seen: logging's fork hook while
    prepare's pool forked a worker, and prepare then finished with exit 0): the command still
    stops, at the next check or on leaving `interruptible()`."""
    from recsys import interrupts

    with pytest.raises(interrupts.Interrupted) as e, interrupts.interruptible():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except BaseException:  # noqa: B036 - what a fork hook or finalizer does with it
            pass
    assert e.value.exit_code == 143
    interrupts.clear()
    interrupts.check()  # handled: nothing pending
