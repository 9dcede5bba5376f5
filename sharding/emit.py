"""Turn our `Plan` into a standard TorchRec `ShardingPlan`.

A table whose hottest rows are replicated becomes two tables, `<name>_hot` (data parallel)
and `<name>_cold` (sharded), so that no row-wise shard is ever uneven (TorchRec routes
training ids by ceil(rows / world)); the data path remaps ids into them. Row parts (of a
cold part, or of a table too large for one device) are tables `<name>_cold<j>`, each
table-wise on its rank. UVM-cached shards carry the cache size the plan sized. The plan is for an
EmbeddingBagCollection built from `split_table_configs`, on the meta device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import CacheParams, ShardingPlan

from sharding.placer import MAX_CACHE_SHARE
from sharding.row_parts import cold_part_rows, cold_suffixes
from sharding.types import Plan, TablePlan, Tier

MODULE = "model.sparse_arch.embedding_bag_collection"
SEQUENCE_MODULE = "model.sparse_arch.embedding_collection"  # cold parts exchanged alone
_KERNEL = {Tier.hbm: "fused", Tier.cached: "fused_uvm_caching", Tier.host: "fused_uvm"}


def split_table_configs(plan: Plan, feature_of: dict[str, str]) -> list[EmbeddingBagConfig]:
    """The tables of the split model; both parts of a split table serve the same feature."""
    configs = []
    for t in plan.tables:
        parts = _parts(t)
        for name, rows in parts:
            configs.append(
                EmbeddingBagConfig(
                    name=name,
                    embedding_dim=t.dim,
                    num_embeddings=rows,
                    feature_names=[feature_of[t.name]],
                )
            )
    return configs


def _parts(t: TablePlan) -> list[tuple[str, int]]:
    """The table, or its hot part then its cold part(s) in row-part order, or (no hot part)
    its row parts only."""
    h = t.replicated_rows
    if h == t.rows or (h == 0 and t.cold_parts <= 1):
        return [(t.name, t.rows)]
    cold = cold_part_rows(t.rows - h, t.cold_parts)
    names = [t.name + suffix for suffix in cold_suffixes(t.cold_parts)]
    return ([(f"{t.name}_hot", h)] if h else []) + list(zip(names, cold, strict=True))


def parameter_shardings(
    plan: Plan, device_type: str
) -> tuple[dict[str, Any], dict[str, float], dict[str, str]]:
    """Per table (each part of a split one): its TorchRec parameter sharding; the cache load
    factor of UVM-cached tables; the kernel of table-row-wise ones."""
    per_param = {}
    caches: dict[str, float] = {}  # UVM-cached tables: their cache load factor
    row_kernels: dict[str, str] = {}  # table-row-wise tables: their kernel

    def kernel(tier: Tier, name: str, cache_share: float) -> str:
        if device_type == "cpu":
            return "fused"
        if tier == Tier.cached:
            caches[name] = min(MAX_CACHE_SHARE, max(0.01, cache_share))
        return _KERNEL[tier]

    for t in plan.tables:
        cold = [s for s in t.shards if not s.dp]
        for name, _ in _parts(t):
            if name.endswith("_hot") or not cold:
                per_param[name] = data_parallel()
            elif t.cold_parts > 1:  # row part j: its own table on its shard's rank
                s = cold[int(name.rsplit("_cold", 1)[1])]
                k = kernel(s.tier, name, s.cache_rows / s.rows)
                per_param[name] = table_wise(rank=s.rank, compute_kernel=k)
            elif cold[0].node_reduce:  # table-row-wise over the node its ranks make up
                row_kernels[name] = kernel(t.tier, name, 1.0)
                per_param[name] = table_row_wise(host_index=cold[0].rank // len(cold))
            elif len(cold) == 1:
                s = cold[0]
                k = kernel(s.tier, name, s.cache_rows / s.rows)
                per_param[name] = table_wise(rank=s.rank, compute_kernel=k)
            else:  # column pieces share one kernel: the slowest tier any of them is in,
                # and the smallest cache (a piece whole in HBM counts as cached whole)
                share = min(s.cache_rows / s.rows if s.tier == Tier.cached else 1.0 for s in cold)
                k = kernel(t.tier, name, share)
                per_param[name] = column_wise(
                    ranks=[s.rank for s in cold],
                    size_per_rank=[s.cols for s in cold],
                    compute_kernel=k,
                )
    return per_param, caches, row_kernels


def sequence_cold(plan: Plan) -> frozenset[str]:
    """The tables whose cold part exchanges only its own lookups (`Shard.sparse_exchange`):
    an EmbeddingCollection's sequence tables in the model (`recsys.models.split`)."""
    return frozenset(t.name for t in plan.tables if any(s.sparse_exchange for s in t.shards))


def to_torchrec_plan(
    plan: Plan, feature_of: dict[str, str], device_type: str, sequences: frozenset | None = None
) -> ShardingPlan:
    """The cold parts of the tables in `sequences` (default: the plan's own, `sequence_cold`)
    live in an EmbeddingCollection, planned as a second module; they must be table-wise."""
    configs = split_table_configs(plan, feature_of)
    sequences = sequence_cold(plan) if sequences is None else sequences
    cold_names = {name for t in plan.tables if t.name in sequences for name, _ in _parts(t)[1:]}
    meta = torch.device("meta")
    ebc = EmbeddingBagCollection([c for c in configs if c.name not in cold_names], device=meta)
    per_param, caches, row_kernels = parameter_shardings(plan, device_type)
    world = len(plan.batch_per_rank)
    nodes = [d["node"] for d in plan.devices] or [0] * world  # ranks per node: TWRW's hosts
    local = max(nodes.count(n) for n in set(nodes))
    bag_params = {n: g for n, g in per_param.items() if n not in cold_names}
    sizes = {"local_size": local, "world_size": world, "device_type": device_type}
    plans = {MODULE: module_plan(ebc, bag_params, caches, row_kernels, **sizes)}
    if cold_names:
        ec = EmbeddingCollection(
            [
                EmbeddingConfig(
                    name=c.name,
                    embedding_dim=c.embedding_dim,
                    num_embeddings=c.num_embeddings,
                    feature_names=c.feature_names,
                )
                for c in configs
                if c.name in cold_names
            ],
            device=meta,
        )
        plans[SEQUENCE_MODULE] = module_plan(
            ec,
            {c.name: per_param[c.name] for c in configs if c.name in cold_names},
            caches,
            row_kernels,
            sharder=EmbeddingCollectionSharder(),
            **sizes,
        )
    return ShardingPlan(plans)


def module_plan(
    module: Any,
    per_param: dict[str, Any],
    caches: dict[str, float],
    row_kernels: dict[str, str],
    *,
    local_size: int,
    world_size: int,
    device_type: str,
    sharder: Any = None,
) -> Any:
    """TorchRec's plan of one embedding module from `parameter_shardings`' parts: the cache
    the plan sized (not TorchRec's default) and table-row-wise tables' kernels set."""
    made = construct_module_sharding_plan(
        module,
        per_param,
        local_size=local_size,
        world_size=world_size,
        device_type=device_type,
        **({"sharder": sharder} if sharder is not None else {}),
    )
    for name, ps in made.items():
        if name in caches:
            ps.cache_params = CacheParams(load_factor=caches[name])
        if name in row_kernels:
            ps.compute_kernel = row_kernels[name]
    return made


# CUDA-only kernels and what a CPU rank runs instead: the table in the rank's own memory
_CPU_KERNEL = {"fused_uvm": "fused", "fused_uvm_caching": "fused"}


def for_cpu_ranks(plan: ShardingPlan) -> ShardingPlan:
    """A GPU plan as CPU ranks run it (`trainer.rehearse_on_cpu`): the same modules, sharding
    types, ranks and shard shapes; each CUDA kernel replaced by its CPU counterpart (UVM
    and UVM-cached tables become fused tables in the rank's memory, without a cache) and
    every shard placed on the rank's CPU."""
    plans = {}
    for module, module_plan in plan.plan.items():
        converted = {}
        for name, ps in module_plan.items():
            spec = ps.sharding_spec
            if spec is not None:
                spec = EnumerableShardingSpec(
                    [
                        ShardMetadata(
                            m.shard_offsets, m.shard_sizes, f"rank:{m.placement.rank()}/cpu"
                        )
                        for m in spec.shards
                    ]
                )
            converted[name] = dataclasses.replace(
                ps,
                compute_kernel=_CPU_KERNEL.get(ps.compute_kernel, ps.compute_kernel),
                sharding_spec=spec,
                cache_params=None,
                enforce_hbm=None,
            )
        plans[module] = type(module_plan)(converted)
    return ShardingPlan(plans)
