"""A directory of outputs written whole or not at all.

`atomic_dir(path, overwrite)` hands out a temporary directory beside `path`; when the block
ends normally it is renamed into place (replacing `path` whole with `overwrite`), and on an
error or Ctrl-C it is removed, saying so, and `path` stays as it was. A non-empty `path` is
refused unless `overwrite`: outputs of two runs never mix in one directory. An output that is,
contains or lies inside one of the command's `inputs` is refused whatever `overwrite` says:
no command replaces, or writes into, what it reads.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from recsys import interrupts
from recsys.console import command
from sharding.errors import UserError

T = TypeVar("T")


class OutputDirError(UserError, ValueError):
    """An output directory that cannot or must not be written; the message says why."""


def check_not_input(output: str | Path, inputs: Iterable[str | Path]) -> None:
    """Refuse an output directory that is, contains or lies inside an input."""
    out = Path(output).resolve()
    for given in inputs:
        inp = Path(given).resolve()
        if out == inp:
            how = "is"
        elif out in inp.parents:
            how = "contains"
        elif inp in out.parents:
            how = "lies inside"
        else:
            continue
        folder = inp if inp.is_dir() else inp.parent
        raise OutputDirError(
            f"output '{output}' {how} the input '{given}': writing there would replace or mix "
            f"with what is read. Name an output directory outside the input, e.g. "
            f"output={folder.parent / (folder.name + '_out')}"
        )


def check_output(path: Path, overwrite: bool) -> None:
    """Refuse a file at `path`, or a non-empty directory unless `overwrite`."""
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"output '{path}' is a file; name a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputDirError(
            f"output '{path}' is not empty; pass overwrite=true to replace it whole, or name "
            f"a new directory"
        )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def _writer_lock(path: Path) -> Iterator[None]:
    """`path` written by this command alone: an exclusive flock on `.<name>.lock` beside it
    (released even by SIGKILL), removed after. Another command writing the same output is
    refused at once, naming it."""
    lock = path.with_name(f".{path.name}.lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputDirError(
                f"output '{path}' is being written by another command (pid {holder}); wait for "
                f"it, or name another output"
            ) from None
        try:  # the file may have been removed by its last holder between open and flock
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


@contextmanager
def atomic_dir(
    path: str | Path, overwrite: bool = False, inputs: Iterable[str | Path] = ()
) -> Iterator[Path]:
    """A temporary directory to write into; `path` once everything is written. `inputs`:
    what the command reads, which `path` must neither be, contain nor lie inside. Two
    commands writing one output at once cannot both succeed: the second is refused."""
    check_not_input(path, inputs)
    path = Path(path).absolute()
    check_output(path, overwrite)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputDirError(f"cannot write to output '{path}': {e.strerror}") from None
    with _writer_lock(path):
        check_output(path, overwrite)  # again, now that no one else writes it
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
            tmp.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would hide it from others sharing it
        except OSError as e:
            raise OutputDirError(f"cannot write to output '{path}': {e.strerror}") from None
        try:
            yield tmp
            interrupts.check()  # never rename into place what an interrupted command wrote
        except BaseException as e:  # noqa: B036 - an error, Ctrl-C or SIGTERM: nothing partial
            shutil.rmtree(tmp, ignore_errors=True)
            said = f"removed the partial output; '{path}' is unchanged"
            if isinstance(e, KeyboardInterrupt):
                said = f"interrupted ({getattr(e, 'name', 'SIGINT')}): {said}"
                e.reported = True  # type: ignore[attr-defined] - run_cli says nothing more
            print(said, file=sys.stderr)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OutputDirError(
                    f"disk full writing output '{path}' ({e.strerror}): nothing was kept; free "
                    f"space there or name an output on another disk"
                ) from e
            raise
        _into_place(tmp, path, overwrite)


def _into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    """`tmp` renamed to `path`; an existing `path` replaced whole only with `overwrite` (one
    that appeared while `tmp` was written, by a writer that took no lock, is refused)."""
    old = None
    if path.exists():
        if not overwrite and (not path.is_dir() or any(path.iterdir())):
            shutil.rmtree(tmp, ignore_errors=True)
            raise OutputDirError(
                f"output '{path}' appeared while this command wrote it (another command?): "
                f"nothing was replaced; pass overwrite=true to replace it, or name another output"
            )
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old)


def run_cli(job: Callable[[], T], report: Callable[[T], str]) -> T:
    """A data command's body: `job()`, then `report(result)` printed. A user's error is one
    line and exit 1; Ctrl-C or SIGTERM (after `atomic_dir` removed the partial output) is one
    line and exit 130 or 143 (`recsys.console.command`). All of it also goes to the log."""
    with command():
        result = job()
        print(report(result))
        return result
