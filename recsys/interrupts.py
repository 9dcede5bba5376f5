"""SIGINT and SIGTERM handled alike by every command, and no child outliving its parent.

Ctrl-C sends SIGINT; Docker, Kubernetes and Slurm send SIGTERM. Inside `interruptible()`
both raise `Interrupted` (a KeyboardInterrupt, so every cleanup written for Ctrl-C runs for
SIGTERM too), and the command exits with 128 + the signal's number (130, 143) after one
line saying what was kept. `die_with_parent()` makes a rank or worker receive SIGTERM when
the process that started it ends, however it ended (SIGKILL included).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; `exit_code` is the shell's 128 + signal number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def signum(e: KeyboardInterrupt) -> int:
    """The signal that raised `e`: a plain KeyboardInterrupt is Ctrl-C's SIGINT."""
    return e.signum if isinstance(e, Interrupted) else signal.SIGINT


def exit_code(e: KeyboardInterrupt) -> int:
    """The shell's 128 + the signal's number: 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + signum(e)


_RECEIVED: list[int] = []  # signals that raised Interrupted in this process, in order


def received() -> str | None:
    """The name of the first signal that interrupted this process, if any: a stop can
    surface as another error (a collective whose peer stopped first)."""
    return signal.Signals(_RECEIVED[0]).name if _RECEIVED else None


def clear() -> None:
    """Forget the signals received: the interruption they caused has been handled."""
    _RECEIVED.clear()


def check() -> None:
    """Raise `Interrupted` if a signal arrived inside `interruptible()` whose exception was
    swallowed: the handler can run where Python ignores exceptions (a fork hook, a
    finalizer: `Exception ignored in ...`), so long loops call this between steps."""
    if _RECEIVED:
        raise Interrupted(_RECEIVED[0])


def _raise(signum: int, _frame: Any) -> None:
    _RECEIVED.append(signum)
    raise Interrupted(signum)


@contextmanager
def interruptible() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise `Interrupted` (main thread only; elsewhere a no-op).
    An ignored SIGINT (a background job) stays ignored. A signal whose exception was
    swallowed inside is raised again on the way out (see `check`)."""
    clear()
    try:
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s, handler in old.items():
            if handler is not signal.SIG_IGN:
                signal.signal(s, _raise)
    except ValueError:  # not the main thread: signals are the main thread's to handle
        yield
        return
    try:
        yield
        check()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextmanager
def deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM held back inside, delivered on leaving: around work a signal's
    exception must not cut in half, such as starting worker processes. Children started
    inside inherit the block (across exec too): they call `unblock()`."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock() -> None:
    """In a process started inside `deferred()`: take the stop signals again."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def die_with_parent(parent_pid: int | None = None) -> None:
    """Linux: SIGTERM to this process when its parent ends (PR_SET_PDEATHSIG). If the
    parent (`parent_pid`, when given) is already gone, SIGTERM now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launchers' own cleanup still runs
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def die_when_closed(fd: int) -> None:
    """SIGTERM to this process once every write end of the pipe `fd` reads from is closed:
    its launcher holds one, so this ends with the launcher however that ended (a killed
    launcher's descriptors close at once, even before its parent reaps it). For ranks the
    fork server forked: their parent is the server, not the launcher."""

    def watch() -> None:
        while os.read(fd, 1):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()


def ignore_further() -> None:
    """A process that is stopping: a second Ctrl-C or SIGTERM must not cut short what it
    still writes (the launcher kills it if it takes too long)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(s, signal.SIG_IGN)
        except ValueError:  # not the main thread
            return
