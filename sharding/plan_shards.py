"""Read a TorchRec ShardingPlan as cost-model shards (one per table part per rank).

What each sharding type costs is priced by what TorchRec does with it: table-wise,
column-wise and table-column-wise shards send one pooled vector of their columns per
sample of every other rank; row-wise shards send their partial sums the same way (a
reduce-scatter); table-row-wise shards reduce their partial sums within their node first
(`Shard.node_reduce`); data-parallel tables are looked up locally and all-reduce their
gradients. UVM-caching shards keep all their rows in host memory and `load factor x rows`
of them in an HBM cache that serves coverage(load factor x table rows) of the lookups
(the hottest rows, from the access profile); plain UVM shards read host memory only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchrec.distributed.types import ShardingPlan

from sharding.batch_split import equal_batch
from sharding.errors import UserError
from sharding.plan_eval import finish_table
from sharding.types import ALL_RANKS, Plan, PlanInputs, Shard, TablePlan, TableStats, Tier

_KERNEL_TIER = {"fused_uvm": Tier.host, "fused_uvm_caching": Tier.cached}
DEFAULT_CACHE_LOAD_FACTOR = 0.2  # TorchRec's and FBGEMM's when a plan names none


class LayoutError(UserError, ValueError):
    """A plan layout (plan_layout.json) that is malformed or not of this model and cluster."""


def plan_layout(plan: ShardingPlan) -> list[dict]:
    """A TorchRec plan as JSON-able rows: table, sharding type, kernel, ranks, shard sizes."""
    rows = []
    for module, module_plan in plan.plan.items():
        for name, ps in module_plan.items():
            shards = [
                {"rank": md.placement.rank(), "rows": md.shard_sizes[0], "cols": md.shard_sizes[1]}
                for md in (ps.sharding_spec.shards if ps.sharding_spec is not None else [])
            ]
            clf = ps.cache_params.load_factor if ps.cache_params is not None else None
            rows.append(
                {
                    "module": module,
                    "table": name,
                    "sharding_type": ps.sharding_type,
                    "compute_kernel": ps.compute_kernel,
                    "ranks": ps.ranks,
                    "cache_load_factor": clf,
                    "shards": shards,
                }
            )
    return rows


def check_layout(layout: object) -> None:
    """Raise ValueError unless `layout` is a list of plan_layout rows (see plan_layout)."""
    if not isinstance(layout, list) or not layout:
        raise LayoutError("a layout is a non-empty JSON list of table rows")
    for i, row in enumerate(layout):
        keys = ("table", "sharding_type", "compute_kernel", "shards")
        if not isinstance(row, dict) or any(k not in row for k in keys):
            raise LayoutError(f"row {i} needs the keys {', '.join(keys)}")
        for s in row["shards"]:
            if not isinstance(s, dict) or any(
                not isinstance(s.get(k), int) or s[k] < 0 for k in ("rank", "rows", "cols")
            ):
                raise LayoutError(
                    f"row {i} ({row['table']}): a shard needs integer rank, rows "
                    f"and cols >= 0, got {s}"
                )


def shards_from_layout(
    layout: Sequence[dict],
    tables: Sequence[TableStats],
    world: int,
    coverage: Mapping | None = None,
) -> list[Shard]:
    """`coverage`: per table, hottest-k rows -> share of lookups (for UVM caches; without
    it a cache is taken to hit every lookup)."""
    by_name = {t.name: t for t in tables}
    shards: list[Shard] = []
    for row in layout:
        name = row["table"]
        if name not in by_name:
            raise LayoutError(
                f"the layout names table '{name}', which the model does not have; "
                f"its tables: {sorted(by_name)[:8]}"
            )
        t = by_name[name]
        if any(not 0 <= s["rank"] < world for s in row["shards"]):
            raise LayoutError(f"the layout places table '{name}' on a rank outside 0..{world - 1}")
        if row["sharding_type"] == "data_parallel":
            shards.append(Shard(name, ALL_RANKS, t.rows, t.dim, dp=True))
            continue
        tier = _KERNEL_TIER.get(row["compute_kernel"], Tier.hbm)
        clf = row.get("cache_load_factor") or DEFAULT_CACHE_LOAD_FACTOR
        hit = 1.0
        if tier == Tier.cached and coverage is not None:
            hit = coverage[name](int(clf * t.rows))
        reduce = row["sharding_type"] == "table_row_wise"
        for s in row["shards"]:
            cache_rows = int(clf * s["rows"]) if tier == Tier.cached else 0
            shards.append(
                Shard(
                    name,
                    s["rank"],
                    s["rows"],
                    s["cols"],
                    tier,
                    hit_rate=hit,
                    cache_rows=cache_rows,
                    node_reduce=reduce,
                )
            )
    return shards


def plan_from_layout(name: str, layout: Sequence[dict], inputs: PlanInputs) -> Plan:
    """A layout (TorchRec's plan as rows) as our Plan, equal batch shares as TorchRec uses,
    so the cost model judges it like any other; each table keeps TorchRec's sharding type."""
    shards = shards_from_layout(layout, inputs.tables, inputs.world, inputs.coverage)
    kind = {row["table"]: row["sharding_type"] for row in layout}
    by_table: dict[str, list[Shard]] = {}
    for s in shards:
        by_table.setdefault(s.table, []).append(s)
    tables = [_table_plan(t, by_table.get(t.name, []), kind.get(t.name)) for t in inputs.tables]
    return Plan(name, inputs.cluster, tables, equal_batch(inputs.global_batch, inputs.world))


def _table_plan(t: TableStats, own: list[Shard], kind: str | None) -> TablePlan:
    if not own:
        raise LayoutError(f"the layout does not place table '{t.name}'")
    dp = all(s.dp for s in own)
    tp = TablePlan(
        t.name,
        t.rows,
        t.dim,
        "data_parallel" if dp else "",
        [],
        own[0].tier,
        hot_rows=t.rows if dp else 0,
        replicated_rows=t.rows if dp else 0,
        shards=own,
    )
    tp = finish_table(tp)
    tp.sharding_type = kind
    return tp


class LayoutShards:
    """The shards of many layouts of the same tables, as `plan_from_layout(...).shards()`
    gives them (the same shards in the same order), each table's kept by its row: TorchRec's
    rated plans differ from each other in a few tables."""

    def __init__(self, inputs: PlanInputs) -> None:
        self.inputs = inputs
        self.kept: dict[tuple, list[Shard]] = {}

    def __call__(self, layout: Sequence[dict]) -> list[Shard]:
        inputs = self.inputs
        rows = {row["table"]: row for row in layout}
        out: list[Shard] = []
        for t in inputs.tables:
            row = rows.get(t.name)
            if row is None:
                raise LayoutError(f"the layout does not place table '{t.name}'")
            key = (
                t.name,
                row["sharding_type"],
                row["compute_kernel"],
                row.get("cache_load_factor"),
                tuple((s["rank"], s["rows"], s["cols"]) for s in row["shards"]),
            )
            if key not in self.kept:
                own = shards_from_layout([row], inputs.tables, inputs.world, inputs.coverage)
                self.kept[key] = _table_plan(t, own, row["sharding_type"]).shards
            out += self.kept[key]
        return out
