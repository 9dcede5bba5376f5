"""The per-rank training job: plan, shard with DMP, train through a pipeline, evaluate.

`run_rank(ctx, run_dir)` runs on every rank (spawned locally, or under torchrun / Slurm)
and returns that rank's results; rank 0's become `summary.json`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from pipelines.build import build_pipeline, detach_for_eval
from pipelines.dense_step import per_tensor_comm_hook
from recsys import interrupts, launch
from recsys.checkpoint import STEP_PREFIX, latest_checkpoint, load_checkpoint, save_checkpoint
from recsys.config import (
    DenseAllreduce,
    DenseOptimizer,
    SparseOptimizer,
    TrainConfigError,
    TrainerConfig,
)
from recsys.context import RunContext
from recsys.data.source import build_source
from recsys.interrupts import interruptible
from recsys.metrics import evaluate
from recsys.models.dlrm import build_model, feature_names
from recsys.models.shares import SharedBatchDLRMTrain
from recsys.models.split import SplitRemap
from recsys.progress import Progress
from sharding.cluster import ClusterConfigError
from sharding.emit import to_torchrec_plan
from sharding.errors import UserError
from sharding.plan_shards import plan_layout
from sharding.torchrec_planner import plan_with_torchrec
from sharding.types import RankDevice

if TYPE_CHECKING:
    from recsys.config import TrainConfig

log = logging.getLogger(__name__)


def _dense_optimizer(cfg: TrainerConfig, params: dict[str, torch.nn.Parameter]) -> Any:
    kind = DenseOptimizer(cfg.dense_optimizer)
    if kind == DenseOptimizer.adagrad:
        make = lambda ps: torch.optim.Adagrad(ps, lr=cfg.lr, eps=cfg.eps)  # noqa: E731
    elif kind == DenseOptimizer.adam:
        make = lambda ps: torch.optim.Adam(ps, lr=cfg.lr, eps=cfg.eps)  # noqa: E731
    else:
        make = lambda ps: torch.optim.SGD(ps, lr=cfg.lr)  # noqa: E731
    return KeyedOptimizerWrapper(params, make)


def _replicated_embedding_optimizer(
    cfg: TrainerConfig, params: dict[str, torch.nn.Parameter]
) -> KeyedOptimizerWrapper:
    """Data-parallel (replicated) tables get no fused kernel; they get the same update rule
    as the fused ones, row-wise Adagrad or SGD at `embedding_lr`, as a torch optimizer."""
    if SparseOptimizer(cfg.sparse_optimizer) == SparseOptimizer.rowwise_adagrad:
        return KeyedOptimizerWrapper(
            params, lambda ps: RowWiseAdagrad(ps, lr=cfg.embedding_lr, eps=cfg.eps)
        )
    return KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=cfg.embedding_lr))


def _fuse_embedding_optimizer(cfg: TrainerConfig, model: torch.nn.Module) -> None:
    """FBGEMM applies this optimizer inside the embedding backward (no dense grads)."""
    if SparseOptimizer(cfg.sparse_optimizer) == SparseOptimizer.rowwise_adagrad:
        opt_cls, kwargs = RowWiseAdagrad, {"lr": cfg.embedding_lr, "eps": cfg.eps}
    else:
        opt_cls, kwargs = torch.optim.SGD, {"lr": cfg.embedding_lr}
    apply_optimizer_in_backward(opt_cls, model.model.sparse_arch.parameters(), kwargs)


def _device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank())
        return torch.device("cuda", launch.local_rank())
    return torch.device("cpu")


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
        if self._world > 1:
            dist.all_reduce(values)  # each rank's loss is its share of the global mean
            values /= self._world
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
        )  # fmt: skip
    )


def _place_rank(cfg: TrainerConfig, device: RankDevice) -> None:
    """Pin the rank to its cores (cluster config) and size its intra-op thread pool."""
    if device.cores is not None:
        available = os.sched_getaffinity(0)
        if not set(device.cores) <= available:
            raise ClusterConfigError(
                f"rank {device.rank} is pinned to cores {list(device.cores)} but this machine "
                f"offers {sorted(available)}; fix cluster.nodes[..].devices[..].cores"
            )
        os.sched_setaffinity(0, device.cores)
        threads = cfg.threads_per_rank or len(device.cores)
    elif device.share is not None:  # an emulated rank: a fraction of one core
        threads = cfg.threads_per_rank or 1
    else:
        threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // launch.local_world_size())
    torch.set_num_threads(threads)


def _hot_ids(
    source, hot_rows: dict[str, int], rows: dict[str, int], batches: int, rank: int
) -> dict[str, torch.Tensor]:
    """Per split table (keyed by its feature), its `h` most frequent ids in the first
    `batches` training batches of every rank (counts summed over ranks; ties: lower id)."""
    features = {t[len("t_") :]: t for t in hot_rows}  # t_cat_3 serves cat_3
    counts = {f: torch.zeros(rows[t], dtype=torch.float64) for f, t in features.items()}
    for index in range(batches):
        kjt = source.batch("train", index, rank).sparse_features
        for f, c in counts.items():
            c += torch.bincount(kjt[f].values(), minlength=len(c)).double()
    out = {}
    for f, c in counts.items():
        dist.all_reduce(c)
        order = np.lexsort((np.arange(len(c)), -c.numpy()))  # by count, then by id
        out[f] = torch.from_numpy(np.sort(order[: hot_rows[features[f]]]))
    return out


def _model_and_plan(ctx: RunContext, source, rank: int, device):
    """The train module (with its fused embedding optimizer), its TorchRec plan, the
    sharders, and the id remap its batches need (None unless tables are split)."""
    cfg, our_plan = ctx.cfg, ctx.plan
    sharders: list = [EmbeddingBagCollectionSharder()]
    if our_plan is None:
        model = build_model(cfg.model, dense_device=device)
        _fuse_embedding_optimizer(cfg.trainer, model)
        plan = plan_with_torchrec(model, ctx.inputs, cfg.planner, sharders, dist.group.WORLD)
        return model, plan.plan, sharders, None
    hot_rows = {t.name: t.replicated_rows for t in our_plan.tables
                if 0 < t.replicated_rows < t.rows}  # fmt: skip
    # row parts: of a split table's cold part, or of a table too large for one device
    cold_parts = {
        t.name: t.cold_parts
        for t in our_plan.tables
        if t.name in hot_rows or (t.replicated_rows == 0 and t.cold_parts > 1)
    }
    remap = None
    if cold_parts:
        rows = {t.name: t.rows for t in our_plan.tables}
        hot_ids = _hot_ids(source, hot_rows, rows, cfg.planner.hot_id_batches, rank)
        hot_ids |= {t[len("t_") :]: torch.zeros(0, dtype=torch.int64)
                    for t in cold_parts if t not in hot_rows}  # fmt: skip
        remap = SplitRemap(hot_ids, {t[len("t_") :]: k for t, k in cold_parts.items()})
    sequence_cold = cfg.planner.cold_only_exchange and bool(hot_rows)
    model = build_model(cfg.model, device, hot_rows=hot_rows, sequence_cold=sequence_cold,
                        cold_parts=cold_parts)  # fmt: skip
    shares = our_plan.batch_per_rank
    if len(set(shares)) > 1:  # a speed-aware split: each rank its own batch size
        model = SharedBatchDLRMTrain(model.model, len(shares), sum(shares))
    _fuse_embedding_optimizer(cfg.trainer, model)
    feature_of = {f"t_{f}": f for f in feature_names(cfg.model)}
    plan = to_torchrec_plan(our_plan, feature_of, device.type, sequence_cold)
    if sequence_cold:
        sharders.append(EmbeddingCollectionSharder())
    return model, plan, sharders, remap


@dataclass
class Training:
    """Everything one rank trains with, built from the config (see `build_training`)."""

    model: DistributedModelParallel
    optimizer: CombinedOptimizer
    dense_opt: KeyedOptimizerWrapper
    pipeline: Any
    source: Any
    remap: SplitRemap | None
    shares: list[int]  # batch size per rank
    rank: int
    layout: list[dict]  # the plan (sharding.plan_shards.plan_layout rows)

    def batches(self, split: str, first: int, stop: int):
        for b in self.source.batches(split, first, stop, self.rank):
            if self.remap is not None:  # ids of split tables into their hot and cold parts
                b.sparse_features = self.remap(b.sparse_features)
            yield b


def build_training(ctx: RunContext, run_dir: str, rank: int, device) -> Training:
    """Data source, model sharded under DMP, optimizers and pipeline, from the same seed
    on every call (the process group must be up)."""
    cfg, our_plan = ctx.cfg, ctx.plan
    tcfg = cfg.trainer
    world = len(ctx.ranks)
    torch.manual_seed(tcfg.seed)  # same dense init on every rank; shards seeded the same way
    shares = our_plan.batch_per_rank if our_plan is not None else [tcfg.batch_size] * world
    source = build_source(cfg.dataset, cfg.model, shares[rank], world, batch_per_rank=shares)
    model, plan, sharders, remap = _model_and_plan(ctx, source, rank, device)
    layout = plan_layout(plan)
    if rank == 0:
        (Path(run_dir) / "plan.txt").write_text(str(plan))
        (Path(run_dir) / "plan_layout.json").write_text(json.dumps(layout, indent=1))
    model = DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders)
    per_tensor = DenseAllreduce(tcfg.dense_allreduce) == DenseAllreduce.per_tensor
    if per_tensor and isinstance(model._dmp_wrapped_module, DistributedDataParallel):
        model._dmp_wrapped_module.register_comm_hook(None, per_tensor_comm_hook)
    not_fused = dict(in_backward_optimizer_filter(model.named_parameters()))
    replicated = {n: p for n, p in not_fused.items() if ".embedding_bags." in n}
    dense_opt = _dense_optimizer(tcfg, {n: p for n, p in not_fused.items() if n not in replicated})
    optimizers = [model.fused_optimizer, dense_opt]
    if replicated:  # data-parallel tables: DDP reduces their grads, same rule as fused ones
        optimizers.append(_replicated_embedding_optimizer(tcfg, replicated))
    optimizer = CombinedOptimizer(optimizers)
    pipeline = build_pipeline(cfg.pipeline, model, optimizer, device, per_tensor)
    return Training(model, optimizer, dense_opt, pipeline, source, remap, shares, rank, layout)


def train_each(runs: list[tuple], steps: int, run_dir: str):
    """Side-by-side runs in this rank, one process group for all: for each `(RunContext,
    batch transform or None)`, build the training from the same seed, run `steps` train
    steps, and yield `(Training, per-step losses)` (comparisons, controls)."""
    first = runs[0][0]
    rank, _ = launch.init_distributed(first.cfg.trainer.dist_timeout_s)
    _place_rank(first.cfg.trainer, first.ranks[rank])
    device = _device()
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
    rank, world = launch.init_distributed(tcfg.dist_timeout_s)
    if len(ranks) != world:
        raise TrainConfigError(
            f"cluster '{cfg.cluster.name}' has {len(ranks)} ranks but the job has {world}; launch "
            f"as many processes as the cluster config has devices"
        )
    _place_rank(tcfg, ranks[rank])
    device = _device()
    job = build_training(ctx, run_dir, rank, device)
    start = 0
    if tcfg.resume_from:
        start = load_checkpoint(tcfg.resume_from, job.model, job.optimizer, job.dense_opt,
                                job.layout)  # fmt: skip
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
            return _train_loop(cfg, run_dir, job, start, watch, ckpt_root, device)
    except BaseException:  # noqa: B036 - only to record a stop; re-raised
        if rank == 0 and interrupts.received():
            interrupts.ignore_further()
            write_interrupted(Path(run_dir), ckpt_root, start, watch, interrupts.received())
        raise


def _train_loop(cfg: TrainConfig, run_dir: str, job: Training, start: int, watch: LossWatch,
                ckpt_root: Path, device: torch.device) -> dict:  # fmt: skip
    """`run_rank`'s steps, evaluations, checkpoints and results."""
    tcfg, pipeline, model = cfg.trainer, job.pipeline, job.model
    saved_run = {"model": asdict(cfg.model), "plan_layout": job.layout}  # beside each checkpoint

    def run_eval() -> dict:
        if cfg.dataset.eval_batches == 0:  # no evaluation asked for: undefined, not a crash
            return {"eval_auc": None, "eval_logloss": None, "eval_samples": 0}
        eval_model = detach_for_eval(pipeline, model)
        return evaluate(eval_model, job.batches("eval", 0, cfg.dataset.eval_batches), device)

    def between_steps(done: int) -> None:  # evaluations and checkpoints inside the run
        if tcfg.eval_every and done % tcfg.eval_every == 0 and done != tcfg.max_steps:
            evals.append({"step": done, **run_eval()})
        if tcfg.checkpoint_every and done % tcfg.checkpoint_every == 0 and done != tcfg.max_steps:
            watch.check()  # never checkpoint a diverged model
            save_checkpoint(ckpt_root, model, job.optimizer, done, saved_run)

    evals: list[dict] = []
    samples_per_s = _steps(cfg, job, start, watch, between_steps)
    saved = None
    if tcfg.save_checkpoint or tcfg.checkpoint_every:
        saved = str(save_checkpoint(ckpt_root, model, job.optimizer, tcfg.max_steps, saved_run))
    final = run_eval()
    world = len(job.shares)
    losses = watch.losses
    step_losses = torch.stack(losses).double() if losses else torch.zeros(0, dtype=torch.float64)
    dist.all_reduce(step_losses)  # one collective for the whole run: global mean per step
    step_losses /= world
    window = step_losses[-tcfg.log_every :]
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
        "batch_per_rank": job.shares,
        "train_loss": float(window.mean()) if len(window) else None,
        **final,
        "evals": evals,
        "pipeline": cfg.pipeline.name.value,
        "pipeline_stats": _per_step(getattr(pipeline, "stats", None)),
        "planner": cfg.planner.name.value,
        "model": cfg.model.name,
        "cluster": cfg.cluster.name,
        "checkpoint": saved,
        "step_losses": step_losses.tolist(),
        "versions": versions(),
    }
    if job.rank == 0:
        write_losses(Path(run_dir) / "train_losses.csv", start, result["step_losses"])
    return result


def _steps(cfg: TrainConfig, job: Training, start: int, watch: LossWatch,
           between_steps: Callable[[int], None]) -> float | None:  # fmt: skip
    """The train steps from `start`, each loss recorded in `watch`; `between_steps(done)`
    after each. Returns the samples per second after the warm-up, the time spent in
    `between_steps` left out (None: no timed steps)."""
    tcfg, world = cfg.trainer, len(job.shares)
    train_iter = job.batches("train", start, tcfg.max_steps)
    bar = Progress(tcfg.max_steps, start, f"train {cfg.pipeline.name.value} x{world}",
                   enabled=job.rank == 0 and tcfg.progress_bar, loss=True)  # fmt: skip
    t_start, timed_from = time.perf_counter(), start
    paused_s = 0.0
    for step in range(start, tcfg.max_steps):
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
        if done == start + tcfg.warmup_steps:
            t_start, timed_from, paused_s = time.perf_counter(), done, 0.0
        if done % tcfg.log_every == 0 or done == tcfg.max_steps:
            bar.set_postfix(loss=f"{watch.check():.4f}")
        bar.update(1)
        pause = time.perf_counter()
        between_steps(done)
        paused_s += time.perf_counter() - pause
    bar.close()
    timed_steps = tcfg.max_steps - timed_from
    elapsed = time.perf_counter() - t_start - paused_s
    return sum(job.shares) * timed_steps / elapsed if timed_steps else None


def write_interrupted(run_dir: Path, ckpt_root: Path, start: int, watch: LossWatch,
                      signal_name: str) -> None:  # fmt: skip
    """Rank 0, stopped by Ctrl-C or SIGTERM: the losses checked so far (global means) and a
    summary saying where the run stopped; half-written checkpoints (no .metadata) go."""
    for partial in ckpt_root.glob(f"{STEP_PREFIX}*") if ckpt_root.is_dir() else ():
        if not (partial / ".metadata").exists():
            shutil.rmtree(partial, ignore_errors=True)
    try:
        last = str(latest_checkpoint(ckpt_root))
    except FileNotFoundError:
        last = None
    write_losses(run_dir / "train_losses.csv", start, watch.reduced)
    summary = {"interrupted": signal_name, "start_step": start,
               "steps_done": start + len(watch.losses), "last_checkpoint": last,
               "train_loss": watch.reduced[-1] if watch.reduced else None}  # fmt: skip
    write_summary(run_dir, summary)


def _per_step(stats: dict | None) -> dict | None:
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
