"""What a run leaves: summary.json, train_losses.csv, and where an interrupted run stopped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from recsys.checkpoint import STEP_PREFIX, latest_checkpoint


def write_interrupted(run_dir: Path, ckpt_root: Path, start: int, steps_done: int,
                      checked: list[float], signal_name: str) -> None:  # fmt: skip
    """Rank 0, stopped by Ctrl-C or SIGTERM after `steps_done` steps from `start`: the
    losses checked so far (`checked`: global means) and a summary saying where the run
    stopped; half-written checkpoints (no .metadata) go."""
    for partial in ckpt_root.glob(f"{STEP_PREFIX}*") if ckpt_root.is_dir() else ():
        if not (partial / ".metadata").exists():
            shutil.rmtree(partial, ignore_errors=True)
    try:
        last = str(latest_checkpoint(ckpt_root))
    except FileNotFoundError:
        last = None
    write_losses(run_dir / "train_losses.csv", start, checked)
    summary = {"interrupted": signal_name, "start_step": start,
               "steps_done": start + steps_done, "last_checkpoint": last,
               "train_loss": checked[-1] if checked else None}  # fmt: skip
    write_summary(run_dir, summary)


def per_step_stats(stats: dict | None) -> dict | None:
    """A pipeline's counters, with its wait times also as ms per step (all steps)."""
    if not stats:
        return None
    out = dict(stats)
    if stats.get("steps") and "wait_ms" in stats:
        out["wait_ms_per_step"] = {k: v / stats["steps"] for k, v in stats["wait_ms"].items()}
    return out


def write_losses(path: Path, start: int, losses: list[float]) -> None:
    lines = ["step,loss"] + [f"{start + i + 1},{v:.9g}" for i, v in enumerate(losses)]
    path.write_text("\n".join(lines) + "\n")


def versions() -> dict:
    import fbgemm_gpu
    import torchrec

    return {
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "unknown"),
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "unknown"),
    }


def write_summary(run_dir: Path, summary: dict) -> Path:
    """summary.json: everything but the per-step losses (those are in train_losses.csv)."""
    path = run_dir / "summary.json"
    kept = {k: v for k, v in summary.items() if k != "step_losses"}
    path.write_text(json.dumps(kept, indent=2) + "\n")
    return path
