"""What a command prints also goes to its log file (Hydra's `<run dir>/<command>.log`), and
so does what its ranks print: a run's log holds its progress, its result and its errors,
not only the few lines that went through `logging`.

A rank's native (C++) stderr (gloo's aborts, FBGEMM's glog lines) goes to the log only:
when a rank dies inside a collective, the reason is in the run's log, not lost on a console.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from recsys.interrupts import clear, exit_code, interruptible
from sharding.errors import UserError

LOG_ENV = "RECSYS_LOG_FILE"  # set by the command, read by the ranks it starts


class _Tee(io.TextIOBase):
    """Writes to `stream` and `log`; asks `stream` whether it is a terminal. A terminal's
    redrawn lines (tqdm's `\\r` bars) stay out of the log."""

    def __init__(self, stream: IO[str], log: IO[str]) -> None:
        self.stream, self.log = stream, log
        self.broken = False  # the log could not be written: the console goes on alone

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        if "\r" not in text:
            self._to_log(lambda: self.log.write(text))
        return n

    def flush(self) -> None:
        self.stream.flush()
        self._to_log(self.log.flush)

    def _to_log(self, op: Callable[[], object]) -> None:
        """A failing log write (a full disk) never hides what the console shows, nor fails
        the command: said once, then the console alone."""
        if self.broken:
            return
        try:
            op()
        except (OSError, ValueError) as e:  # ValueError: the log was closed
            self.broken = True
            why = e.strerror if isinstance(e, OSError) else str(e)
            self.stream.write(
                f"(cannot write the log {getattr(self.log, 'name', '')}: {why}; "
                f"the output goes on here only)\n"
            )

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


def command_log() -> Path | None:
    """The file Hydra's job logging writes (its root FileHandler), if any."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return None


@contextmanager
def tee_to_log(path: Path | None = None) -> Iterator[None]:
    """Inside, stdout and stderr also go to `path` (default: the command's Hydra log), and
    ranks started here find it in the environment."""
    path = path or command_log()
    if path is None:
        yield
        return
    log = open(path, "a", buffering=1)  # noqa: SIM115 - closed below
    old = sys.stdout, sys.stderr
    tees = _Tee(old[0], log), _Tee(old[1], log)
    sys.stdout, sys.stderr = tees
    os.environ[LOG_ENV] = str(path)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old
        for tee in tees:  # a handler that kept one (logging's, flushed at exit): console only
            tee.broken = True
        os.environ.pop(LOG_ENV, None)
        with contextlib.suppress(OSError):  # a full disk: said once already by _Tee
            log.close()


def rank_output_to_log() -> None:
    """In a rank its command started: Python's output to the console and the command's log,
    native stderr to the log only."""
    path = os.environ.get(LOG_ENV)
    if not path or isinstance(sys.stderr, _Tee):  # torchrun: the command itself is the rank
        return
    log = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the rank
    console = os.fdopen(os.dup(2), "w", buffering=1)
    sys.stderr.flush()
    os.dup2(log.fileno(), 2)
    sys.stderr = _Tee(console, log)
    sys.stdout = _Tee(sys.stdout, log)


@contextmanager
def command(interrupted: Callable[[], str] = lambda: "nothing was written") -> Iterator[None]:
    """A command's body: what it prints also goes to its log; a `UserError` is one line,
    `error: ...`, and exit 1 (anything else keeps its traceback); Ctrl-C or SIGTERM is one
    line (`interrupted()`: what that leaves, asked once everything has stopped) and exit
    130 or 143."""
    with tee_to_log():
        try:
            with interruptible():
                yield
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            _exit(1, f"error: {e}")
        except KeyboardInterrupt as e:
            said = f"interrupted ({getattr(e, 'name', 'SIGINT')}): {interrupted()}"
            if not getattr(e, "reported", False):  # atomic_dir already said what it removed
                print(said, file=sys.stderr)
            clear()  # handled: a later command in this process starts afresh
            _exit(exit_code(e), said)


def _exit(code: int, said: str) -> None:
    """Exit with `code`; in a Slurm task under submitit (scancel sends SIGTERM) raise
    instead: an error submitit records as the task's result, so its launcher learns the job
    ended even on a cluster without accounting (no sacct), where an exit alone leaves it
    waiting for ever."""
    if os.environ.get("SUBMITIT_EXECUTOR"):
        raise RuntimeError(said) from None
    sys.exit(code)
