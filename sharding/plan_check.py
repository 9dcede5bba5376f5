"""What makes planner inputs and plans valid, checked before anything is priced.

`check_inputs` refuses inputs that describe no real training step (a non-positive
bandwidth, a negative latency, a reserve outside [0, 1), fewer samples than ranks, a table
without access statistics). `check_plan` refuses a plan that does not hold every table
exactly once: each table's replicated rows on every rank or none, its other rows and
columns held once (column pieces of all rows, or row pieces of all columns, or row parts),
a cold part marked as such, ranks that exist. A malformed plan priced anyway would be a
silent wrong result.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from sharding.errors import UserError
from sharding.row_parts import cold_part_rows
from sharding.types import ALL_RANKS, Tier

if TYPE_CHECKING:
    from sharding.types import Plan, PlanInputs, TablePlan


class PlanInputError(UserError, ValueError):
    """Planner inputs that describe no real training step."""


class MalformedPlanError(UserError, ValueError):
    """A plan that does not place every row and column of every table exactly once."""


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check_inputs(inputs: PlanInputs) -> None:
    """Raise PlanInputError naming the first input that cannot describe a training step."""
    w = inputs.world
    if w < 1 or not inputs.tables:
        raise PlanInputError(f"nothing to plan: {w} ranks, {len(inputs.tables)} tables")
    if not (_finite(inputs.global_batch) and inputs.global_batch >= w):
        raise PlanInputError(
            f"a global batch of {inputs.global_batch} samples leaves some of the {w} ranks "
            f"without a sample; every rank needs at least 1 (trainer.batch_size >= 1)"
        )
    if not (_finite(inputs.reserve) and 0 <= inputs.reserve < 1):
        raise PlanInputError(
            f"storage reservation {inputs.reserve} is the share of each device's memory kept "
            f"free; it must lie in [0, 1) (planner.storage_reservation)"
        )
    if inputs.micro_batches < 1:
        raise PlanInputError(f"micro_batches must be >= 1, got {inputs.micro_batches}")
    if not (_finite(inputs.dense_params) and inputs.dense_params >= 0):
        raise PlanInputError(f"dense_params must be >= 0, got {inputs.dense_params}")
    net = inputs.network
    for name, link in (
        ("all-to-all", net.alltoall),
        ("all-reduce", net.allreduce),
        ("intra-node all-to-all", net.intra_alltoall),
    ):
        if not (_finite(link.bytes_per_s) and link.bytes_per_s > 0):
            raise PlanInputError(
                f"the {name} link's bandwidth must be > 0, got "
                f"{link.bytes_per_s} bytes/s (cluster.network)"
            )
        if not (_finite(link.latency_s) and link.latency_s >= 0):
            raise PlanInputError(
                f"the {name} link's latency must be >= 0, got "
                f"{link.latency_s} s (cluster.network.latency_us)"
            )
    if len(inputs.devices) != w:
        raise PlanInputError(f"{len(inputs.devices)} device costs for {w} ranks")
    for r, d in enumerate(inputs.devices):
        for field in ("emb_read_bytes_per_s", "host_read_bytes_per_s", "dense_flops_per_s"):
            if not (_finite(getattr(d, field)) and getattr(d, field) > 0):
                raise PlanInputError(f"rank {r}: {field} must be > 0, got {getattr(d, field)}")
    seen = set()
    for t in inputs.tables:
        if t.name in seen:
            raise PlanInputError(f"table '{t.name}' is listed twice")
        seen.add(t.name)
        if t.rows < 1 or t.dim < 1:
            raise PlanInputError(
                f"table '{t.name}': rows and dim must be >= 1, got {t.rows} x {t.dim}"
            )
        if not (_finite(t.lookups_per_sample) and t.lookups_per_sample >= 0):
            raise PlanInputError(
                f"table '{t.name}': lookups per sample must be >= 0, got {t.lookups_per_sample}"
            )
        if t.name not in inputs.coverage:
            raise PlanInputError(f"table '{t.name}' has no access statistics (coverage)")


def check_plan(plan: Plan, inputs: PlanInputs, tables: bool = True) -> None:
    """Raise MalformedPlanError naming the table and the fault (module docstring);
    `tables=False`: the batch split only (a checked placement with another split)."""
    w = inputs.world
    batch = plan.batch_per_rank
    if len(batch) != w or min(batch, default=0) < 1 or sum(batch) != inputs.global_batch:
        raise MalformedPlanError(
            f"plan '{plan.planner}': batch_per_rank {batch[:8]}{'...' if len(batch) > 8 else ''} "
            f"must give each of the {w} ranks >= 1 sample, {inputs.global_batch} in all"
        )
    if not tables:
        return
    want = {t.name: t for t in inputs.tables}
    names = [tp.name for tp in plan.tables]
    if sorted(names) != sorted(want):
        missing, extra = set(want) - set(names), [n for n in names if n not in want]
        twice = sorted({n for n in names if names.count(n) > 1})
        raise MalformedPlanError(
            f"plan '{plan.planner}' must hold each table once: missing {sorted(missing)}, "
            f"unknown {extra}, twice {twice}"
        )
    for tp in plan.tables:
        _check_table(tp, want[tp.name], inputs)


def _check_shard(s, t, inputs: PlanInputs, fault) -> None:
    """One shard of table `t`: its table, rank, shape, tier and rates."""
    w = inputs.world
    if s.table != t.name:
        raise fault(f"holds a shard of table '{s.table}'")
    if s.dp and s.rank != ALL_RANKS:
        raise fault(f"a data-parallel shard on rank {s.rank}: it is a copy on every rank")
    if not s.dp and not 0 <= s.rank < w:
        raise fault(f"a shard on rank {s.rank}; ranks are 0..{w - 1}")
    if s.rows < 0 or not 1 <= s.cols <= t.dim:
        raise fault(f"a shard of {s.rows} x {s.cols} on rank {s.rank}")
    if inputs.cpu and s.tier != Tier.hbm:
        raise fault(f"a {s.tier.value} shard on a CPU cluster (one memory tier)")
    if not 0 <= s.hit_rate <= 1 or not (s.lookup_share is None or 0 <= s.lookup_share <= 1):
        raise fault(f"hit rate {s.hit_rate} or lookup share {s.lookup_share} not in [0, 1]")


def _check_shares(tp: TablePlan, hot, cold: list, fault) -> None:
    """A hot/cold split: the cold part's share of the lookups is the complement of the hot's."""
    hot_share = hot.lookup_share
    shares = [s.lookup_share for s in cold]
    if hot_share is None or any(x is None for x in shares):
        raise fault("a hot/cold split whose parts do not carry their lookup shares")
    by_rows = tp.cold_parts > 1 or cold[0].node_reduce  # row parts, or a group's row blocks
    cold_share = sum(shares) if by_rows else shares[0]
    if not by_rows and len(set(shares)) > 1:
        raise fault(f"column pieces of one cold part serve different shares {shares[:4]}")
    if abs(hot_share + cold_share - 1) > 1e-6:
        raise fault(f"hot share {hot_share:.4f} + cold share {cold_share:.4f} != 1")


def _check_table(tp: TablePlan, t, inputs: PlanInputs) -> None:
    def fault(msg: str) -> MalformedPlanError:
        return MalformedPlanError(f"table '{t.name}' ({t.rows:,} x {t.dim}): {msg}")

    if (tp.rows, tp.dim) != (t.rows, t.dim):
        raise fault(f"the plan says {tp.rows:,} x {tp.dim}")
    h = tp.replicated_rows
    if not 0 <= h <= t.rows:
        raise fault(f"replicated_rows {h} outside [0, rows]")
    for s in tp.shards:
        _check_shard(s, t, inputs, fault)
    hot = [s for s in tp.shards if s.dp]
    cold = [s for s in tp.shards if not s.dp]
    if len(hot) > 1 or any((s.rows, s.cols, s.tier) != (h, t.dim, Tier.hbm) for s in hot):
        raise fault(f"replicated rows must be one data-parallel {h:,} x {t.dim} part in HBM")
    if bool(hot) != (h > 0):
        raise fault(f"replicated_rows {h} but {len(hot)} replicated shards")
    cold_rows = t.rows - h
    if cold_rows == 0:
        if cold:
            raise fault("replicated whole, yet it has sharded parts too")
        return
    if not cold:
        raise fault(f"{cold_rows:,} rows are held nowhere")
    split = h > 0
    if any(s.sparse_exchange for s in cold) and not split:
        raise fault("a shard exchanges only its own lookups, but the table has no hot part")
    if split:
        _check_shares(tp, hot[0], cold, fault)
    if tp.cold_parts > 1:
        expect = cold_part_rows(cold_rows, tp.cold_parts)
        if [s.rows for s in cold] != expect or any(s.cols != t.dim for s in cold):
            raise fault(f"{tp.cold_parts} row parts must be {expect[:4]} rows of all columns")
        return
    by_cols = all(s.rows == cold_rows for s in cold) and sum(s.cols for s in cold) == t.dim
    by_rows = all(s.cols == t.dim for s in cold) and sum(s.rows for s in cold) == cold_rows
    if not (by_cols or by_rows):
        raise fault(
            f"its {cold_rows:,} x {t.dim} sharded rows are not held exactly once: "
            + ", ".join(f"{s.rows:,} x {s.cols} on rank {s.rank}" for s in cold[:6])
        )
    reduce = [s for s in cold if s.node_reduce]
    if reduce and (len(reduce) != len(cold) or len({s.rank for s in reduce}) != len(reduce)):
        raise fault("a table-row-wise table must be row pieces on distinct ranks, all of them")
