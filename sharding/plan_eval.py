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
    exposed_exchange_passes,
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
    cold_parts: int = 1  # > 1: the cold rows in that many row parts, one shard each


def cold_suffixes(parts: int) -> list[str]:
    """Names of a split table's cold part: `_cold` kept whole, else `_cold0` .. `_cold{k-1}`."""
    return ["_cold"] if parts <= 1 else [f"_cold{j}" for j in range(parts)]


def cold_part_rows(cold_rows: int, parts: int) -> list[int]:
    """Rows of each row part of a cold part when cold row c goes to part c mod `parts`."""
    return [(cold_rows - j + parts - 1) // parts for j in range(max(1, parts))]


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


def dense_s_per_sample(inputs: PlanInputs) -> np.ndarray:
    """Per rank: seconds of dense work (MLPs and feature interaction) per sample."""
    return np.array([
        6.0 * inputs.dense_params / d.dense_flops_per_s
        + inputs.interaction_flops_per_sample / (d.interaction_flops_per_s or d.dense_flops_per_s)
        for d in inputs.devices
    ])  # fmt: skip


def capped_time(global_batch: int, sample_s: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Per cap: the least T with sum_r min(cap, T / sample_s[r]) >= global_batch, i.e. the
    dense stage of the best split that gives no rank more than `cap` samples (continuous)."""
    caps = np.atleast_1d(np.asarray(caps, dtype=np.float64))
    lo = np.full_like(caps, global_batch / np.sum(1.0 / sample_s))  # uncapped: proportional
    hi = caps * sample_s.max()  # every rank at the cap (needs cap >= global_batch / world)
    for _ in range(60):
        mid = (lo + hi) / 2
        enough = np.minimum(caps[:, None], mid[:, None] / sample_s[None, :]).sum(1) >= global_batch
        hi, lo = np.where(enough, mid, hi), np.where(enough, lo, mid)
    return hi


def capped_batch(global_batch: int, sample_s: np.ndarray, cap: int) -> list[int]:
    """Shares in proportion to speed (1 / sample_s), but none above `cap` samples: the rest
    goes to the slower ranks, still in proportion (water-filling); integers summing up."""
    cap = max(int(cap), math.ceil(global_batch / len(sample_s)))
    t = float(capped_time(global_batch, sample_s, np.array([cap]))[0])
    raw = np.minimum(cap, t / sample_s)
    raw *= global_batch / raw.sum()
    out = np.minimum(cap, np.maximum(1, np.floor(raw))).astype(int)
    order = np.argsort(-(raw - np.floor(raw)))
    while out.sum() < global_batch:  # largest remainders first, never past the cap
        for r in order:
            if out.sum() < global_batch and out[r] < cap:
                out[r] += 1
    while out.sum() > global_batch:
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
    """No plan under the cost model can step faster (every term below is at most what the
    cost model charges any plan, whatever its placement, replication and batch split):
    - lookups: every table's forward and backward, all from fast memory, spread perfectly
      over the cluster's total embedding speed; batch assembly likewise;
    - dense: the rank with the largest batch b runs at best at the fastest device's speed,
      and no rank finishes before total work / total speed;
    - exchange: on a rank with batch b, max(sent, recv) >= (b/B) sent + (1 - b/B) recv,
      which is b (B - b) / B x (bytes of every exchanged shard's vectors per sample),
      whatever it owns. Per table that volume is dim x (1 for TorchRec's pooled exchange;
      lookups x (1 - coverage(h)) for a cold part exchanged alone; 0 replicated whole),
      and replicating its hottest h rows costs their gradients' ring all-reduce: each
      table takes its cheapest h (lookup shares are taken as consistent with the coverage
      curve: h rows serve at most coverage(h) of the lookups);
    - the dense all-reduce and the smallest fixed overhead.
    The minimum over the largest batch b couples dense work and exchange. b and h are
    searched on grids, each interval charged its cheapest end, so the bound stays valid."""
    devs = inputs.devices
    emb_bytes = sum(inputs.global_batch * t.lookups_per_sample * t.dim * FLOAT_BYTES
                    for t in inputs.tables)  # fmt: skip
    lookup = emb_bytes / sum(d.emb_read_bytes_per_s / (1 + d.emb_bwd_factor) for d in devs)
    per_sample_s = [d.input_s_per_sample + d.sample_overhead_s for d in devs]
    per_sample = 0.0
    if all(c > 0 for c in per_sample_s):
        per_sample = inputs.global_batch / sum(1 / c for c in per_sample_s)
    w, big_b = inputs.world, inputs.global_batch
    allreduce = 0.0
    if w > 1:
        link = inputs.network.allreduce
        ring_bytes = 2 * (w - 1) / w * inputs.dense_params * FLOAT_BYTES
        allreduce = 2 * (w - 1) * link.latency_s + ring_bytes / link.bytes_per_s
    overhead = min(d.step_overhead_s for d in devs)
    # the largest batch b on a grid; on an interval [b_i, b_i+1] the dense stage is at
    # least the fastest rank's at b_i and the best split capped at b_i+1 (capped_time)
    sample_s = dense_s_per_sample(inputs)
    b = np.unique(np.concatenate([np.geomspace(math.ceil(big_b / w), big_b, 200).round(),
                                  [math.ceil(big_b / w), big_b]]))  # fmt: skip
    b_hi = np.append(b[1:], b[-1])
    dense_at = np.maximum(b * sample_s.min(), capped_time(big_b, sample_s, b_hi))
    f = b * (big_b - b) / big_b  # concave: its minimum on an interval is at an end
    f_min = np.minimum(f, b_hi * (big_b - b_hi) / big_b)
    exchange = np.zeros_like(f_min)
    if w > 1:
        passes = exposed_exchange_passes(inputs.schedule, inputs.micro_batches)
        a2a_s = passes * FLOAT_BYTES / inputs.network.alltoall.bytes_per_s
        ar_s = 2 * (w - 1) / w * FLOAT_BYTES / inputs.network.allreduce.bytes_per_s
        for t in inputs.tables:
            h = np.unique(np.concatenate([[0], np.geomspace(1, t.rows, 120).round(), [t.rows]]))
            cov = np.array([inputs.coverage[t.name](int(k)) for k in h])
            share = np.minimum(1.0, t.lookups_per_sample * (1 - cov))
            if not inputs.cold_only_exchange:
                share = np.ones_like(cov)
            share[h == t.rows] = 0.0  # replicated whole: nothing exchanged
            # interval [h_i, h_i+1]: exchange at its hot end, all-reduce at its cold end
            vol = np.minimum(share, np.append(share[1:], share[-1])) * t.dim  # per sample
            ar = ar_s * h * t.dim
            cost = f_min[:, None] * a2a_s * vol[None, :] + ar[None, :]
            exchange += cost.min(axis=1)
    dense_and_exchange = float(np.min(dense_at + exchange))
    return 1000 * (lookup + dense_and_exchange + per_sample + allreduce + overhead)


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
