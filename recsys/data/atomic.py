"""A directory of outputs written whole or not at all.

`atomic_dir(path, overwrite)` hands out a temporary directory beside `path`; when the block
ends normally it is renamed into place (replacing `path` whole with `overwrite`), and on an
error or Ctrl-C it is removed, saying so, and `path` stays as it was. A non-empty `path` is
refused unless `overwrite`: outputs of two runs never mix in one directory. An output that is,
contains or lies inside one of the command's `inputs` is refused whatever `overwrite` says:
no command replaces, or writes into, what it reads.
"""

from __future__ import annotations

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
def atomic_dir(
    path: str | Path, overwrite: bool = False, inputs: Iterable[str | Path] = ()
) -> Iterator[Path]:
    """A temporary directory to write into; `path` once everything is written. `inputs`:
    what the command reads, which `path` must neither be, contain nor lie inside."""
    check_not_input(path, inputs)
    path = Path(path).absolute()
    check_output(path, overwrite)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
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
        raise
    old = None
    if path.exists():  # checked above: empty, or overwrite
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
