"""TorchRec's own EmbeddingShardingPlanner, configured the way its best users would.

What it is told (`torchrec_topology`, `torchrec_constraints`): what every plan is judged
against, and the freedoms hybrid has:
- per rank: capacity (`CustomTopologyData`: hbm_cap, ddr_cap; on CPU ranks the rank's
  budget is its ddr_cap): the room `sharding.memory` leaves its tables at equal batch
  shares (the reserve, the dense part's state and the batch taken out; TorchRec counts each
  shard's input and output buffers itself), with no storage reservation of its own; per
  cluster: ranks per node, intra- and inter-node bandwidth,
  HBM bandwidth and the host-device bandwidth of the cluster's devices (TorchRec takes one
  number for each: the mean over ranks; it has no per-rank speed);
- per table: every sharding type its sharder supports on the device (data-parallel,
  table-wise, column-wise, table-column-wise, and on GPUs row-wise and table-row-wise;
  `grid_shard` is left out: it combines column-wise with table-row-wise in a way our cost
  model does not price), every compute kernel (on GPUs with host memory: fused, fused_uvm
  and fused_uvm_caching), column pieces down to `min_partition` (default: hybrid's
  narrowest, 4 columns), the pooling factor, and for
  UVM caching a load factor and cache statistics from the access profile;
- its stock proposers (grid search, two greedy, uniform) and, where host memory exists,
  its `EmbeddingOffloadScaleupProposer`, which sizes caches from those statistics.
It keeps its best plan under its own estimate: that is what a TorchRec user gets. Every
plan it rated is kept too (`TorchRecResult.proposals`) so that our cost model can price
them all and show TorchRec's best under our model beside its own choice.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.perf_models import NoopPerfModel
from torchrec.distributed.planner.proposers import (
    EmbeddingOffloadScaleupProposer,
    GreedyProposer,
    GridSearchProposer,
    UniformProposer,
)
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    CustomTopologyData,
    HardwareConfig,
    KernelConfig,
    PlannerError,
    ShardingOption,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import (
    CacheParams,
    CacheStatistics,
    ModuleSharder,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.embedding_configs import DataType

from sharding.batch_split import equal_batch
from sharding.cluster import local_world_size
from sharding.errors import UserError
from sharding.memory import table_room
from sharding.plan_check import check_inputs
from sharding.plan_eval import evaluate, shards_cost
from sharding.plan_shards import LayoutShards, plan_from_layout, plan_layout
from sharding.types import Coverage, Plan, PlanDoesNotFitError, PlanInputs, PlannerConfig

CACHE_HIT_TARGET = 0.9  # a UVM cache's starting size: the hottest rows with this hit rate


def torchrec_topology(inputs: PlanInputs) -> Topology:
    """TorchRec Topology with each rank's own capacity and the cluster's own bandwidths."""
    ranks, world = inputs.ranks, inputs.world
    device = "cpu" if inputs.cpu else "cuda"
    room = [int(max(0.0, x)) for x in table_room(inputs, equal_batch(inputs.global_batch, world))]
    if inputs.cpu:
        caps = {"hbm_cap": [0] * world, "ddr_cap": room}
    else:
        # at least a byte: TorchRec 1.9.2 sizes row-wise shards in proportion to the devices'
        # HBM and divides by its sum, which no room anywhere makes zero (a byte fits no shard)
        caps = {
            "hbm_cap": [max(1, x) for x in room],
            "ddr_cap": [int(x) for x in inputs.host_budget()],
        }
    per_ms = 1e-3  # TorchRec's bandwidths are bytes per millisecond
    net = inputs.network
    mean = lambda xs: float(np.mean(xs))  # noqa: E731
    hbm = (
        mean([d.emb_read_bytes_per_s for d in inputs.devices])
        if inputs.cpu
        else mean([r.hbm_gbyte_s * 1e9 for r in ranks])
    )
    hardware = HardwareConfig(
        intra_host_bw=net.intra_alltoall.bytes_per_s * per_ms,
        inter_host_bw=min(net.alltoall.bytes_per_s, net.intra_alltoall.bytes_per_s) * per_ms,
        hbm_mem_bw=hbm * per_ms,
        ddr_mem_bw=hbm * per_ms if inputs.cpu else None,  # CPU ranks: their own memory
        hbm_to_ddr_mem_bw=mean([r.host_to_device_gbyte_s * 1e9 for r in ranks]) * per_ms,
    )
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=world,
            local_world_size=local_world_size(ranks),
            additional_params={"custom_topology_data": CustomTopologyData(caps, world)},
        ),
        hardware_config=hardware,
        kernel_config=KernelConfig(compute_device=device, use_hardware_based_bandwidth=True),
    )


class CoverageCacheStats(CacheStatistics):
    """TorchRec's cache statistics from an access profile's coverage curve: a cache of the
    hottest clf x rows rows misses 1 - coverage(clf x rows) of the lookups."""

    def __init__(self, coverage: Coverage, rows: int, lookups_per_step: float) -> None:
        self._coverage, self._rows = coverage, rows
        self._lookups = float(min(rows, lookups_per_step))  # distinct ids: at most these
        grid = np.linspace(0, 1, 65)
        self._cacheability = float(np.trapezoid([self.expected_miss_rate(c) for c in grid], grid))

    @property
    def expected_lookups(self) -> float:
        return self._lookups

    def expected_miss_rate(self, clf: float) -> float:
        return 1.0 - self._coverage(int(clf * self._rows)) if clf < 1 else 0.0

    @property
    def cacheability(self) -> float:
        return self._cacheability


def cache_load_factor(coverage: Coverage, rows: int) -> float:
    """The share of rows whose cache serves CACHE_HIT_TARGET of the lookups, in [0.01, 1)."""
    for clf in np.geomspace(0.01, 0.99, 40):
        if coverage(int(clf * rows)) >= CACHE_HIT_TARGET:
            return float(clf)
    return 0.99


def torchrec_constraints(inputs: PlanInputs, config: PlannerConfig) -> dict:
    """Per table: every sharding type and kernel TorchRec supports here (module docstring)."""
    if inputs.cpu:
        types = [
            ShardingType.DATA_PARALLEL,
            ShardingType.TABLE_WISE,
            ShardingType.COLUMN_WISE,
            ShardingType.TABLE_COLUMN_WISE,
        ]
        kernels = [EmbeddingComputeKernel.DENSE, EmbeddingComputeKernel.FUSED]
    else:
        types = [
            ShardingType.DATA_PARALLEL,
            ShardingType.TABLE_WISE,
            ShardingType.COLUMN_WISE,
            ShardingType.TABLE_COLUMN_WISE,
            ShardingType.ROW_WISE,
            ShardingType.TABLE_ROW_WISE,
        ]
        kernels = [EmbeddingComputeKernel.DENSE, EmbeddingComputeKernel.FUSED]
        if max(inputs.host_budget()) > 0:
            kernels += [EmbeddingComputeKernel.FUSED_UVM, EmbeddingComputeKernel.FUSED_UVM_CACHING]
    if not config.torchrec_data_parallel:
        types.remove(ShardingType.DATA_PARALLEL)
    if config.torchrec_sharding_types is not None:
        known = {x.value for x in types}
        unknown = sorted(set(config.torchrec_sharding_types) - known)
        if unknown or not config.torchrec_sharding_types:
            raise TorchRecConfigError(
                f"planner.torchrec_sharding_types={list(config.torchrec_sharding_types)}: "
                f"{unknown or 'none given'}; on this cluster TorchRec's planner may choose "
                f"{sorted(known)}"
            )
        types = [x for x in types if x.value in config.torchrec_sharding_types]
    out = {}
    for t in inputs.tables:
        cov = inputs.coverage[t.name]
        lookups = inputs.global_batch * t.lookups_per_sample
        cache = CacheParams(
            load_factor=cache_load_factor(cov, t.rows),
            stats=CoverageCacheStats(cov, t.rows, lookups),
        )
        out[t.name] = ParameterConstraints(
            sharding_types=[x.value for x in types],
            compute_kernels=[k.value for k in kernels],
            min_partition=max(4, min(t.dim, config.torchrec_min_partition)),
            pooling_factors=[max(t.lookups_per_sample, 1e-3)],
            cache_params=None if inputs.cpu else cache,
        )
    return out


class TorchRecConfigError(UserError, ValueError):
    """A planner.torchrec_* setting TorchRec's planner cannot take on this cluster."""


class _Recorder(NoopPerfModel):
    """TorchRec's stock rating (the slowest rank's summed shard estimates, ms), and a copy of
    every plan it rates as JSON-able layout rows (see sharding.plan_shards)."""

    def __init__(self, topology: Topology) -> None:
        super().__init__(topology)
        self.rated: list[tuple[float, list[dict]]] = []

    def rate(self, plan: list[ShardingOption]) -> float:
        rating = super().rate(plan)
        self.rated.append((rating, [_layout_row(so) for so in plan]))
        return rating


def _layout_row(so: ShardingOption) -> dict:
    return {
        "table": so.name,
        "sharding_type": so.sharding_type,
        "compute_kernel": so.compute_kernel,
        "cache_load_factor": so.cache_load_factor,
        "ranks": [sh.rank for sh in so.shards],
        "shards": [{"rank": sh.rank, "rows": sh.size[0], "cols": sh.size[1]} for sh in so.shards],
    }


@dataclass
class TorchRecResult:
    plan: ShardingPlan  # TorchRec's choice: the best plan under its own estimate
    own_estimate_ms: float  # ... and that estimate
    proposals: list[tuple[float, list[dict]]] = field(default_factory=list)  # every rated one
    planning_s: float = 0.0


def _planner(
    inputs: PlanInputs, config: PlannerConfig
) -> tuple[EmbeddingShardingPlanner, _Recorder]:
    topology = torchrec_topology(inputs)
    recorder = _Recorder(topology)
    proposers = [
        GridSearchProposer(),
        GreedyProposer(),
        GreedyProposer(use_depth=False),
        UniformProposer(),
    ]
    if not inputs.cpu and max(inputs.host_budget()) > 0:
        proposers.append(EmbeddingOffloadScaleupProposer())
    timeout = config.torchrec_timeout_s
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=math.ceil(inputs.global_batch / inputs.world),
        # the caps above are what is left after the reserve and sharding.memory's parts
        storage_reservation=FixedPercentageStorageReservation(percentage=0.0),
        proposer=proposers,
        performance_model=recorder,
        constraints=torchrec_constraints(inputs, config),
        timeout_seconds=math.ceil(timeout) if timeout else None,  # never less than asked
    )
    return planner, recorder


def tables_module(inputs: PlanInputs) -> nn.Module:
    """An EmbeddingBagCollection of the inputs' tables on the meta device (no memory)."""
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=[f"f_{t.name}"],
            data_type=DataType.FP16 if t.weight_bytes == 2 else DataType.FP32,
        )
        for t in inputs.tables
    ]
    return EmbeddingBagCollection(configs, device=torch.device("meta"))


def plan_with_torchrec(
    module: nn.Module,
    inputs: PlanInputs,
    config: PlannerConfig,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> TorchRecResult:
    """Run TorchRec's planner on `module` (built on the meta device, or `tables_module`).
    With a process group, rank 0 plans and broadcasts the plan (`collective_plan`)."""
    memoize_estimator_lookups()
    planner, recorder = _planner(inputs, config)
    sharders = sharders or [EmbeddingBagCollectionSharder()]
    start = time.perf_counter()

    def make() -> ShardingPlan:
        try:
            return planner.plan(module, sharders)
        except PlannerError as e:
            raise _does_not_fit(e, inputs) from e

    plan = make() if process_group is None else collective_plan(make, process_group)
    own = min((r for r, _ in recorder.rated), default=math.nan)
    return TorchRecResult(plan, own, recorder.rated, time.perf_counter() - start)


def memoize_estimator_lookups() -> None:
    """TorchRec 1.9.2's shard perf estimator finds a hardware config's annotated methods by
    scanning `dir(config)` on every call (`estimator.annotations._get_annotated_method` and
    `_get_coefficient_method`): 2.5 million scans on 769 tables, most of its planning time.
    A config's methods are its class's, so each lookup is memoized per (config, marker,
    sharding type): the same methods come back, TorchRec's estimates and plans unchanged.
    The memo holds each config it saw (a few per planning run) for the process's life."""
    from torchrec.distributed.planner.estimator import annotations

    for name in ("_get_annotated_method", "_get_coefficient_method"):
        lookup = getattr(annotations, name)
        if not getattr(lookup, "memoized", False):
            setattr(annotations, name, _memoized(lookup))


def _memoized(lookup: Callable) -> Callable:
    kept: dict[tuple, tuple] = {}  # (id(config), marker, sharding type) -> (config, method)

    def memoized(config, marker: str, sharding_type: str | None = None):
        key = (id(config), marker, sharding_type)
        hit = kept.get(key)
        if hit is None or hit[0] is not config:  # the config held: its id is not reused
            hit = kept[key] = (config, lookup(config, marker, sharding_type))
        return hit[1]

    memoized.memoized = True
    memoized.original = lookup
    return memoized


def _does_not_fit(e: PlannerError, inputs: PlanInputs) -> PlanDoesNotFitError:
    budget = ", ".join(
        f"rank {r.rank} ({r.kind}): {r.hbm_bytes / 2**30:.2f} GiB" for r in inputs.ranks[:8]
    ) + (" ..." if inputs.world > 8 else "")
    return PlanDoesNotFitError(
        f"TorchRec's planner found no plan that fits: {e.error_type.name}. Per-rank memory: "
        f"{budget}. Fix: a cluster with more memory (cluster=..., or "
        f"cluster.nodes.0.devices.0.hbm_gib=...), fewer or smaller tables (model=...), or a "
        f"smaller planner.storage_reservation. TorchRec said: {str(e).splitlines()[0]}"
    )


@dataclass
class _Failed:
    """What rank 0 sends instead of a plan: the error every rank then raises."""

    kind: type[Exception]
    message: str


def collective_plan(make: Callable[[], ShardingPlan], group: dist.ProcessGroup) -> ShardingPlan:
    """TorchRec's `collective_plan` (rank 0 makes the plan, the group receives it by
    `broadcast_object_list`), with whatever ends rank 0's planning sent on: the plan, or the
    error, which every rank then raises. TorchRec's sends nothing when rank 0 raises (a
    plan that does not fit), and a plan that does not pickle fails inside the broadcast:
    either way the other ranks wait out the collective timeout. A user error travels as
    itself (every rank prints the same line), anything else as a RuntimeError naming it."""
    sent: list = [None]
    failure = None
    if group.rank() == 0:
        try:
            sent = [make()]
            pickle.dumps(sent[0])  # what the broadcast does: fail here, where it is named
        except Exception as e:  # noqa: BLE001 - sent to every rank, raised again below
            failure = e
            if isinstance(e, UserError):
                sent = [_Failed(type(e), str(e))]
            else:
                why = f"rank 0 could not make or send TorchRec's plan: {type(e).__name__}: {e}"
                sent = [_Failed(RuntimeError, why)]
    if group.size() > 1:
        dist.broadcast_object_list(sent, group_src=0, group=group)
    if failure is not None:
        raise failure
    if isinstance(sent[0], _Failed):
        raise sent[0].kind(sent[0].message)
    return sent[0]


@dataclass
class TorchRecPlans:
    chosen: Plan  # TorchRec's own choice, priced by our cost model
    best_ours: Plan  # of every plan TorchRec rated, the fastest feasible one under our model
    own_estimate_ms: float  # TorchRec's estimate of its choice (its own units: ms)
    proposals: int  # plans TorchRec rated
    result: TorchRecResult


def torchrec_plans(
    inputs: PlanInputs, config: PlannerConfig, module: nn.Module | None = None
) -> TorchRecPlans:
    """Plan with TorchRec (on `module`, default `tables_module(inputs)`), then price its
    choice and every plan it rated with our cost model (equal batch shares, as TorchRec)."""
    check_inputs(inputs)
    result = plan_with_torchrec(module or tables_module(inputs), inputs, config)
    chosen = evaluate(plan_from_layout("torchrec", plan_layout(result.plan), inputs), inputs)
    chosen.planning_s = result.planning_s
    chosen.torchrec_text = str(result.plan)
    layouts = list({repr(layout): layout for _, layout in result.proposals}.values())
    best = _fastest(chosen, layouts, inputs)
    if best is not chosen:
        best.lower_bound_ms, best.planning_s = chosen.lower_bound_ms, chosen.planning_s
        best.planner = "torchrec_best"
    return TorchRecPlans(chosen, best, result.own_estimate_ms, len(result.proposals), result)


def _fastest(chosen: Plan, layouts: list[list[dict]], inputs: PlanInputs) -> Plan:
    """The fastest plan that fits among `chosen` (evaluated) and the rated `layouts`, the
    first of equals (the fastest of all where none fits). Each rated plan is priced by its
    step alone (`LayoutShards`), then checked in full fastest first until one fits: checking
    every plan in full took longer than TorchRec's own search on many tables."""
    shards, batch = LayoutShards(inputs), equal_batch(inputs.global_batch, inputs.world)
    steps = [
        1000 * shards_cost(shards(x), batch, inputs).step_s(inputs.schedule, inputs.micro_batches)
        for x in layouts
    ]
    order = sorted(range(len(layouts)), key=steps.__getitem__)  # stable: the first of equals
    fastest = None  # evaluated, where none fits
    for i in order:
        if chosen.feasible and steps[i] >= chosen.est_step_ms:
            return chosen  # nothing faster fits
        plan = evaluate(plan_from_layout("torchrec", layouts[i], inputs), inputs, bound=False)
        if plan.feasible:
            return plan
        fastest = plan if i == order[0] else fastest
    if chosen.feasible or fastest is None or steps[order[0]] >= chosen.est_step_ms:
        return chosen  # it fits and nothing faster does, or nothing fits and it is fastest
    return fastest  # nothing fits: the fastest
