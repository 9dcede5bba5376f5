"""Convert Criteo TSV files into TorchRec's binary Criteo layout, streaming in chunks.

For each input `<name>.<ext>[.gz]` it writes, as `BinaryCriteoUtils.tsv_to_npys` does:
- `<name>_dense.npy`: float32 [N, 13], log(x - min + 2) with min over the whole file
  (TorchRec's transform, the default; byte-identical to its converter on full-field rows).
  `dense_shift` puts one fixed value in place of each file's minimum (for multi-day data,
  where per-file minima map one count differently on different days), and
  `DenseTransform.log1p` is the DLRM reference's: negatives to 0, then log(x + 1). Counts
  below the floor never reach the transform (`criteo_tsv.LineRules`);
- `<name>_sparse.npy`: int64 [N, 26], the raw hex values (0 where missing);
- `<name>_labels.npy`: int32 [N, 1] (-1 for files without labels, e.g. Kaggle's test.txt).
Memory stays bounded by the chunk size times the number of chunks in flight: counts go to a
temporary int64 file first, then a second pass over that binary file applies the log.
Chunks are parsed in a pool of worker processes while the main process reads and writes.
"""

from __future__ import annotations

import gzip
import multiprocessing
import os
import re
import signal
import time
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import BinaryIO

import numpy as np

from recsys import interrupts
from recsys.data.criteo_tsv import (
    CAT_FEATURES,
    INT_FEATURES,
    BadInputError,
    LineRules,
    ParsedChunk,
    parse_lines,
)
from recsys.data.npy_io import NpyAppender
from recsys.interrupts import die_with_parent
from recsys.progress import Progress
from sharding.errors import UserError

TEXT_SUFFIXES = (".gz", ".txt", ".tsv", ".csv")
# text beside the data, never data: the Kaggle tarball's readme.txt
NOT_DATA = ("readme", "license", "notice")


class DenseTransform(str, Enum):
    torchrec = "torchrec"  # log(x - shift + 2), shift: the file's minimum or dense_shift
    log1p = "log1p"  # the DLRM reference: log(max(x, 0) + 1)


class LabelColumn(str, Enum):
    auto = "auto"  # no label column only in a file named test (Kaggle's test.txt)
    yes = "yes"
    no = "no"


@dataclass
class ConvertOptions:
    rules: LineRules = field(default_factory=LineRules)
    dense_transform: DenseTransform = DenseTransform.torchrec
    dense_shift: int | None = None  # torchrec transform: in place of each file's minimum
    label_column: LabelColumn = LabelColumn.auto
    chunk_mb: float = 16.0  # text per parse task
    workers: int = 0  # parse processes; 0: one per core (at most 4); 1: parse inline
    progress: bool = True


class InputNotFoundError(UserError, FileNotFoundError):
    """The input a data command was given does not exist or holds no Criteo text files."""


def output_name(path: Path) -> str:
    """`day_0.gz` -> `day_0`, `train.txt` -> `train`, `test.txt.gz` -> `test`."""
    name = path.name
    while True:
        stem, ext = os.path.splitext(name)
        if ext.lower() not in TEXT_SUFFIXES:
            return name
        name = stem


def input_files(input_path: str | Path) -> list[Path]:
    """A file, or every Criteo text file in a directory (sorted: day_2 before day_10)."""
    path = Path(input_path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise InputNotFoundError(f"input '{path}' is neither a file nor a directory")
    files = [
        p
        for p in path.iterdir()
        if p.is_file()
        and p.name.lower().endswith(TEXT_SUFFIXES)
        and not p.name.lower().startswith(NOT_DATA)
    ]
    files += [p for p in path.glob("day_*") if p.is_file() and "." not in p.name]  # 1TB: day_0
    if not files:
        raise InputNotFoundError(f"no Criteo text files (*.txt, *.tsv, *.gz, day_N) in '{path}'")
    return sorted(files, key=natural_key)


def natural_key(path: Path) -> tuple:
    return tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", path.name))


def has_label(path: Path, option: LabelColumn) -> bool:
    if option == LabelColumn.auto:
        return output_name(path) != "test"
    return option == LabelColumn.yes


def _open(path: Path) -> tuple[BinaryIO, BinaryIO]:
    """(text stream, raw file): progress follows the raw (compressed) position."""
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    if path.name.lower().endswith(".gz"):
        return gzip.GzipFile(fileobj=raw), raw
    return raw, raw


def _chunks(stream: BinaryIO, chunk_bytes: int, path: Path) -> Iterator[tuple[bytes, int]]:
    """Whole-line chunks and the 1-based number of their first line; the last line may lack
    its newline."""
    line, rest = 1, b""
    while True:
        try:
            block = stream.read(chunk_bytes)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise BadInputError(
                f"{path}: truncated or corrupt gzip file after line {line - 1:,} ({e}); "
                f"fetch or compress it again"
            ) from None
        if not block:
            break
        data = rest + block
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            rest = data
            continue
        yield data[:cut], line
        line += data.count(b"\n", 0, cut)
        rest = data[cut:]
    if rest:
        yield rest, line


@dataclass
class FileResult:
    name: str
    input: str
    rows: int
    bad_lines: int
    text_mb: float  # uncompressed
    seconds: float
    dense_shift: int | None  # torchrec transform: the value in place of the minimum
    dense_min: list[int]  # per count column, after clipping (missing counts are 0)
    dense_max: list[int]
    dense_clipped: list[int]  # counts clipped to the floor, per column
    unterminated_last_line: bool  # the file's last line had no newline (kept)


_I64 = np.iinfo(np.int64)


@dataclass
class _Tally:
    """What one file's parsed chunks add up to, beside the arrays they append."""

    bad: int = 0
    first_bad: str = ""
    unterminated: bool = False
    text_bytes: int = 0
    low_I: np.ndarray = field(default_factory=lambda: np.full(INT_FEATURES, _I64.max))
    high_I: np.ndarray = field(default_factory=lambda: np.full(INT_FEATURES, _I64.min))
    clipped_I: np.ndarray = field(default_factory=lambda: np.zeros(INT_FEATURES, np.int64))

    def add(self, chunk: ParsedChunk) -> None:
        self.bad += chunk.bad_lines
        self.first_bad = self.first_bad or chunk.first_bad
        self.unterminated |= chunk.unterminated
        if len(chunk.ints_NI):
            np.minimum(self.low_I, chunk.ints_NI.min(axis=0), out=self.low_I)
            np.maximum(self.high_I, chunk.ints_NI.max(axis=0), out=self.high_I)
        if chunk.clipped_I is not None:
            self.clipped_I += chunk.clipped_I


def _parsed(
    stream,
    path: Path,
    opts: ConvertOptions,
    labeled: bool,
    pool: ProcessPoolExecutor | None,
    workers: int,
    tally: _Tally,
) -> Iterator[ParsedChunk]:
    """The file's chunks parsed, in order (their text counted in `tally`); with a pool, up to
    2 chunks per worker are parsed while the next is read."""
    pending: deque[Future[ParsedChunk]] = deque()
    for data, first_line in _chunks(stream, int(opts.chunk_mb * 2**20), path):
        tally.text_bytes += len(data)
        args = (data, labeled, str(path), first_line, opts.rules)
        if pool is None:
            yield parse_lines(*args)
            continue
        pending.append(pool.submit(parse_lines, *args))
        while len(pending) >= 2 * workers:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def convert_file(
    path: Path, out_dir: Path, opts: ConvertOptions, pool: ProcessPoolExecutor | None, workers: int
) -> FileResult:
    """One file, parsed in chunks (by `pool`'s workers if given) into its three arrays."""
    start = time.perf_counter()
    name = output_name(path)
    raw_dense_path = out_dir / f".{name}_dense_raw.npy"
    tally = _Tally()
    stream, raw = _open(path)
    bar = Progress(
        path.stat().st_size,
        desc=f"prepare {path.name}",
        unit="MB",
        scale=1e6,
        enabled=opts.progress,
    )
    try:
        with (
            NpyAppender(out_dir / f"{name}_labels.npy", np.int32, 1) as labels,
            NpyAppender(raw_dense_path, np.int64, INT_FEATURES) as dense_raw,
            NpyAppender(out_dir / f"{name}_sparse.npy", np.int64, CAT_FEATURES) as sparse,
        ):
            labeled = has_label(path, opts.label_column)
            for chunk in _parsed(stream, path, opts, labeled, pool, workers, tally):
                labels.append(chunk.labels_N)
                dense_raw.append(chunk.ints_NI)
                sparse.append(chunk.cats_NC)
                tally.add(chunk)
                bar.update(raw.tell() - bar.done)
        if tally.text_bytes == 0:
            raise BadInputError(
                f"{path}: the file is empty (no lines); remove it or fetch it again"
            )
        if tally.bad and labels.rows == 0:
            raise BadInputError(
                f"{path}: every line is malformed ({tally.bad:,} lines); the "
                f"first: {tally.first_bad}"
            )
        shift = _write_dense(raw_dense_path, out_dir / f"{name}_dense.npy", opts)
    finally:
        bar.close()
        stream.close()
        raw.close()
        raw_dense_path.unlink(missing_ok=True)
    seen = labels.rows > 0
    return FileResult(
        name=name,
        input=str(path),
        rows=labels.rows,
        bad_lines=tally.bad,
        text_mb=tally.text_bytes / 1e6,
        seconds=time.perf_counter() - start,
        dense_shift=shift,
        dense_min=tally.low_I.tolist() if seen else [],
        dense_max=tally.high_I.tolist() if seen else [],
        dense_clipped=tally.clipped_I.tolist(),
        unterminated_last_line=tally.unterminated,
    )


def _write_dense(
    raw_path: Path, out_path: Path, opts: ConvertOptions, block_rows: int = 1 << 20
) -> int | None:
    """The dense transform in float32 (module doc); returns the shift the torchrec transform
    used (None for log1p)."""
    raw = np.load(raw_path, mmap_mode="r")
    shift = None
    if opts.dense_transform == DenseTransform.torchrec:
        shift = opts.dense_shift
        if shift is None:  # TorchRec's: the minimum over the whole file
            shift = min(
                (int(raw[i : i + block_rows].min()) for i in range(0, len(raw), block_rows)),
                default=0,
            )
    with NpyAppender(out_path, np.float32, INT_FEATURES) as out:
        for i in range(0, len(raw), block_rows):
            block = raw[i : i + block_rows]
            if shift is None:
                out.append(np.log(np.maximum(block, 0).astype(np.float32) + 1, dtype=np.float32))
            else:
                out.append(np.log((block - (shift - 2)).astype(np.float32), dtype=np.float32))
    return shift


def convert(
    input_path: str | Path, output_dir: str | Path, opts: ConvertOptions
) -> list[FileResult]:
    """Convert one file or a directory of files; returns one result per file."""
    files = input_files(input_path)
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    workers = opts.workers or min(4, os.cpu_count() or 1)
    if workers <= 1:
        return [convert_file(f, out_dir, opts, None, 1) for f in files]
    pool = _start_pool(workers)
    try:
        return [convert_file(f, out_dir, opts, pool, workers) for f in files]
    finally:  # done, an error or an interrupt: queued chunks dropped, running ones end
        pool.shutdown(wait=True, cancel_futures=True)


def _start_pool(workers: int) -> ProcessPoolExecutor:
    """The parse workers, every one started before any work, with Ctrl-C and SIGTERM held
    back meanwhile (a second at most): a signal landing while a worker starts would leave
    it half made, printing a traceback, or the pool unable to stop. Spawned, not forked: a
    fork runs Python's fork hooks in this process, where a signal is lost to an 'Exception
    ignored' traceback."""
    pool = ProcessPoolExecutor(
        max_workers=workers,
        initializer=_worker_start,
        initargs=(os.getpid(),),
        mp_context=multiprocessing.get_context("spawn"),
    )
    try:
        with interrupts.deferred():
            for started in [pool.submit(os.getpid) for _ in range(workers)]:
                started.result()
    except BaseException:  # noqa: B036 - a signal held back above, delivered on leaving it
        pool.shutdown(wait=True)
        raise
    return pool


def _worker_start(parent: int) -> None:
    """A parse worker: Ctrl-C is the parent's to handle (it stops the pool), and the worker
    ends with its parent whatever ended that."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # end quietly, the parent cleans up
    interrupts.unblock()  # started inside interrupts.deferred()
    die_with_parent(parent)
