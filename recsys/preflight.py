"""What a training run checks in the parent before any rank starts, beyond the config's own
ranges (`recsys.config.check_train_config`): the data, the directories it will write, and
that no other run is using its run directory. Each failure is one line naming the key or
the file and the fix, instead of the same error from every rank half a minute later.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from recsys.config import DataKind, TrainConfig, TrainConfigError
from recsys.data.source import build_source

LOCK_NAME = ".run.lock"


def check_data(cfg: TrainConfig, world: int, shares: list[int] | None) -> None:
    """Open the dataset as the ranks will (`shares`: each rank's batch, None for equal):
    a missing or raw-text `dataset.path`, incomplete or unreadable files, hotness files,
    and splits smaller than one batch are refused here, naming the file."""
    if DataKind(cfg.dataset.kind) == DataKind.synthetic:
        return  # generated in memory: nothing to open
    build_source(cfg.dataset, cfg.model, cfg.trainer.batch_size, world, batch_per_rank=shares)


def check_writable(path: Path, key: str) -> None:
    """Create `path` if needed and write a file into it, or refuse naming `key`: an
    unwritable checkpoint directory found after all the training loses the run's results."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise TrainConfigError(f"{key}: cannot write to '{path}' ({e.strerror}); name a "
                               f"writable directory") from None  # fmt: skip


def check_outputs(cfg: TrainConfig, run_dir: Path) -> None:
    """The run directory and, when the run saves checkpoints, their directory."""
    check_writable(run_dir, "hydra.run.dir")
    t = cfg.trainer
    if (t.save_checkpoint or t.checkpoint_every) and not t.dry_run:
        check_writable(Path(t.checkpoint_dir or run_dir / "checkpoints"), "trainer.checkpoint_dir")


class RunDirLock:
    """Holds `<run dir>/.run.lock` (an advisory flock, released when the process ends, even
    by SIGKILL) while a run uses the directory. Refused: a directory another live run holds,
    or one holding a finished run's summary.json unless this run resumes (its outputs would
    overwrite the other's)."""

    def __init__(self, run_dir: Path, resuming: bool) -> None:
        self.path = run_dir / LOCK_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise TrainConfigError(
                f"run directory '{run_dir}' is in use by another run (pid {holder}); give this "
                f"run its own hydra.run.dir"
            ) from None
        if (run_dir / "summary.json").exists() and not resuming:
            self.release()
            raise TrainConfigError(
                f"run directory '{run_dir}' holds a finished run (summary.json); give this run "
                f"its own hydra.run.dir, or resume that run with trainer.resume_from"
            )
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
