"""Helpers the test modules share (fixtures are in conftest.py): Criteo text rows, a
child process that sees Ctrl-C, the machine's ceiling for chunked sends, an input file."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.optim.keyed import KeyedOptimizerWrapper

from benchmarks import netns
from recsys.checkpoint import save_checkpoint
from recsys.data.criteo_tsv import LineRules, parse_lines


def row(label="1", ints=None, cats=None) -> list[str]:
    ints = ints if ints is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{0x10 + c:08x}" for c in range(26)]
    return ([label] if label is not None else []) + ints + cats


def tsv(*rows: list[str], final_newline: bool = True) -> bytes:
    text = "\n".join("\t".join(r) for r in rows)
    return (text + ("\n" if final_newline else "")).encode()


def parse(data: bytes, has_label: bool = True, skip: bool = False, **rules):
    return parse_lines(data, has_label, "f.txt", 1, LineRules(skip_bad_lines=skip, **rules))


def random_rows(n: int, seed: int = 0) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    return [
        row(
            str(int(rng.integers(0, 2))),
            [str(int(v)) for v in rng.integers(-2, 1000, 13)],
            [f"{int(v):08x}" for v in rng.integers(0, 2**32, 26)],
        )
        for _ in range(n)
    ]


def input_file(tmp: Path, name: str, data: bytes) -> Path:
    """`data` as the file `name` in `tmp`/in."""
    path = tmp / "in" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def sigint_default() -> None:
    """Undo an inherited SIG_IGN (a shell starts background jobs with SIGINT ignored, and
    Python then installs no KeyboardInterrupt handler): the child must see Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sendable(chunk_bytes: int, chunks: int = 16) -> float:
    """Bits/s this machine's sender reaches now for such chunks, on a link shaped far above
    any rate tested: the ceiling of what a shaped link can show under the current load."""
    with netns.veth_link("40gbit", tag="cap", burst="4mb") as link:
        return netns.chunked_rate(link, chunk_bytes, 0.005, chunks)


@contextlib.contextmanager
def small_disk(where: Path, size: str = "256k") -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where` (root only; the test skips elsewhere, saying
    why): a disk that fills up. Unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("a disk-full test mounts a small tmpfs: needs root")
    where.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, KeyedOptimizerWrapper]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 8)
    params = dict(model.named_parameters())
    return model, KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.1))


def save_small_checkpoint(
    root: Path,
    step: int,
    seed: int = 0,
    run_id: str = "run-a",
    model_config: dict | None = None,
    run_file: bool = True,
) -> Path:
    """A checkpoint of a small linear model, as the trainer writes one (no process group);
    its run.json names `model_config` (none without `run_file`)."""
    model, opt = _model_and_optimizer(seed)
    run = {"model": model_config or {"name": "tiny"}, "dataset": {}, "plan_layout": []}
    with warnings.catch_warnings():  # DCP's "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        return save_checkpoint(root, model, opt, step, run=run if run_file else None, run_id=run_id)


def flip_bytes(path: Path, at: int = 100, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + n] = bytes(b ^ 0xFF for b in data[at : at + n])
    path.write_bytes(bytes(data))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (a command's ranks are its fork server's children)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out + [d for c in out for d in descendants(c)]
