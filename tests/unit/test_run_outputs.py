"""What a run writes as it goes survives its faults: the losses (a resumed run keeps the rows
before it), the console when its log cannot be written, and one line when its summary
cannot be (recsys/trainer/outputs.py, recsys/console.py)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from support import small_disk

from recsys.console import _Tee, tee_to_log
from recsys.trainer.outputs import LossFile, OutputWriteError, read_losses, write_summary


def test_losses_are_on_disk_as_they_are_checked_and_a_resume_keeps_the_earlier_rows(
    tmp_path: Path,
) -> None:
    path = tmp_path / "train_losses.csv"
    first = LossFile(path, 0)
    first.add([0.9, 0.8])
    assert read_losses(path) == [(1, 0.9), (2, 0.8)]  # there before the run ends
    first.add([0.9, 0.8, 0.7, 0.6])
    resumed = LossFile(path, 2)  # from the checkpoint at step 2: steps 3-4 are redone
    assert read_losses(path) == [(1, 0.9), (2, 0.8)]
    resumed.add([0.71])
    assert path.read_text() == "step,loss\n1,0.9\n2,0.8\n3,0.71\n"


class _FullDisk(io.StringIO):
    name = "/run/train.log"

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


def test_a_log_that_cannot_be_written_leaves_the_console_alone() -> None:
    console = io.StringIO()
    tee = _Tee(console, _FullDisk())
    tee.write("step 1\n")
    tee.write("step 2\n")
    tee.flush()
    assert console.getvalue() == (
        "step 1\n(cannot write the log /run/train.log: No space left on device; the output "
        "goes on here only)\nstep 2\n"
    )


def test_a_tee_kept_past_the_command_goes_to_the_console_without_a_word(
    tmp_path: Path, monkeypatch
) -> None:
    """A handler made while the command ran keeps its stream (logging flushes it at exit):
    after the command, the log is closed and that is no fault to report."""
    console = io.StringIO()
    monkeypatch.setattr("sys.stdout", console)
    with tee_to_log(tmp_path / "cmd.log"):
        kept = sys.stdout
        print("planned")
    kept.write("after\n")
    kept.flush()
    assert console.getvalue() == "planned\nafter\n"
    assert (tmp_path / "cmd.log").read_text() == "planned\n"


def test_a_summary_that_does_not_fit_is_one_line_and_leaves_no_half(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "16k") as run:
        (run / "filler").write_bytes(b"x" * 12 * 1024)
        with pytest.raises(OutputWriteError) as e:
            write_summary(run, {"notes": "y" * 8192})
        assert str(e.value) == (
            f"cannot write '{run / 'summary.json'}' (No space left on device): the run's results "
            f"are in its log only; free space there or name another hydra.run.dir"
        )
        assert sorted(p.name for p in run.iterdir()) == ["filler"]
