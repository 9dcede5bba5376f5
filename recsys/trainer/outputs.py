"""What a run leaves: summary.json, train_losses.csv, and where an interrupted run stopped."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from recsys.checkpoint import newest_good_checkpoint, remove_partial
from sharding.errors import UserError


def write_interrupted(
    run_dir: Path, ckpt_root: Path, start: int, steps_done: int, signal_name: str
) -> None:
    """Rank 0, stopped by Ctrl-C or SIGTERM after `steps_done` steps from `start`: a summary
    saying where the run stopped (`_kept`)."""
    summary = {"interrupted": signal_name, "start_step": start, "steps_done": start + steps_done}
    write_summary(run_dir, summary | _kept(run_dir, ckpt_root))


def write_failed(run_dir: Path, ckpt_root: Path, cause: str, run_id: str) -> Path:
    """The parent, after a run failed once its ranks started (a rank died, hung, ran out of
    disk, or the loss diverged): a summary naming the cause (`_kept`)."""
    summary = {"failed": cause, "run_id": run_id}
    return write_summary(run_dir, summary | _kept(run_dir, ckpt_root))


def _kept(run_dir: Path, ckpt_root: Path) -> dict:
    """What a stopped run keeps: half-written checkpoints go; the newest good checkpoint,
    and the last step whose loss was checked (the losses are in train_losses.csv, written
    as they were checked)."""
    remove_partial(ckpt_root)
    last = newest_good_checkpoint(ckpt_root)
    losses = read_losses(run_dir / LOSSES_FILE)
    return {
        "last_good_step": losses[-1][0] if losses else None,
        "last_checkpoint": str(last) if last else None,
        "train_loss": losses[-1][1] if losses else None,
    }


def per_step_stats(stats: dict | None) -> dict | None:
    """A pipeline's counters, with its wait times also as ms per step (all steps)."""
    if not stats:
        return None
    out = dict(stats)
    if stats.get("steps") and "wait_ms" in stats:
        out["wait_ms_per_step"] = {k: v / stats["steps"] for k, v in stats["wait_ms"].items()}
    return out


LOSSES_FILE = "train_losses.csv"


def read_losses(path: Path) -> list[tuple[int, float]]:
    """(step, global mean loss) rows of a train_losses.csv; none if there is no such file."""
    try:
        lines = path.read_text().splitlines()[1:]
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        step, _, loss = line.partition(",")
        if step.strip().isdigit() and loss:
            rows.append((int(step), float(loss)))
    return rows


class LossFile:
    """train_losses.csv, appended to as the losses are checked, so a run that fails keeps
    the losses it had; a resumed run keeps the rows before its first step."""

    def __init__(self, path: Path, start: int) -> None:
        kept = [f"{s},{v:.9g}" for s, v in read_losses(path) if s <= start]
        path.write_text("\n".join(["step,loss", *kept]) + "\n")
        self.path, self.start, self.written = path, start, 0

    def add(self, reduced: list[float]) -> None:
        """The checked losses (`LossWatch.reduced`) not written yet."""
        new = reduced[self.written :]
        if new:
            first = self.start + self.written + 1
            with open(self.path, "a") as f:
                f.writelines(f"{first + i},{v:.9g}\n" for i, v in enumerate(new))
            self.written = len(reduced)


def versions() -> dict:
    import fbgemm_gpu
    import torchrec

    return {
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "unknown"),
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "unknown"),
    }


def _finite(value):
    """`value` with every NaN or infinite float turned into None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class OutputWriteError(UserError, OSError):
    """A run's own output could not be written (a full disk, a read-only directory)."""


def write_summary(run_dir: Path, summary: dict) -> Path:
    """summary.json: everything but the per-step losses (those are in train_losses.csv);
    strict JSON (an undefined figure is null, never NaN), written whole or not at all."""
    path = run_dir / "summary.json"
    kept = _finite({k: v for k, v in summary.items() if k != "step_losses"})
    text = json.dumps(kept, indent=2, allow_nan=False) + "\n"
    tmp = path.with_name(".summary.json.tmp")
    try:
        tmp.write_text(text)
        tmp.rename(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputWriteError(
            f"cannot write '{path}' ({e.strerror}): the run's results are in its log only; "
            f"free space there or name another hydra.run.dir"
        ) from e
    return path


class Scalars:
    """What rank 0 writes as the run goes: the checked losses into train_losses.csv
    (`losses`: a LossFile; None on other ranks) and TensorBoard scalars (`trainer.tensorboard`):
    `train/loss` at every step (the global mean over ranks, as the losses are checked each
    `log_every` steps), `train/samples_per_s` per checked window, and `eval/auc`,
    `eval/logloss`, `eval/ne` at each evaluation; in `<run dir>/tensorboard/`
    (`tensorboard --logdir <run dir>`). Does nothing when off."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        global_batch: int,
        start: int,
        losses: LossFile | None = None,
    ) -> None:
        self.writer, self.loss_file = None, losses
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self.global_batch, self.start, self.written = global_batch, start, 0
        self.last = (start, time.perf_counter())

    def losses(self, reduced: list[float]) -> None:
        """The checked losses not written yet (`LossWatch.reduced`), and the window's rate."""
        if self.loss_file is not None:
            self.loss_file.add(reduced)
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
