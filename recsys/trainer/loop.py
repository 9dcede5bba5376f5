"""The per-rank training job: `run_rank(ctx, run_dir)` runs on every rank (spawned locally,
or under torchrun / Slurm) and returns that rank's results (rank 0's become `summary.json`):
build, resume, the train steps with evaluations and checkpoints between them, the results.
`train_each` runs several configs side by side in one process group (comparisons)."""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pipelines.build import detach_for_eval
from recsys import interrupts, launch
from recsys.checkpoint import load_checkpoint, save_checkpoint
from recsys.collectives import all_reduce_sum
from recsys.config import EvalSplit, Mode, TrainConfigError, tensorboard_installed
from recsys.context import RunContext
from recsys.emulation import quota_periods
from recsys.interrupts import interruptible
from recsys.metrics import evaluate
from recsys.progress import Progress
from sharding.errors import UserError

if TYPE_CHECKING:
    from recsys.config import TrainConfig

from recsys.trainer.build import (
    Training,
    backend_for,
    build_training,
    place_rank,
    rank_device,
    rehearse_node,
)
from recsys.trainer.outputs import (
    LOSSES_FILE,
    LossFile,
    Scalars,
    per_step_stats,
    versions,
    write_interrupted,
)

log = logging.getLogger(__name__)


class LossDivergedError(UserError, FloatingPointError):
    """The train loss became NaN or inf: the learning rates or the data are the user's to fix."""


class LossWatch:
    """Checks recorded losses for NaN/inf in windows (one host sync per window, not per step).
    Each window is averaged over the ranks first (one small all-reduce per window, every
    rank at the same steps): the figure shown is the global mean loss whatever each rank's
    share, and a NaN on any rank stops every rank at once."""

    def __init__(self, start_step: int, world: int = 1) -> None:
        self.losses: list[torch.Tensor] = []
        self.reduced: list[float] = []  # the global mean of every checked step, in order
        self._start, self._world, self._checked = start_step, world, 0

    def check(self) -> float | None:
        """Raise naming the first bad step; return the global mean loss of the new window."""
        window = self.losses[self._checked :]
        if not window:
            return None
        values = torch.stack(window).double()
        if self._world > 1:  # each rank's loss is its share of the global mean
            values = all_reduce_sum(values, values.device) / self._world
        self.reduced += values.tolist()
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise LossDivergedError(
                f"train loss is {float(values[i])} at step "
                f"{self._start + self._checked + i + 1}; stopping. Lower trainer.lr / "
                f"trainer.embedding_lr or check the data."
            )
        self._checked = len(self.losses)
        return float(values.mean())


def _is_comm_failure(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, dist.DistBackendError) or any(
        s in text
        for s in (
            "gloo",
            "Connection closed",
            "Connection reset",
            "Timed out",
            "NCCL",
            "timeout caused pair closure",
        )
    )


def train_each(runs: list[tuple], steps: int, run_dir: str):
    """Side-by-side runs in this rank, one process group for all: for each `(RunContext,
    batch transform or None)`, build the training from the same seed, run `steps` train
    steps, and yield `(Training, per-step losses)` (comparisons, controls)."""
    first = runs[0][0]
    tcfg = first.cfg.trainer
    rehearse = tcfg.rehearse_on_cpu
    rank, _ = launch.init_distributed(tcfg.dist_timeout_s, backend_for(first.ranks, rehearse))
    place_rank(tcfg, first.ranks[rank])
    if rehearse:
        rehearse_node(first.ranks, rank)
    device = rank_device(first.ranks[rank], rehearse)
    for ctx, transform in runs:
        job = build_training(ctx, run_dir, rank, device)
        batches = job.batches("train", 0, steps)
        if transform is not None:
            batches = map(transform, batches)
        yield job, [float(job.pipeline.progress(batches)[0]) for _ in range(steps)]


def run_rank(ctx: RunContext, run_dir: str) -> dict:
    """Train on this rank; every rank returns its results, rank 0 also writes them.

    `ctx.plan`: a plan of ours (planner hybrid, greedy_size, round_robin) to run instead of
    TorchRec's planner; tables with replicated hot rows are split (recsys.models.split)."""
    cfg, tcfg, ranks = ctx.cfg, ctx.cfg.trainer, ctx.ranks
    rank, world = launch.init_distributed(
        tcfg.dist_timeout_s, backend_for(ranks, tcfg.rehearse_on_cpu)
    )
    if len(ranks) != world:
        raise TrainConfigError(
            f"cluster '{cfg.cluster.name}' has {len(ranks)} ranks but the job has {world}; launch "
            f"as many processes as the cluster config has devices"
        )
    place_rank(tcfg, ranks[rank])
    if tcfg.rehearse_on_cpu:
        rehearse_node(ranks, rank)
    device = rank_device(ranks[rank], tcfg.rehearse_on_cpu)
    job = build_training(ctx, run_dir, rank, device)
    start = 0
    if tcfg.resume_from:
        start = load_checkpoint(
            tcfg.resume_from, job.model, job.optimizer, job.dense_opt, job.layout
        )
        if Mode(tcfg.mode) == Mode.evaluate:
            return _evaluate_checkpoint(cfg, job, start, device)
        if start >= tcfg.max_steps:
            raise TrainConfigError(
                f"the checkpoint {tcfg.resume_from} is at step {start}, at or past "
                f"trainer.max_steps={tcfg.max_steps}: nothing to train. Raise trainer.max_steps"
            )
        if rank == 0:
            log.info("resumed from %s at step %d", tcfg.resume_from, start)
    ckpt_root = Path(tcfg.checkpoint_dir or Path(run_dir) / "checkpoints")
    watch = LossWatch(start, world)
    try:
        with interruptible():  # Ctrl-C or SIGTERM: rank 0 writes what the run has so far
            return _train_loop(cfg, run_dir, job, start, watch, ckpt_root, device, ctx.run_id)
    except BaseException:  # noqa: B036 - only to record a stop; re-raised
        if interrupts.received():  # a second stop signal (Ctrl-C reaches a rank from the
            interrupts.ignore_further()  # terminal and from its launcher) must not cut in
        if rank == 0 and interrupts.received():
            write_interrupted(
                Path(run_dir), ckpt_root, start, len(watch.losses), interrupts.received()
            )
        raise


class StepTrace:
    """`trainer.profile_steps=[first, last]`: those steps (1-based, inclusive) traced by
    torch.profiler into `path`, a Chrome trace (Perfetto, chrome://tracing, TensorBoard),
    one per rank: every op of the steps, the exchanges' waits among them."""

    def __init__(self, steps: list[int] | None, path: Path, device: torch.device) -> None:
        self.steps, self.path, self.device, self.profiler = steps, path, device, None
        self.written: str | None = None  # the trace file, once written

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":  # the rank's device, not whether CUDA exists
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()

    def after(self, step: int) -> None:
        if self.profiler is not None and step == self.steps[1]:
            self.profiler.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.path))
            self.profiler, self.written = None, str(self.path)


def held_out_metrics(cfg: TrainConfig, job: Training, device: torch.device) -> dict:
    """AUC, log loss and NE of the model now on `dataset.eval_split`: `dataset.eval_batches`
    of it per rank, or the whole split (null)."""
    split = EvalSplit(cfg.dataset.eval_split).value
    if cfg.dataset.eval_batches == 0:  # no evaluation asked for: undefined, not a crash
        return {
            "eval_auc": None,
            "eval_logloss": None,
            "eval_ne": None,
            "eval_samples": 0,
            "eval_split": split,
        }
    n = cfg.dataset.eval_batches
    if n is None:
        n = job.source.num_batches(split)
    eval_model = detach_for_eval(job.pipeline, job.model)
    return {**evaluate(eval_model, job.batches(split, 0, n), device), "eval_split": split}


def _evaluate_checkpoint(cfg: TrainConfig, job: Training, step: int, device) -> dict:
    """`trainer.mode=evaluate`: the checkpoint just loaded (at `step`), evaluated."""
    if job.rank == 0:
        log.info(
            "evaluating %s (step %d) on the %s split",
            cfg.trainer.resume_from,
            step,
            EvalSplit(cfg.dataset.eval_split).value,
        )
    return {
        "rank": job.rank,
        "mode": Mode.evaluate.value,
        "world_size": len(job.shares),
        "checkpoint": str(cfg.trainer.resume_from),
        "checkpoint_step": step,
        **held_out_metrics(cfg, job, device),
        "planner": cfg.planner.name.value,
        "model": cfg.model.name,
        "cluster": cfg.cluster.name,
        "versions": versions(),
    }


def _train_loop(
    cfg: TrainConfig,
    run_dir: str,
    job: Training,
    start: int,
    watch: LossWatch,
    ckpt_root: Path,
    device: torch.device,
    run_id: str,
) -> dict:
    """`run_rank`'s steps, evaluations, checkpoints and results."""
    tcfg, pipeline, model = cfg.trainer, job.pipeline, job.model
    # beside each checkpoint: what it is (recsys.export reads it) and how its tables split
    saved_run = {
        "model": asdict(cfg.model),
        "dataset": asdict(cfg.dataset),
        "plan_layout": job.layout,
    }
    split = (job.remap.hot_ids, job.remap.cold_parts) if job.remap is not None else None

    tensorboard = tensorboard_installed() if tcfg.tensorboard is None else tcfg.tensorboard
    loss_file = LossFile(Path(run_dir) / LOSSES_FILE, start) if job.rank == 0 else None
    scalars = Scalars(
        Path(run_dir), job.rank == 0 and tensorboard, sum(job.shares), start, loss_file
    )

    def between_steps(done: int) -> None:  # evaluations and checkpoints inside the run
        if tcfg.eval_every and done % tcfg.eval_every == 0 and done != tcfg.max_steps:
            evals.append({"step": done, **held_out_metrics(cfg, job, device)})
            scalars.evaluation(evals[-1], done)
        if tcfg.checkpoint_every and done % tcfg.checkpoint_every == 0 and done != tcfg.max_steps:
            watch.check()  # never checkpoint a diverged model
            save_checkpoint(ckpt_root, model, job.optimizer, done, saved_run, split, run_id)

    evals: list[dict] = []
    trace = StepTrace(tcfg.profile_steps, Path(run_dir) / "traces" / f"rank{job.rank}.json", device)
    samples_per_s, faults_per_step, cpu_s, quota = _steps(
        cfg, job, start, watch, between_steps, trace, scalars
    )
    saved = None
    if tcfg.save_checkpoint or tcfg.checkpoint_every:
        saved = str(
            save_checkpoint(
                ckpt_root, model, job.optimizer, tcfg.max_steps, saved_run, split, run_id
            )
        )
    final = held_out_metrics(cfg, job, device)
    scalars.evaluation(final, tcfg.max_steps)
    scalars.close()
    world = len(job.shares)
    losses = watch.losses
    step_losses = torch.stack(losses).double() if losses else torch.zeros(0, dtype=torch.float64)
    # one collective for the whole run: the global mean per step
    step_losses = all_reduce_sum(step_losses, device) / world
    window = step_losses[-tcfg.log_every :]
    cpu_by_rank = quota_by_rank = None  # every rank's, so a slow rank's own can be read off
    if cpu_s is not None:  # every rank timed the same steps (or none)
        mine = torch.zeros(2, world, dtype=torch.float64)
        mine[:, job.rank] = torch.tensor([cpu_s, math.nan if quota is None else quota])
        cpu, throttled = all_reduce_sum(mine, device).tolist()
        cpu_by_rank = [1000 * x for x in cpu]
        if not all(math.isnan(x) for x in throttled):
            quota_by_rank = [None if math.isnan(x) else x for x in throttled]
    result = {
        "rank": job.rank,
        "world_size": world,
        "steps": tcfg.max_steps,
        "start_step": start,
        # one figure only where every rank has it; else each rank's in batch_per_rank
        "batch_size_per_rank": job.shares[0] if len(set(job.shares)) == 1 else None,
        "global_batch_size": sum(job.shares),
        # training only: evaluations and checkpoints between timed steps are left out
        "samples_per_s": samples_per_s,
        # this rank's process, per timed step: pages the kernel mapped in on first touch
        # (`trainer.retain_host_memory` keeps them few; recsys/host_memory.py)
        "host_page_faults_per_step": faults_per_step,
        # each rank's process CPU time per timed step, every thread (gloo's too): against
        # the step, how much of it the rank computed or moved bytes; ms
        "cpu_ms_per_step_by_rank": cpu_by_rank,
        # ranks under a CFS quota (emulated): the share of the timed steps' CFS periods in
        # which the rank ran out of its quota (None for a rank without one)
        "quota_throttled_share_by_rank": quota_by_rank,
        "batch_per_rank": job.shares,
        "train_loss": float(window.mean()) if len(window) else None,
        **final,
        "evals": evals,
        "pipeline": cfg.pipeline.name.value,
        # 2D groups: the tables sharded within each group of this many ranks (0: none)
        "sharding_group_size": tcfg.sharding_group_size if tcfg.sharding_group_size < world else 0,
        "pipeline_stats": per_step_stats(getattr(pipeline, "stats", None)),
        "input": job.input_summary(),  # this rank's: building and waiting for batches
        "planner": cfg.planner.name.value,
        "model": cfg.model.name,
        "cluster": cfg.cluster.name,
        "rehearsed_on_cpu": tcfg.rehearse_on_cpu,
        "checkpoint": saved,
        "trace": trace.written,  # this rank's torch.profiler trace (trainer.profile_steps)
        "step_losses": step_losses.tolist(),
        "run_id": run_id,
        "versions": versions(),
    }
    return result


def _steps(
    cfg: TrainConfig,
    job: Training,
    start: int,
    watch: LossWatch,
    between_steps: Callable[[int], None],
    trace: StepTrace,
    scalars: Scalars,
) -> tuple[float | None, float | None, float | None, float | None]:
    """The train steps from `start`, each loss recorded in `watch` (and, checked, in
    `scalars`); `between_steps(done)` after each; `trainer.profile_steps` traced. Returns
    the samples per second after the warm-up, this process's minor page faults per such
    step and its CPU seconds per such step (every thread), `between_steps` left out of all
    three, and the share of those steps' CFS periods its cgroup ran out of its quota in
    (`quota_periods`, read at the two ends only; None without a quota). None: no timed
    steps."""
    tcfg, world = cfg.trainer, len(job.shares)
    train_iter = job.batches("train", start, tcfg.max_steps)
    bar = Progress(
        tcfg.max_steps,
        start,
        f"train {cfg.pipeline.name.value} x{world}",
        enabled=job.rank == 0 and tcfg.progress_bar,
        loss=True,
    )
    timed_from, begun, paused = start, _counters(), (0.0,) * 3
    quota_from = quota_periods()  # read at the timed steps' ends only: off the step's path
    for step in range(start, tcfg.max_steps):
        trace.before(step + 1)
        try:
            loss, _, _ = job.pipeline.progress(train_iter)
        except RuntimeError as e:
            if not _is_comm_failure(e):
                raise
            raise RuntimeError(
                f"rank {job.rank}: step {step + 1} failed in a collective ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). Another rank probably died or "
                f"hung; its own error is reported too. Collectives time out after "
                f"trainer.dist_timeout_s={tcfg.dist_timeout_s:g} s."
            ) from e
        watch.losses.append(loss.detach())
        done = step + 1
        trace.after(done)
        if done == start + tcfg.warmup_steps:
            timed_from, begun, paused = done, _counters(), (0.0,) * 3
            quota_from = quota_periods()
        if done % tcfg.log_every == 0 or done == tcfg.max_steps:
            bar.set_postfix(loss=f"{watch.check():.4f}")
            scalars.losses(watch.reduced)
        bar.update(1)
        pause = _counters()
        between_steps(done)
        paused = tuple(p + b - a for p, a, b in zip(paused, pause, _counters(), strict=True))
    bar.close()
    timed_steps = tcfg.max_steps - timed_from
    if not timed_steps:
        return None, None, None, None
    elapsed, faulted, used = (b - a - p for a, b, p in zip(begun, _counters(), paused, strict=True))
    periods, throttled = (b - a for a, b in zip(quota_from, quota_periods(), strict=True))
    quota = throttled / periods if periods > 0 else None  # evaluations between steps included
    return sum(job.shares) * timed_steps / elapsed, faulted / timed_steps, used / timed_steps, quota


def _counters() -> tuple[float, float, float]:
    """Wall seconds, this process's minor page faults and its CPU seconds (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), float(r.ru_minflt), r.ru_utime + r.ru_stime
