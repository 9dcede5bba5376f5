"""Read a TorchRec ShardingPlan as cost-model shards (one per table part per rank)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchrec.distributed.types import ShardingPlan

from sharding.cost_model import Shard, TableStats, Tier

_KERNEL_TIER = {"fused_uvm": Tier.host, "fused_uvm_caching": Tier.cached}


def plan_layout(plan: ShardingPlan) -> list[dict]:
    """A TorchRec plan as JSON-able rows: table, sharding type, kernel, ranks, shard sizes."""
    rows = []
    for module, module_plan in plan.plan.items():
        for name, ps in module_plan.items():
            shards = [
                {"rank": md.placement.rank(), "rows": md.shard_sizes[0], "cols": md.shard_sizes[1]}
                for md in (ps.sharding_spec.shards if ps.sharding_spec is not None else [])
            ]
            rows.append({"module": module, "table": name, "sharding_type": ps.sharding_type,
                         "compute_kernel": ps.compute_kernel, "ranks": ps.ranks,
                         "shards": shards})  # fmt: skip
    return rows


def shards_from_layout(
    layout: Sequence[dict],
    tables: Sequence[TableStats],
    world: int,
    hit_rates: Mapping[str, float] | None = None,
) -> list[Shard]:
    """`hit_rates`: per table, the HBM cache hit rate of cached (fused_uvm_caching) shards."""
    by_name = {t.name: t for t in tables}
    shards: list[Shard] = []
    for row in layout:
        name, t = row["table"], by_name[row["table"]]
        tier = _KERNEL_TIER.get(row["compute_kernel"], Tier.hbm)
        hit = (hit_rates or {}).get(name, 1.0) if tier == Tier.cached else 1.0
        if row["sharding_type"] == "data_parallel":
            shards += [Shard(name, r, t.rows, t.dim, dp=True) for r in range(world)]
            continue
        shards += [Shard(name, s["rank"], s["rows"], s["cols"], tier, hit) for s in row["shards"]]
    return shards
