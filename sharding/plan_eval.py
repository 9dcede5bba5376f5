"""What every planner takes and returns, and how every plan is judged: one cost model.

A planner maps `PlanInputs` (tables with access statistics, the resolved cluster, cost
constants, the global batch) to a `Plan`: per table its sharding, ranks, memory tier, hot
rows and replicated rows, as cost-model shards; plus the per-rank batch. `evaluate` fills in
the predicted step time, per-rank memory and time, and a lower bound, identically for every
planner, so plans are compared on the same terms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sharding.cost_model import (
    FLOAT_BYTES,
    DeviceCost,
    NetworkCost,
    OptimizerState,
    Schedule,
    Shard,
    TableStats,
    Tier,
    memory_bytes,
    step_cost,
)
from sharding.types import RankDevice


class PlanDoesNotFitError(RuntimeError):
    """No placement of the tables fits the cluster's memory."""


Coverage = Callable[[int], float]  # hottest-k rows -> share of the table's lookups


def power_law_coverage(rows: int, exponent: float) -> Coverage:
    """Share of lookups on the hottest k rows of a power law (the parametric profile)."""
    if abs(exponent - 1.0) < 1e-9:
        return lambda k: math.log1p(min(k, rows)) / math.log1p(rows)
    e = 1.0 - exponent
    top = (rows + 1.0) ** e - 1.0
    return lambda k: ((min(k, rows) + 1.0) ** e - 1.0) / top


@dataclass
class PlanInputs:
    tables: list[TableStats]
    coverage: dict[str, Coverage]  # per table: from a profile, or a parametric power law
    ranks: list[RankDevice]
    devices: list[DeviceCost]
    network: NetworkCost
    global_batch: int
    dense_params: int
    interaction_flops_per_sample: float = 0.0
    schedule: Schedule = Schedule.sparse_dist
    micro_batches: int = 1  # the nested schedule's N
    cpu: bool = False  # CPU ranks: table-wise, column-wise and data-parallel, one tier
    reserve: float = 0.15  # share of each device's memory kept free (activations, buffers)
    optimizer: OptimizerState = field(default_factory=OptimizerState)
    cluster: str = ""
    # True: split tables' cold parts exchange only their own lookups (sequence embeddings);
    # False: TorchRec's pooled exchange, one vector per sample
    cold_only_exchange: bool = True

    @property
    def world(self) -> int:
        return len(self.ranks)

    def row_bytes(self, cols: int) -> int:
        return cols * (FLOAT_BYTES + self.optimizer.per_value_bytes) + self.optimizer.per_row_bytes

    def hbm_budget(self) -> list[float]:
        """Bytes each rank may fill: device memory (a CPU rank's budget) less the reserve."""
        return [r.hbm_bytes * (1 - self.reserve) for r in self.ranks]

    def host_budget(self) -> list[float]:
        return [0.0 if self.cpu else r.host_bytes * (1 - self.reserve) for r in self.ranks]


@dataclass
class TablePlan:
    name: str
    rows: int
    dim: int
    sharding_type: str  # table_wise | column_wise | row_wise | data_parallel
    ranks: list[int]
    tier: Tier
    hot_rows: int  # rows served from fast memory: all of an HBM table, a cache's rows
    replicated_rows: int  # hottest rows replicated on every rank (data parallel)
    shards: list[Shard]


@dataclass
class Plan:
    planner: str
    cluster: str
    tables: list[TablePlan]
    batch_per_rank: list[int]
    feasible: bool = True
    est_step_ms: float = 0.0
    lower_bound_ms: float = 0.0
    planning_s: float = 0.0
    devices: list[dict] = field(default_factory=list)
    a2a_bytes_per_step: float = 0.0
    torchrec_text: str | None = None  # TorchRec's own plan text, for plans TorchRec made

    def shards(self) -> list[Shard]:
        return [s for t in self.tables for s in t.shards]


def equal_batch(global_batch: int, world: int) -> list[int]:
    base, extra = divmod(global_batch, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def proportional_batch(global_batch: int, weights: list[float]) -> list[int]:
    """Split the batch by weight, largest remainders first; every rank gets at least 1."""
    w = np.asarray(weights, dtype=np.float64)
    raw = global_batch * w / w.sum()
    out = np.maximum(1, np.floor(raw)).astype(int)
    for r in np.argsort(-(raw - np.floor(raw)))[: global_batch - int(out.sum())]:
        out[r] += 1
    while out.sum() > global_batch:  # the floor of 1 overshot: take from the largest
        out[int(np.argmax(out))] -= 1
    return out.tolist()


def evaluate(plan: Plan, inputs: PlanInputs) -> Plan:
    """Fill predicted times, memory per rank and the lower bound (in place; returns plan)."""
    shards = plan.shards()
    cost = step_cost(
        inputs.tables,
        shards,
        plan.batch_per_rank,
        inputs.devices,
        inputs.network,
        inputs.dense_params,
        inputs.interaction_flops_per_sample,
    )
    mem = memory_bytes(shards, inputs.world, inputs.optimizer)
    plan.est_step_ms = 1000 * cost.step_s(inputs.schedule, inputs.micro_batches)
    plan.lower_bound_ms = lower_bound_ms(inputs)
    plan.a2a_bytes_per_step = float(sum(cost.a2a_bytes))
    hbm_cap, host_cap = inputs.hbm_budget(), inputs.host_budget()
    plan.devices = []
    for r, rank in enumerate(inputs.ranks):
        own = (
            cost.lookup_fwd_s[r] + cost.lookup_bwd_s[r] + cost.ids_a2a_s[r]
            + cost.emb_a2a_fwd_s[r] + cost.emb_a2a_bwd_s[r] + cost.dense_s[r]
        )  # fmt: skip
        plan.devices.append({
            "rank": r, "kind": rank.kind,
            "hbm_used_bytes": mem[r]["hbm"], "hbm_cap_bytes": int(hbm_cap[r]),
            "host_used_bytes": mem[r]["host"], "host_cap_bytes": int(host_cap[r]),
            "est_ms": 1000 * own, "batch": plan.batch_per_rank[r],
        })  # fmt: skip
    plan.feasible = all(
        d["hbm_used_bytes"] <= d["hbm_cap_bytes"] + 1
        and d["host_used_bytes"] <= d["host_cap_bytes"] + 1
        for d in plan.devices
    )
    return plan


def lower_bound_ms(inputs: PlanInputs) -> float:
    """No plan under the cost model can step faster: every table's lookups (forward and
    backward, all from fast memory) and all dense work spread perfectly over the cluster's
    total speed, no all-to-all at all, plus the unavoidable dense all-reduce and fixed
    overhead. Each stage of the model is a max over ranks, which is at least this average."""
    emb_bytes = sum(inputs.global_batch * t.lookups_per_sample * t.dim * FLOAT_BYTES
                    for t in inputs.tables)  # fmt: skip
    lookup = emb_bytes / sum(
        d.emb_read_bytes_per_s / (1 + d.emb_bwd_factor) for d in inputs.devices
    )
    flops = inputs.global_batch * (6.0 * inputs.dense_params)
    inter = inputs.global_batch * inputs.interaction_flops_per_sample
    dense = flops / sum(d.dense_flops_per_s for d in inputs.devices) + inter / sum(
        d.interaction_flops_per_s or d.dense_flops_per_s for d in inputs.devices
    )
    per_sample_s = [d.input_s_per_sample + d.sample_overhead_s for d in inputs.devices]
    per_sample = 0.0
    if all(c > 0 for c in per_sample_s):
        per_sample = inputs.global_batch / sum(1 / c for c in per_sample_s)
    w = inputs.world
    allreduce = 0.0
    if w > 1:
        link = inputs.network.allreduce
        ring_bytes = 2 * (w - 1) / w * inputs.dense_params * FLOAT_BYTES
        allreduce = 2 * (w - 1) * link.latency_s + ring_bytes / link.bytes_per_s
    overhead = min(d.step_overhead_s for d in inputs.devices)
    return 1000 * (lookup + dense + per_sample + allreduce + overhead)


def check_fits(inputs: PlanInputs) -> None:
    """Raise naming each device's share of the shortfall and the largest tables when the
    tables cannot fit the cluster's memory, whatever the placement."""
    need = sum(t.rows * inputs.row_bytes(t.dim) for t in inputs.tables)
    hbm, host = inputs.hbm_budget(), inputs.host_budget()
    have = sum(hbm) + sum(host)
    if need <= have:
        return
    gib = 2**30
    short = need - have
    devices = ", ".join(
        f"rank {r.rank} ({r.kind}): {hbm[i] / gib:.2f} GiB fast + {host[i] / gib:.2f} GiB host, "
        f"short {short * (hbm[i] + host[i]) / have / gib if have else short / gib:.2f} GiB"
        for i, r in enumerate(inputs.ranks[:8])
    ) + (" ..." if inputs.world > 8 else "")
    largest = sorted(inputs.tables, key=lambda t: -t.rows * inputs.row_bytes(t.dim))[:5]
    tables = ", ".join(
        f"{t.name} ({t.rows:,} x {t.dim}: {t.rows * inputs.row_bytes(t.dim) / gib:.2f} GiB)"
        for t in largest
    )
    raise PlanDoesNotFitError(
        f"the tables need {need / gib:.2f} GiB (weights and optimizer state) but cluster "
        f"'{inputs.cluster}' offers {have / gib:.2f} GiB after a {inputs.reserve:.0%} reserve; "
        f"per device: {devices}. Largest tables: {tables}. Fix: a larger cluster, fewer rows "
        f"(hashing / a frequency threshold: recsys.data.remap), or a smaller embedding_dim."
    )
