"""`python -m benchmarks.tbe_cpu`: FBGEMM's CPU table-batched embedding (the kernel TorchRec
trains CPU ranks with), forward and forward + backward with the fused row-wise Adagrad update,
on one thread, for the installed torch and fbgemm-gpu-cpu.

Each run adds its stack's rows to `benchmarks/results/tbe_cpu/` (`tbe_cpu.json`, every run
with its versions and date; `tbe_cpu.md`, one row per stack and shape), so two stacks are
compared by running it in each environment, one after the other on a quiet machine:

    .venv/bin/python -m benchmarks.tbe_cpu
    /path/to/other/venv/bin/python -m benchmarks.tbe_cpu

Imports torch, numpy and fbgemm_gpu only (an environment with another stack needs nothing of
this project installed); plain argparse.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "tbe_cpu"
# (tables, rows, dim, batch): the calibration's smallest and largest embedding cases
SHAPES = ((8, 20_000, 16, 4096), (26, 20_000, 64, 4096))


def tbe_steps(tables: int, rows: int, dim: int, ids: torch.Tensor) -> tuple[Callable, Callable]:
    """FBGEMM's CPU TBE over `tables` tables of `rows` x `dim` with the row-wise Adagrad
    update fused in, `ids` one bag each: its forward, and its forward + backward (the
    update). What this benchmark and the calibration (`benchmarks.calibrate`) time."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
    )
    offsets = torch.arange(len(ids) + 1)

    def forward() -> None:
        with torch.no_grad():
            tbe(ids, offsets)

    def forward_backward() -> None:
        out = tbe(ids, offsets)
        out.backward(torch.ones_like(out))

    return forward, forward_backward


def measure(shapes=SHAPES, repeats: int = 15) -> list[dict]:
    """Median ms of the forward and of forward + backward (the update fused in), uniform
    ids, one bag per sample and table."""
    rows_out = []
    for tables, rows, dim, batch in shapes:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, rows, (tables * batch,), generator=gen)
        forward, forward_backward = tbe_steps(tables, rows, dim, ids)
        fwd, both = _median_ms(forward, repeats), _median_ms(forward_backward, repeats)
        rows_out.append(
            {
                "tables": tables,
                "rows": rows,
                "dim": dim,
                "batch": batch,
                "forward_ms": fwd,
                "forward_backward_ms": both,
                "backward_over_forward": (both - fwd) / fwd,
            }
        )
    return rows_out


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def stack() -> dict[str, str]:
    import fbgemm_gpu

    return {
        "torch": torch.__version__,
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def table(runs: list[dict]) -> str:
    lines = [
        "# FBGEMM CPU TBE, one thread: forward and forward + backward with the fused row-wise "
        "Adagrad update (median ms)",
        "",
        "| torch | fbgemm_gpu | date | tables x rows x dim, batch | forward ms | "
        "forward + backward ms | backward / forward |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        s = run["stack"]
        for r in run["rows"]:
            shape = f"{r['tables']} x {r['rows']:,} x {r['dim']}, {r['batch']}"
            times = f"{r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f}"
            lines.append(
                f"| {s['torch']} | {s['fbgemm_gpu']} | {s['date'][:16]} | {shape} | "
                f"{times} | {r['backward_over_forward']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tbe_cpu", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="where to add the rows")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    run = {"stack": stack(), "rows": measure(repeats=args.repeats)}
    args.results.mkdir(parents=True, exist_ok=True)
    saved = args.results / "tbe_cpu.json"
    runs = json.loads(saved.read_text()) if saved.exists() else []
    runs.append(run)
    saved.write_text(json.dumps(runs, indent=1) + "\n")
    (args.results / "tbe_cpu.md").write_text(table(runs))
    print(table([run]), end="")
    print(f"added to {saved} and {args.results / 'tbe_cpu.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
