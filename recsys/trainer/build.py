"""What a rank trains with: its cores and threads, the data source, the model (with a plan
of ours or TorchRec's) sharded under DMP, the optimizers and the pipeline (`build_training`)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingEnv2D
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from pipelines.build import build_pipeline, unsupported_sharding
from pipelines.dense_reduce import SharedReduction, replicated_tables
from pipelines.exchange import install_ordered_reduce_scatter
from pipelines.two_d import install_replica_sync, place_group_plan, two_d_env
from recsys import launch
from recsys.checkpoint import CheckpointMismatchError, saved_split
from recsys.collectives import all_reduce_sum
from recsys.config import (
    DenseAllreduce,
    DenseOptimizer,
    SparseOptimizer,
    TrainConfigError,
    TrainerConfig,
)
from recsys.context import RunContext
from recsys.data.prefetch import InputStats, Prefetched
from recsys.data.source import build_source
from recsys.host_memory import retain_freed_memory
from recsys.models.dlrm import build_model, feature_names
from recsys.models.precision import set_precision
from recsys.models.shares import SharedBatchDLRMTrain
from recsys.models.split import SplitRemap
from sharding.cluster import ClusterConfigError, compute_device_type
from sharding.emit import for_cpu_ranks, sequence_cold, to_torchrec_plan
from sharding.plan_shards import plan_layout
from sharding.torchrec_planner import plan_with_torchrec
from sharding.two_d import group_inputs, rank_shares
from sharding.types import RankDevice

if TYPE_CHECKING:
    pass

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


class ReplicatedRowWiseAdagrad(RowWiseAdagrad):
    """TorchRec's RowWiseAdagrad, with FBGEMM's arithmetic for fp16 tables
    (`model.table_dtype=fp16`): the accumulator is fp32 and each update is computed in fp32,
    then rounded to the table's dtype. TorchRec's computes in the parameter's dtype, where
    eps (1e-8) is 0 and a row no sample touched gets 0 / 0. fp32 tables: TorchRec's own."""

    def __init__(self, params, lr: float, eps: float) -> None:
        super().__init__(params, lr=lr, eps=eps)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"] = self.state[p]["sum"].float()

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim's signature
        params = [p for group in self.param_groups for p in group["params"]]
        if all(p.dtype == torch.float32 for p in params):
            return super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                grad = p.grad.float()
                state["sum"] += grad.pow(2).mean(axis=1).view(-1, 1)
                std = state["sum"].sqrt().add_(group["eps"])
                p.copy_(p.float().addcdiv_(grad, std, value=-group["lr"]))
        return None


def _replicated_embedding_optimizer(
    cfg: TrainerConfig, params: dict[str, torch.nn.Parameter]
) -> KeyedOptimizerWrapper:
    """Data-parallel (replicated) tables get no fused kernel; they get the same update rule
    as the fused ones, row-wise Adagrad or SGD at `embedding_lr`, as a torch optimizer."""
    if SparseOptimizer(cfg.sparse_optimizer) == SparseOptimizer.rowwise_adagrad:
        return KeyedOptimizerWrapper(
            params, lambda ps: ReplicatedRowWiseAdagrad(ps, lr=cfg.embedding_lr, eps=cfg.eps)
        )
    return KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=cfg.embedding_lr))


def _fuse_embedding_optimizer(cfg: TrainerConfig, model: torch.nn.Module) -> None:
    """FBGEMM applies this optimizer inside the embedding backward (no dense grads)."""
    if SparseOptimizer(cfg.sparse_optimizer) == SparseOptimizer.rowwise_adagrad:
        opt_cls, kwargs = RowWiseAdagrad, {"lr": cfg.embedding_lr, "eps": cfg.eps}
    else:
        opt_cls, kwargs = torch.optim.SGD, {"lr": cfg.embedding_lr}
    apply_optimizer_in_backward(opt_cls, model.model.sparse_arch.parameters(), kwargs)


def rank_device(device: RankDevice, rehearse: bool = False) -> torch.device:
    """The rank's torch device, from the cluster config: a CPU rank runs on CPU even where
    CUDA exists; a GPU rank takes its node's GPU `local_rank` (the parent checked it exists,
    `recsys.app.train`), or the CPU when it is rehearsed there (`trainer.rehearse_on_cpu`)."""
    if device.kind == "cpu" or rehearse:
        return torch.device("cpu")
    torch.cuda.set_device(device.local_rank)
    return torch.device("cuda", device.local_rank)


def backend_for(ranks: list[RankDevice], rehearse: bool = False) -> str:
    """The collectives' backend the cluster's devices need: gloo for CPU ranks (GPU ranks
    rehearsed on CPU included), NCCL for GPUs."""
    return "gloo" if rehearse or compute_device_type(ranks) == "cpu" else "nccl"


def place_rank(cfg: TrainerConfig, device: RankDevice) -> None:
    """Pin the rank to its cores (cluster config), size its intra-op thread pool and keep
    the host memory it frees (`trainer.retain_host_memory`)."""
    if cfg.retain_host_memory:
        retain_freed_memory()
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


def rehearse_node(ranks: list[RankDevice], rank: int) -> None:
    """A GPU plan rehearsed on this machine's CPU ranks (`trainer.rehearse_on_cpu`) sees its
    own cluster's nodes: TorchRec takes a node's ranks from LOCAL_WORLD_SIZE (table-row-wise
    groups and their intra- and cross-node process groups), which a one-machine launch sets
    to the whole job. After `place_rank`, which sizes the thread pool by the machine's ranks."""
    node = ranks[rank].node
    os.environ["LOCAL_WORLD_SIZE"] = str(sum(r.node == node for r in ranks))
    os.environ["LOCAL_RANK"] = str(ranks[rank].local_rank)


def _hot_ids(
    source,
    hot_rows: dict[str, int],
    rows: dict[str, int],
    batches: int,
    rank: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Per split table (keyed by its feature), its `h` most frequent ids in the first
    `batches` training batches of every rank (counts summed over ranks on the rank's
    `device`, which NCCL needs; ties: lower id)."""
    features = {t[len("t_") :]: t for t in hot_rows}  # t_cat_3 serves cat_3
    counts = {f: torch.zeros(rows[t], dtype=torch.float64) for f, t in features.items()}
    for index in range(batches):
        kjt = source.batch("train", index, rank).sparse_features
        for f, c in counts.items():
            c += torch.bincount(kjt[f].values(), minlength=len(c)).double()
    out = {}
    for f, c in counts.items():
        summed = all_reduce_sum(c, device).cpu().numpy()
        order = np.lexsort((np.arange(len(c)), -summed))  # by count, then by id
        out[f] = torch.from_numpy(np.sort(order[: hot_rows[features[f]]]))
    return out


def _check_saved_split(
    checkpoint: str, hot_ids: dict[str, torch.Tensor], hot_rows: dict[str, int]
) -> None:
    """The checkpoint's hot ids must fill this plan's hot tables, table for table."""
    for table, h in sorted(hot_rows.items()):
        have = len(hot_ids.get(table[len("t_") :], ()))
        if have != h:
            raise CheckpointMismatchError(
                f"checkpoint '{checkpoint}' holds {have} hot rows of {table}, this plan {h}: "
                f"resume under the plan it was saved with (its plan.json: trainer.plan=...)"
            )


def _model_and_plan(ctx: RunContext, source, rank: int, device, two_d: ShardingEnv2D | None):
    """The train module (with its fused embedding optimizer), its TorchRec plan (2D
    groups: one group's), the sharders, and the id remap its batches need (None unless
    tables are split)."""
    cfg, our_plan = ctx.cfg, ctx.plan
    sharders: list = [EmbeddingBagCollectionSharder()]
    if our_plan is None:
        model = build_model(cfg.model, dense_device=device)
        _fuse_embedding_optimizer(cfg.trainer, model)
        inputs = group_inputs(ctx.inputs, two_d.world_size) if two_d else ctx.inputs
        # rank 0 plans (one group's plan, for 2D groups) and every rank gets it
        plan = plan_with_torchrec(model, inputs, cfg.planner, sharders, dist.group.WORLD)
        return model, plan.plan, sharders, None
    hot_rows = {
        t.name: t.replicated_rows for t in our_plan.tables if 0 < t.replicated_rows < t.rows
    }
    # row parts: of a split table's cold part, or of a table too large for one device
    cold_parts = {
        t.name: t.cold_parts
        for t in our_plan.tables
        if t.name in hot_rows or (t.replicated_rows == 0 and t.cold_parts > 1)
    }
    remap = None
    if cold_parts:
        saved = saved_split(cfg.trainer.resume_from) if cfg.trainer.resume_from else None
        if saved is not None:  # the ids the checkpoint's hot rows hold
            hot_ids = {f: torch.from_numpy(ids) for f, ids in saved[0].items()}
            _check_saved_split(cfg.trainer.resume_from, hot_ids, hot_rows)
        else:
            rows = {t.name: t.rows for t in our_plan.tables}
            hot_ids = _hot_ids(source, hot_rows, rows, cfg.planner.hot_id_batches, rank, device)
            hot_ids |= {
                t[len("t_") :]: torch.zeros(0, dtype=torch.int64)
                for t in cold_parts
                if t not in hot_rows
            }
        remap = SplitRemap(hot_ids, {t[len("t_") :]: k for t, k in cold_parts.items()})
    # the plan says which cold parts exchange only their lookups; planner.cold_only_exchange
    # =false keeps every cold part pooled (the nested pipeline chunks pooled exchanges only)
    sequences = sequence_cold(our_plan) if cfg.planner.cold_only_exchange else frozenset()
    model = build_model(
        cfg.model, device, hot_rows=hot_rows, sequence_cold=sequences, cold_parts=cold_parts
    )
    shares = our_plan.batch_per_rank
    if len(set(shares)) > 1:  # a speed-aware split: each rank its own batch size
        model = SharedBatchDLRMTrain(model.model, len(shares), sum(shares))
    _fuse_embedding_optimizer(cfg.trainer, model)
    feature_of = {f"t_{f}": f for f in feature_names(cfg.model)}
    # the cluster's kernels (a rehearsal converts them once the pipeline has seen them)
    plan = to_torchrec_plan(our_plan, feature_of, compute_device_type(ctx.ranks), sequences)
    if sequences:
        sharders.append(EmbeddingCollectionSharder())
    return model, plan, sharders, remap


def _dense_reduction(mode: DenseAllreduce, nodes: list[int]) -> SharedReduction | None:
    """How dense gradients are averaged over ranks: the buckets every pipeline shares
    (`pipelines.dense_reduce`; per tensor: a bucket each; hierarchical: by node), or None:
    TorchRec's DDP. `nodes`: each rank's node."""
    if mode == DenseAllreduce.auto:  # recsys.app.train decides it before any rank starts
        raise ValueError("trainer.dense_allreduce=auto reached a rank undecided")
    if mode == DenseAllreduce.ddp_buckets:
        return None
    if mode == DenseAllreduce.per_tensor:
        return SharedReduction(cap_bytes=0, first_bytes=0)
    return SharedReduction(nodes=nodes if mode == DenseAllreduce.hierarchical else None)


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
    prefetch: int = 0  # training batches built ahead on a worker thread
    pin: bool = False  # and pinned (a GPU rank)
    input_stats: InputStats = field(default_factory=InputStats)  # of the training batches

    def batches(self, split: str, first: int, stop: int) -> Iterator:
        """The rank's batches `first` .. `stop - 1` of `split`; training batches through
        `recsys.data.prefetch` (built ahead when `prefetch`, and timed either way)."""
        made = self._made(split, first, stop)
        if split != "train":
            return made
        return Prefetched(made, self.prefetch, self.pin, self.input_stats)

    def _made(self, split: str, first: int, stop: int) -> Iterator:
        for b in self.source.batches(split, first, stop, self.rank):
            if self.remap is not None:  # ids of split tables into their hot and cold parts
                b.sparse_features = self.remap(b.sparse_features)
            yield b

    def input_summary(self) -> dict:
        return self.input_stats.summary(self.prefetch, self.pin)


def build_training(ctx: RunContext, run_dir: str, rank: int, device) -> Training:
    """Data source, model sharded under DMP, optimizers and pipeline, from the same seed
    on every call (the process group must be up)."""
    cfg, our_plan = ctx.cfg, ctx.plan
    tcfg = cfg.trainer
    world = len(ctx.ranks)
    # 2D groups: the plan is one group's, each group trains it on its own samples
    group = tcfg.sharding_group_size
    two_d = two_d_env(group, device) if 0 < group < world else None
    torch.manual_seed(tcfg.seed)  # same dense init on every rank; shards seeded the same way
    shares = rank_shares(our_plan, world) if our_plan else [tcfg.batch_size] * world
    source = build_source(cfg.dataset, cfg.model, shares[rank], world, batch_per_rank=shares)
    model, plan, sharders, remap = _model_and_plan(ctx, source, rank, device, two_d)
    why = unsupported_sharding(cfg.pipeline, plan)
    if why:  # before DMP materialises the shards
        raise TrainConfigError(why)
    layout = plan_layout(plan)
    if rank == 0:
        (Path(run_dir) / "plan.txt").write_text(str(plan))
        (Path(run_dir) / "plan_layout.json").write_text(json.dumps(layout, indent=1))
    gpu_cluster = compute_device_type(ctx.ranks) == "cuda"
    if tcfg.rehearse_on_cpu:  # the GPU plan, checked and written above, as CPU ranks run it
        plan = for_cpu_ranks(plan)
    set_precision(model, tcfg.precision, device)
    reduction = _dense_reduction(DenseAllreduce(tcfg.dense_allreduce), [r.node for r in ctx.ranks])
    if reduction is not None:  # the data-parallel tables in its buckets, not in their own DDP
        reduction.take_tables(model)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    if two_d is not None:  # the group's plan on this rank's group
        env, plan = two_d, place_group_plan(plan, group)
    model = DistributedModelParallel(
        module=model,
        env=env,
        device=device,
        plan=plan,
        sharders=sharders,
        data_parallel_wrapper=reduction,
    )
    if two_d is not None:  # replicas sum row gradients before the fused update
        install_replica_sync(model, two_d)
        if rank == 0:
            log.info(
                "2D groups: the tables sharded within each group of %d ranks, %d groups; "
                "they sum the touched rows' gradients before each update",
                group,
                world // group,
            )
    if device.type == "cpu":  # row-wise tables: one order of the sum for every pipeline
        install_ordered_reduce_scatter(model)
    not_fused = dict(in_backward_optimizer_filter(model.named_parameters()))
    tables = {id(p) for p in replicated_tables(model).values()}
    replicated = {n: p for n, p in not_fused.items() if id(p) in tables}
    dense_opt = _dense_optimizer(tcfg, {n: p for n, p in not_fused.items() if n not in replicated})
    optimizers = [model.fused_optimizer, dense_opt]
    if replicated:  # data-parallel tables: reduced with the dense grads, same rule as fused ones
        optimizers.append(_replicated_embedding_optimizer(tcfg, replicated))
    optimizer = CombinedOptimizer(optimizers)
    pipeline = build_pipeline(
        cfg.pipeline, model, optimizer, device, reduction.reduce if reduction is not None else None
    )
    # a GPU cluster's input path (rehearsed too), pinned only where there is a GPU
    prefetch = (2 if gpu_cluster else 0) if tcfg.prefetch_batches is None else tcfg.prefetch_batches
    return Training(
        model,
        optimizer,
        dense_opt,
        pipeline,
        source,
        remap,
        shares,
        rank,
        layout,
        prefetch,
        pin=device.type == "cuda",
    )
