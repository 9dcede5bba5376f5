"""How every plan is judged: one cost model, the same for every planner.

A planner maps `PlanInputs` (sharding.types: tables with access statistics, the resolved
cluster, cost constants, the global batch) to a `Plan`: per table its sharding, ranks,
memory tier, hot rows and replicated rows, as cost-model shards; plus the per-rank batch.
`evaluate` fills in the predicted step time, per-rank memory and time, and a lower bound,
identically for every planner, so plans are compared on the same terms.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sharding.batch_split import equal_batch
from sharding.bound import lower_bound_ms
from sharding.cost_model import step_cost, step_parts_s
from sharding.memory import (
    batch_bytes_per_sample,
    dense_bytes,
    input_bytes_per_sample,
    rank_memory,
    table_room,
)
from sharding.plan_check import check_plan
from sharding.types import (
    Plan,
    PlanDoesNotFitError,
    PlanInputs,
    Shard,
    StepCost,
    TablePlan,
    Tier,
)


def _merge_columns_on_one_rank(tp: TablePlan) -> None:
    """Column pieces of a table that landed on the same rank in the same tier are one piece:
    the same bytes, lookups and exchange, without TorchRec permuting two shards of one rank
    back into place (an output callback the nested pipeline's chunks do not replicate)."""
    cold = [s for s in tp.shards if not s.dp]
    if len(cold) < 2 or tp.cold_parts > 1 or any(s.node_reduce for s in cold):
        return
    first: dict[tuple, Shard] = {}  # each rank's (and tier's) first piece, and all its columns
    cols: dict[tuple, int] = {}
    for s in cold:
        key = (s.rank, s.tier, s.hit_rate, s.cache_rows, s.lookup_share, s.sparse_exchange)
        first.setdefault(key, s)
        cols[key] = cols.get(key, 0) + s.cols
    if len(first) < len(cold):
        merged = [replace(s, cols=cols[k]) if cols[k] != s.cols else s for k, s in first.items()]
        tp.shards = [s for s in tp.shards if s.dp] + merged


def finish_table(tp: TablePlan) -> TablePlan:
    """Sharding type, ranks, tier and rows in fast memory from a table's shards."""
    _merge_columns_on_one_rank(tp)
    cold = [s for s in tp.shards if not s.dp]
    if not cold:
        return tp  # replicated whole: data_parallel on every rank
    kind = "column_wise" if len(cold) > 1 else "table_wise"
    if any(s.node_reduce for s in cold):
        kind = "table_row_wise"  # row blocks over one node's ranks, reduced in the node
    elif tp.cold_parts > 1:
        kind = f"table_wise_x{tp.cold_parts}"  # row parts, each its own table
    tp.sharding_type = f"hot_replicated+{kind}" if tp.replicated_rows else kind
    if not tp.replicated_rows:
        tp.ranks = sorted({s.rank for s in cold})
    tiers = {s.tier for s in cold}
    tp.tier = next(t for t in (Tier.host, Tier.cached, Tier.hbm) if t in tiers)
    fast = [s.rows if s.tier == Tier.hbm else s.cache_rows for s in cold]
    # columns of a row sit on several ranks; row parts and row blocks hold their own rows
    rows_apart = tp.cold_parts > 1 or any(s.node_reduce for s in cold)
    tp.hot_rows = tp.replicated_rows + (sum(fast) if rows_apart else min(fast))
    return tp


def plan_cost(plan: Plan, inputs: PlanInputs) -> StepCost:
    """The cost model's per-rank stage times of one step of `plan` (`shards_cost`)."""
    return shards_cost(plan.shards(), plan.batch_per_rank, inputs)


def shards_cost(shards: list[Shard], batch: list[int], inputs: PlanInputs) -> StepCost:
    """The cost model's per-rank stage times of one step of these shards at this batch
    split, with what feeding each rank its batch costs: on GPU ranks its copy (ids, lengths,
    dense features, label) over the host-device link and the host work that assembles it,
    at its own batch share."""
    cost = step_cost(
        inputs.tables,
        shards,
        batch,
        inputs.devices,
        inputs.network,
        inputs.dense_params,
        inputs.interaction_flops_per_sample,
        nodes=[r.node for r in inputs.ranks],
    )
    if not inputs.cpu:
        per_sample = input_bytes_per_sample(inputs)
        pairs = list(zip(batch, inputs.devices, strict=True))
        cost.input_copy_s = [b * per_sample / d.host_read_bytes_per_s for b, d in pairs]
        cost.host_input_s = [b * d.host_s_per_sample for b, d in pairs]
    return cost


def evaluate(plan: Plan, inputs: PlanInputs, bound: bool = True, check_tables: bool = True) -> Plan:
    """Check the plan (`check_plan`; without `check_tables` its batch split only, for a
    checked placement with another split), then fill its predicted times, memory per rank
    and (with `bound`) the lower bound; in place, and returns the plan."""
    check_plan(plan, inputs, tables=check_tables)
    shards = plan.shards()
    cost = plan_cost(plan, inputs)
    mem = rank_memory(inputs, shards, plan.batch_per_rank)
    plan.schedule, plan.micro_batches = inputs.schedule.value, inputs.micro_batches
    plan.dense_allreduce = "hierarchical" if inputs.network.hierarchical_allreduce else "flat"
    plan.precision = inputs.precision
    plan.est_step_ms = 1000 * cost.step_s(inputs.schedule, inputs.micro_batches)
    parts = step_parts_s(cost, inputs.schedule, inputs.micro_batches)
    plan.step_parts_ms = {k: 1000 * v for k, v in parts.items()}
    if bound:
        plan.lower_bound_ms = lower_bound_ms(inputs)
    plan.a2a_bytes_per_step = float(sum(cost.a2a_bytes))
    hbm_cap, host_cap = inputs.hbm_budget(), inputs.host_budget()
    plan.devices = []
    for r, rank in enumerate(inputs.ranks):
        lookup = cost.lookup_fwd_s[r] + cost.lookup_bwd_s[r]
        exchange = cost.ids_a2a_s[r] + cost.emb_a2a_fwd_s[r] + cost.emb_a2a_bwd_s[r]
        plan.devices.append(
            {
                "rank": r,
                "node": rank.node,
                "kind": rank.kind,
                "hbm_used_bytes": mem[r]["hbm"],
                "hbm_cap_bytes": int(hbm_cap[r]),
                "host_used_bytes": mem[r]["host"],
                "host_cap_bytes": int(host_cap[r]),
                "hbm_parts_bytes": {k: mem[r][k] for k in ("tables", "buffers", "dense", "batch")},
                "est_ms": 1000 * (lookup + exchange + cost.dense_s[r]),
                "batch": plan.batch_per_rank[r],
                "lookup_ms": 1000 * lookup,
                "exchange_ms": 1000 * exchange,
                "dense_ms": 1000 * cost.dense_s[r],
                "split_ms": 1000 * (cost.split_s[r] if cost.split_s else 0.0),
            }
        )
    plan.feasible = all(
        d["hbm_used_bytes"] <= d["hbm_cap_bytes"] + 1
        and d["host_used_bytes"] <= d["host_cap_bytes"] + 1
        for d in plan.devices
    )
    return plan


def check_fits(inputs: PlanInputs) -> None:
    """Raise naming each device's share of the shortfall and the largest tables when the
    tables cannot fit the cluster's memory, whatever the placement."""
    need = sum(t.rows * inputs.row_bytes(t.dim) for t in inputs.tables)
    gib = 2**30
    hbm = table_room(inputs, equal_batch(inputs.global_batch, inputs.world))
    if hbm.max() <= 0:
        raise PlanDoesNotFitError(
            f"cluster '{inputs.cluster}': no device has room for tables after the dense part "
            f"({dense_bytes(inputs) / gib:.3f} GiB: parameters, gradients, optimizer state) and "
            f"its batch ({batch_bytes_per_sample(inputs):,.0f} bytes per sample: inputs in "
            f"flight, pooled embeddings, activations) within "
            f"{max(inputs.hbm_budget()) / gib:.3f} GiB after the {inputs.reserve:.0%} reserve "
            f"(sharding.memory). Fix: a smaller batch (trainer.batch_size) or devices with "
            f"more memory."
        )
    hbm = np.maximum(hbm, 0.0).tolist()
    host = inputs.host_budget()
    have = sum(hbm) + sum(host)
    if need <= have:
        return
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
        f"'{inputs.cluster}' offers {have / gib:.2f} GiB after a {inputs.reserve:.0%} reserve, "
        f"the dense part and the batch; per device: {devices}. Largest tables: {tables}. "
        f"Fix: a larger cluster, fewer rows (hashing / a frequency threshold: "
        f"recsys.data.remap), or a smaller embedding_dim."
    )
