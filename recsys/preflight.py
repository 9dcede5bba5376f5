"""What a training run checks in the parent before any rank starts, beyond the config's own
ranges (`recsys.config.check_train_config`): the data, the directories it will write, and
that no other run is using its run directory. Each failure is one line naming the key or
the file and the fix, instead of the same error from every rank half a minute later.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from recsys.checkpoint import STEP_PREFIX, checkpoint_run_id, remove_partial
from recsys.config import DataKind, TrainConfig, TrainConfigError
from recsys.data.criteo_binary import CriteoBinary
from recsys.data.prepared import check_values
from recsys.data.source import build_source

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"
OWNER_FILE = "owner.json"  # in a checkpoint directory: {"run_id", "run_dir"} of its run


def check_data(cfg: TrainConfig, world: int, shares: list[int] | None) -> None:
    """Open the dataset as the ranks will (`shares`: each rank's batch, None for equal):
    a missing or raw-text `dataset.path`, incomplete or unreadable files, hotness files,
    splits smaller than one batch, and values no model can train on (`check_values`) are
    refused here, naming the file."""
    if DataKind(cfg.dataset.kind) == DataKind.synthetic:
        return  # generated in memory: nothing to open
    source = build_source(
        cfg.dataset, cfg.model, cfg.trainer.batch_size, world, batch_per_rank=shares
    )
    if cfg.dataset.check_values and isinstance(source, CriteoBinary):
        tables = cfg.model.num_embeddings_per_feature
        beyond = check_values(Path(cfg.dataset.path), source.names, tables)
        if beyond:
            log.info(
                "dataset: ids at or past their table's size are taken modulo it (%s)",
                ", ".join(f"{f}: ids up to {top:,}" for f, top in beyond.items()),
            )


def check_writable(path: Path, key: str) -> None:
    """Create `path` if needed and write a file into it, or refuse naming `key`: an
    unwritable checkpoint directory found after all the training loses the run's results."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise TrainConfigError(
            f"{key}: cannot write to '{path}' ({e.strerror}); name a writable directory"
        ) from None


def check_outputs(cfg: TrainConfig, run_dir: Path) -> None:
    """The run directory and, when the run saves checkpoints, their directory."""
    check_writable(run_dir, "hydra.run.dir")
    t = cfg.trainer
    if (t.save_checkpoint or t.checkpoint_every) and not t.dry_run:
        check_writable(Path(t.checkpoint_dir or run_dir / "checkpoints"), "trainer.checkpoint_dir")


class _Flock:
    """An advisory flock on `path` (released when the process ends, even by SIGKILL), the
    holder's pid written in it; `busy(pid)` is the error when another live process holds it."""

    def __init__(self, path: Path, busy: Callable[[str], Exception]) -> None:
        self.path = path
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise busy(holder) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RunDirLock(_Flock):
    """Holds `<run dir>/.run.lock` while a run uses the directory. Refused: a directory
    another live run holds, or one holding a finished run's summary.json unless this run
    resumes (its outputs would overwrite the other's)."""

    def __init__(self, run_dir: Path, resuming: bool) -> None:
        super().__init__(
            run_dir / LOCK_NAME,
            lambda pid: TrainConfigError(
                f"run directory '{run_dir}' is in use by another run (pid {pid}); give this "
                f"run its own hydra.run.dir"
            ),
        )
        if _holds_a_result(run_dir) and not resuming:
            self.release()
            raise TrainConfigError(
                f"run directory '{run_dir}' holds a finished run (summary.json); give this run "
                f"its own hydra.run.dir, or resume that run with trainer.resume_from"
            )


def _holds_a_result(run_dir: Path) -> bool:
    """A summary.json of a run that did not fail (a failed run's directory may be reused)."""
    try:
        return "failed" not in json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError:
        return False
    except ValueError:
        return True


class CheckpointDirLock(_Flock):
    """A checkpoint directory belongs to one run (`run_id`: a resumed run keeps the one of
    the checkpoint it resumes). Held while the run writes there (`.run.lock`), and claimed in
    `owner.json`; refused: a directory another live run holds, or one holding another run's
    checkpoints. Checkpoints a killed writer left half-written go."""

    def __init__(self, path: Path, run_id: str, run_dir: Path) -> None:
        fix = (
            "give this run its own trainer.checkpoint_dir, or resume that run with "
            f"trainer.resume_from={path}"
        )
        super().__init__(
            path / LOCK_NAME,
            lambda pid: TrainConfigError(
                f"trainer.checkpoint_dir '{path}' is in use by another run (pid {pid}); {fix}"
            ),
        )
        owner = _checkpoint_owner(path)
        if owner is not None and owner.get("run_id") != run_id:
            self.release()
            raise TrainConfigError(
                f"trainer.checkpoint_dir '{path}' holds the checkpoints of another run (run "
                f"directory {owner.get('run_dir', 'unknown')}); {fix}"
            )
        remove_partial(path)
        if owner is None:  # no checkpoint yet: this run's from now on
            owner_file = path / OWNER_FILE
            owner_file.write_text(json.dumps({"run_id": run_id, "run_dir": str(run_dir)}) + "\n")


def _checkpoint_owner(path: Path) -> dict | None:
    """Who the checkpoints in `path` belong to: its owner.json, else the newest checkpoint's
    manifest (checkpoints written without a claim); None where it holds no checkpoint."""
    if not any(path.glob(f"{STEP_PREFIX}*")):
        return None
    try:
        return json.loads((path / OWNER_FILE).read_text())
    except FileNotFoundError:
        return {"run_id": checkpoint_run_id(path), "run_dir": "unknown"}
    except ValueError:
        return {"run_dir": f"unknown: '{path / OWNER_FILE}' is corrupt"}
