"""What a run leaves: summary.json, train_losses.csv, and where an interrupted run stopped."""

from __future__ import annotations

import json
import shutil
import time
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


class Scalars:
    """TensorBoard scalars of a run, written by rank 0 as it goes (`trainer.tensorboard`):
    `train/loss` at every step (the global mean over ranks, as the losses are checked each
    `log_every` steps), `train/samples_per_s` per checked window, and `eval/auc`,
    `eval/logloss`, `eval/ne` at each evaluation; in `<run dir>/tensorboard/`
    (`tensorboard --logdir <run dir>`). Does nothing when off."""

    def __init__(self, run_dir: Path, enabled: bool, global_batch: int, start: int) -> None:
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self.global_batch, self.start, self.written = global_batch, start, 0
        self.last = (start, time.perf_counter())

    def losses(self, reduced: list[float]) -> None:
        """The checked losses not written yet (`LossWatch.reduced`), and the window's rate."""
        if self.writer is None:
            return
        for i in range(self.written, len(reduced)):
            self.writer.add_scalar("train/loss", reduced[i], self.start + i + 1)
        step, now = self.start + len(reduced), time.perf_counter()
        if step > self.last[0]:
            rate = (step - self.last[0]) * self.global_batch / max(now - self.last[1], 1e-9)
            self.writer.add_scalar("train/samples_per_s", rate, step)
        self.written, self.last = len(reduced), (step, now)

    def evaluation(self, metrics: dict, step: int) -> None:
        if self.writer is None or metrics.get("eval_auc") is None:
            return
        for key in ("auc", "logloss", "ne"):
            self.writer.add_scalar(f"eval/{key}", metrics[f"eval_{key}"], step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
