"""The nested pipeline's sharded-embedding side, stage by stage, for one batch at a time.

Stages 1-4 of `pipelines.nested`: the clustering order (`clustering.py`), the copy to the
device, key routing (TorchRec's own input all-to-all, in its two collectives; with dedup
and its gradients, each micro-batch's distinct ids only, `dedup.py`), the local lookups
with their graph kept, and the dual-buffer refresh of the bags whose rows the previous
batch's update changed.
Then, after the micro-batches, the lookups' backward: the TBE's fused update, once per
batch on the whole batch's gradient.

Supported: pooled `EmbeddingBagCollection`s sharded table-wise, column-wise,
table-column-wise, row-wise, table-row-wise or data-parallel, and sequence
`EmbeddingCollection`s sharded table-wise (hybrid's cold parts: every id's row moves,
`exchange.ChunkedSequenceExchange`). Other sharded modules raise at construction, naming the
module and the sharding type.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.embedding import EmbeddingCollectionContext, ShardedEmbeddingCollection
from torchrec.distributed.embedding_types import ShardingType
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    ShardedEmbeddingBagCollection,
    construct_output_kt,
)
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingDist
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingDist
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.clustering import cluster_order
from pipelines.dedup import BatchLookups, DedupBatch, DedupExchange, route_distinct
from pipelines.dense_step import alignment, compute_dtype
from pipelines.exchange import (
    ChunkedPooledExchange,
    ChunkedReduceScatter,
    ChunkedSequenceExchange,
    ChunkPlan,
    Pending,
    SequenceBatch,
)

_EXCHANGED = {
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
}


@dataclass
class _Group:
    """One sharding-type group of a sharded EBC: its lookup and how its output moves."""

    sharding_type: str
    lookup: torch.nn.Module
    # None: data-parallel, no exchange
    exchange: ChunkedPooledExchange | ChunkedReduceScatter | ChunkedSequenceExchange | None
    dedup: DedupExchange | None = None  # set: unique rows move instead of pooled bags
    # what TorchRec's output dist applies to what it receives (column-wise tables sharing
    # ranks: a column permutation); per sample, so applied to each chunk as it arrives
    callbacks: list = field(default_factory=list)

    def __post_init__(self) -> None:
        # for the lookahead's refresh of exchanged groups (data-parallel lookups are DDP-
        # wrapped and never refreshed): each feature's table and its output columns
        self.tables: dict[str, str] = {}
        self.columns: dict[str, tuple[int, int]] = {}
        col = 0
        for emb in self.lookup._emb_modules if self.exchange is not None else []:
            for table in emb.config.embedding_tables:
                for f in table.feature_names:
                    self.tables[f] = table.name
            for f, d in zip(emb.config.feature_names(), emb.config.embedding_dims(), strict=True):
                self.columns[f] = (col, col + d)
                col += d

    @property
    def sequence(self) -> bool:
        return isinstance(self.exchange, ChunkedSequenceExchange)

    def received(self, chunk: torch.Tensor) -> torch.Tensor:
        """A received chunk in the module's output column order."""
        for callback in self.callbacks:
            chunk = callback(chunk)
        return chunk

    def send(self, values: torch.Tensor, plan: ChunkPlan, state, k: int) -> Pending:
        if self.dedup is not None:  # forward-only dedup: the distinct rows' own lookup
            rows = values if self.dedup.grads else state.rows
            return self.dedup.forward(rows, state, k, plan.sizes[self.dedup.rank][k])
        if self.sequence:
            return self.exchange.forward(values, plan, k, state)
        return self.exchange.forward(values, plan, k)

    def send_back(
        self, grad: torch.Tensor, plan: ChunkPlan, state, k: int, out: torch.Tensor
    ) -> Pending:
        if self.dedup is not None and self.dedup.grads:
            return self.dedup.backward(grad, state, k, out)
        if self.sequence:
            return self.exchange.backward(grad, plan, k, out, state)
        return self.exchange.backward(grad, plan, k, out)


@dataclass
class _Module:
    fqn: str
    module: ShardedEmbeddingBagCollection | ShardedEmbeddingCollection
    groups: list[_Group]

    @property
    def sequence(self) -> bool:
        return isinstance(self.module, ShardedEmbeddingCollection)

    def output(self, parts: list[torch.Tensor], states: list, k: int):
        """What the module's forward returns for micro-batch k, from each group's part of
        it: a KeyedTensor of pooled bags, or a sequence module's JaggedTensor per feature."""
        if self.sequence:
            out = {}
            for group, part, state in zip(self.groups, parts, states, strict=True):
                out.update(group.exchange.jagged(part, state, k))
            return out
        outs = [group.received(t) for group, t in zip(self.groups, parts, strict=True)]
        return construct_output_kt(outs, self.module._embedding_names, self.module._embedding_dims)


@dataclass
class _ModuleStep:
    """One sharded module's state for one batch."""

    ctx: EmbeddingBagCollectionContext | EmbeddingCollectionContext
    pending: Any  # the input dist's awaitable until it is waited for
    ids_sent: bool = False  # its second stage (the ids themselves) is in flight
    features: list[KeyedJaggedTensor] | None = None  # per group, after the input dist
    looked_up: list[torch.Tensor | None] = field(default_factory=list)  # graph, per group
    inputs: list[KeyedJaggedTensor | None] = field(default_factory=list)  # what was looked up
    # per group, the exchange's state for this batch: with dedup its distinct rows; of a
    # sequence group its bag lengths
    states: list[DedupBatch | SequenceBatch | None] = field(default_factory=list)


@dataclass
class Step:
    batch: Batch
    order: torch.Tensor | None  # this rank's clustering order (None: data order)
    modules: list[_ModuleStep]
    orders: Any = None  # every rank's order: in flight, then a list
    grads: list[list[torch.Tensor]] | None = None  # per module and group, whole batch
    plans: list[ChunkPlan] | None = None  # per module: every rank's micro-batches
    sends: list | None = None  # [module][chunk][group]: the embedding chunks, once launched


def _group_exchange(module: torch.nn.Module, g: int, fqn: str):
    """The chunked exchange of the module's group g (None: data-parallel, no exchange)."""
    d = module._output_dists[g]
    if isinstance(module, ShardedEmbeddingCollection):
        return _sequence_exchange(module, g, fqn)
    sharding_type = module._sharding_types[g]
    if isinstance(d, DpPooledEmbeddingDist):
        return None
    twrw, rw = ShardingType.TABLE_ROW_WISE.value, ShardingType.ROW_WISE.value
    if isinstance(d, TwRwPooledEmbeddingDist) and sharding_type == twrw:
        quantized = d._intra_codecs or d._cross_codecs
        exchange = ChunkedReduceScatter(d._intra_pg, d._dim_sum_per_node, d._cross_pg)
    elif isinstance(d, RwPooledEmbeddingDist) and sharding_type == rw:
        quantized, exchange = d._codecs, ChunkedReduceScatter(d._pg, [sum(d._embedding_dims)])
    elif isinstance(d, TwPooledEmbeddingDist) and sharding_type in _EXCHANGED:
        quantized, exchange = d._codecs, ChunkedPooledExchange(d._pg, d._dim_sum_per_rank)
    else:
        raise NotImplementedError(
            f"pipeline=nested: '{fqn}' is sharded {sharding_type}; the nested pipeline handles "
            f"table_wise, column_wise, table_column_wise, row_wise, table_row_wise and "
            f"data_parallel pooled tables. Use TorchRec's "
            f"TrainPipelineSparseDist (pipeline=sparse_dist), or a plan without "
            f"{sharding_type} tables"
        )
    if quantized:
        raise NotImplementedError(
            f"pipeline=nested: '{fqn}' ({sharding_type}) uses quantized comms, which the "
            f"chunked exchange does not replicate; use pipeline=sparse_dist for this plan"
        )
    return exchange


def _sequence_exchange(module: ShardedEmbeddingCollection, g: int, fqn: str):
    sharding_type, sharding = list(module._sharding_type_to_sharding.items())[g]
    d = module._output_dists[g]
    if not (
        isinstance(d, TwSequenceEmbeddingDist) and sharding_type == ShardingType.TABLE_WISE.value
    ):
        raise NotImplementedError(
            f"pipeline=nested: '{fqn}' is a sequence EmbeddingCollection sharded "
            f"{sharding_type}; the nested pipeline exchanges table-wise sequence tables (what "
            f"hybrid's cold parts are). Use TorchRec's "
            f"TrainPipelineSparseDist (pipeline=sparse_dist), or set "
            f"planner.cold_only_exchange=false (pooled cold parts)"
        )
    if d._dist._codecs:
        raise NotImplementedError(
            f"pipeline=nested: '{fqn}' uses quantized comms, which the chunked exchange does "
            f"not replicate; use pipeline=sparse_dist for this plan"
        )
    per_rank = [len(f) for f in sharding.feature_names_per_rank()]
    return ChunkedSequenceExchange(
        d._dist._pg, per_rank, module._embedding_dim, module._embedding_names_per_sharding[g]
    )


def _dedup_exchange(group: _Group, sharding, fqn: str, stats: dict, grads: bool) -> DedupExchange:
    """The unique-row exchange of a sum-pooled table-wise / column-wise group."""
    if not isinstance(group.exchange, ChunkedPooledExchange):
        raise NotImplementedError(
            f"pipeline.dedup: '{fqn}' is sharded {group.sharding_type}, whose owners send "
            f"partial sums of every bag, not rows; dedup moves the unique rows of table-wise "
            f"and column-wise tables only. Use pipeline.dedup=false for this plan"
        )
    pooling = {t.pooling for t in sharding.embedding_tables()}
    if pooling != {PoolingType.SUM}:
        raise NotImplementedError(
            f"pipeline.dedup: '{fqn}' ({group.sharding_type}) pools by "
            f"{sorted(p.name for p in pooling)}; unique rows are pooled by sum only. Use "
            f"pipeline.dedup=false"
        )
    return DedupExchange(
        group.exchange.pg,
        sharding.feature_names_per_rank(),
        sharding._emb_dim_per_rank_per_feature(),
        group.columns,
        fqn,
        stats,
        grads,
    )


class Lookups:
    """The sharded embedding modules' side of the nested pipeline, for one batch at a time:
    stages 1-4 (clustering order, copy, key routing, the local lookups, the dual-buffer
    refresh) and the lookups' backward (the fused update, once per batch)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        micro_batches: int,
        cluster: bool,
        dedup: bool,
        stats: dict,
        dedup_grads: bool = True,
    ) -> None:
        self._device = device
        self._n = micro_batches
        self._cluster = cluster
        self._world = dist.get_world_size()
        self.stats = stats
        self._align = 1  # samples; set from the dense features' dtype
        self._train = model
        self.modules = self._find_modules(model, dedup, dedup_grads)

    def _find_modules(
        self, model: torch.nn.Module, dedup: bool, dedup_grads: bool
    ) -> list[_Module]:
        found = []
        for fqn, m in model.named_modules():
            if not isinstance(m, ShardedModule):
                continue
            if not isinstance(m, ShardedEmbeddingBagCollection | ShardedEmbeddingCollection):
                raise NotImplementedError(
                    f"pipeline=nested handles sharded EmbeddingBagCollections and "
                    f"EmbeddingCollections; '{fqn}' is a {type(m).__name__}. Use "
                    f"pipeline=sparse_dist"
                )
            if isinstance(m, ShardedEmbeddingCollection):
                shardings = list(m._sharding_type_to_sharding.items())
            else:
                shardings = list(zip(m._sharding_types, m._embedding_shardings, strict=True))
            groups = [
                _Group(
                    st,
                    lookup,
                    _group_exchange(m, g, fqn),
                    callbacks=list(getattr(od, "_callbacks", None) or []),
                )
                for g, ((st, _), lookup, od) in enumerate(
                    zip(shardings, m._lookups, m._output_dists, strict=True)
                )
            ]
            for group, (_, sharding) in zip(groups, shardings, strict=True):
                # sequence groups already send each lookup's own row
                if dedup and group.exchange is not None and not group.sequence:
                    group.dedup = _dedup_exchange(group, sharding, fqn, self.stats, dedup_grads)
            found.append(_Module(fqn, m, groups))
        if not found:
            raise ValueError("pipeline=nested: the model has no sharded embedding modules")
        return found

    # stages 1-3: fetch, cluster, copy, start the id all-to-all
    def start(self, batch: Batch) -> Step:
        order = None
        if self._cluster and self._n > 1:  # the batch stays in data order: only the
            # micro-batches take its samples in this order (the update sums as plain does)
            order = cluster_order(batch.sparse_features, self._n).to(self._device)
        batch = batch.to(self._device, non_blocking=True)
        inputs = batch.dense_features.dtype  # and what the dense part computes in, if finer
        self._align = max(alignment(inputs), alignment(compute_dtype(self._train, inputs)))
        steps = []
        for m in self.modules:
            ctx = EmbeddingCollectionContext() if m.sequence else EmbeddingBagCollectionContext()
            kjt, states = self._route_distinct(m, batch, order)
            steps.append(_ModuleStep(ctx, m.module.input_dist(ctx, kjt), states=states))
        return Step(batch, order, steps)

    def _route_distinct(self, m: _Module, batch: Batch, order: torch.Tensor | None):
        """With dedup: each micro-batch's distinct rows per owner (and how its bags pool
        from them), and the ids to route: each micro-batch's distinct ids only (every id
        where the gradients go back pooled: the owner's update needs them all)."""
        states: list[DedupBatch | None] = [None] * len(m.groups)
        kjt = batch.sparse_features
        if not any(g.dedup is not None for g in m.groups):
            return kjt, states
        own = ChunkPlan(
            [len(batch.labels)], self._n, None if order is None else [order], self._align
        )
        lookups = BatchLookups(kjt, [own.samples(0, k) for k in range(self._n)])
        finish = []
        for g, group in enumerate(m.groups):
            if group.dedup is not None:
                states[g] = DedupBatch()
                finish.append(group.dedup.requester_input(lookups, states[g]))
        host = lookups.read()  # the requester side's one host read this step
        distinct: dict[str, list[torch.Tensor]] = {}
        deduped = [g for g, state in enumerate(states) if state is not None]
        for g, done in zip(deduped, finish, strict=True):
            done(host)
            if m.groups[g].dedup.grads:
                distinct.update(m.groups[g].dedup.distinct(states[g]))
        if not distinct:
            return kjt, states
        first, lengths = lookups.first_samples(host), lookups.feature_lengths(host)
        return route_distinct(kjt, distinct, first, lengths), states

    @staticmethod
    def send_ids(step: Step) -> None:
        """The id all-to-all is two collectives: lengths, then ids. Waiting for the first
        starts the second."""
        for ms in step.modules:
            if ms.features is None and not ms.ids_sent:
                ms.pending, ms.ids_sent = ms.pending.wait(), True

    def wait_ids(self, step: Step) -> None:
        start = time.perf_counter()
        self.send_ids(step)
        for ms in step.modules:
            if ms.features is None:
                ms.features = list(ms.pending.wait())
                ms.pending = None
        self.stats["wait_ms"]["ids"] += 1000 * (time.perf_counter() - start)

    def _share_orders(self, step: Step) -> None:
        """Owners cut every rank's micro-batches out of their lookups, so every rank's
        clustering order goes to all (one all-gather, padded to the largest batch)."""
        if step.order is None or step.orders is not None:
            return
        sizes = _batch_per_rank(step.modules[0].ctx, len(step.order), self._world)
        padded = step.order.new_full((max(sizes),), -1)
        padded[: len(step.order)] = step.order
        gathered = [torch.empty_like(padded) for _ in sizes]
        work = dist.all_gather(gathered, padded, async_op=True)
        step.orders = (work, gathered, sizes)

    def _orders(self, step: Step) -> list[torch.Tensor] | None:
        if step.order is None:
            return None
        if isinstance(step.orders, tuple):
            work, gathered, sizes = step.orders
            work.wait()
            step.orders = [o[:n] for o, n in zip(gathered, sizes, strict=True)]
        return step.orders

    def plans(self, step: Step) -> list[ChunkPlan]:
        """Per module: which samples of every rank's batch each micro-batch takes."""
        if step.plans is None:
            size, orders = step.batch.dense_features.shape[0], self._orders(step)
            step.plans = [
                ChunkPlan(_batch_per_rank(ms.ctx, size, self._world), self._n, orders, self._align)
                for ms in step.modules
            ]
        return step.plans

    # stage 4: the local lookups (graph kept: their backward is the fused update)
    def look_up(self, step: Step, exchanged: bool) -> None:
        self.wait_ids(step)
        self._share_orders(step)
        for mi, (m, ms) in enumerate(zip(self.modules, step.modules, strict=True)):
            if not ms.looked_up:
                ms.looked_up = [None] * len(m.groups)
                ms.inputs = list(ms.features)
                for g, group in enumerate(m.groups):
                    if group.sequence:  # what each owner holds and what this rank asked
                        asked = ms.ctx.sharding_contexts[g].features_before_input_dist
                        ms.states[g] = SequenceBatch(ms.features[g].lengths(), asked.lengths())
            for g, group in enumerate(m.groups):
                if (group.exchange is not None) == exchanged and ms.looked_up[g] is None:
                    if group.dedup is not None:  # single-id bags of each block's rows
                        plan, state = self.plans(step)[mi], ms.states[g]
                        unique = group.dedup.owner_input(ms.features[g], plan, state)
                        if group.dedup.grads:
                            ms.inputs[g] = unique
                        else:  # what the chunks send; the full lookup below keeps the graph
                            state.unique = unique
                            with torch.no_grad():
                                state.rows = group.lookup(unique)
                    ms.looked_up[g] = group.lookup(ms.inputs[g])
                    if group.sequence:  # one row per id, as TorchRec's compute shapes it
                        ms.looked_up[g] = ms.looked_up[g].view(-1, group.exchange.dim)

    def refresh(self, step: Step, updated: Step) -> None:
        """Look up again the bags of `step` that hold a row `updated`'s batch just changed."""
        for m, ms, us in zip(self.modules, step.modules, updated.modules, strict=True):
            for g, group in enumerate(m.groups):
                if group.exchange is None:
                    continue
                if group.dedup is not None and not group.dedup.grads:  # what is sent: the
                    # distinct rows (the full lookup's values are never read, its graph is)
                    state = ms.states[g]
                    self._refresh_group(group, state.unique, us.features[g], state.rows)
                    continue
                self._refresh_group(group, ms.inputs[g], us.features[g], ms.looked_up[g])

    def _refresh_group(
        self, group: _Group, kjt: KeyedJaggedTensor, touched: KeyedJaggedTensor, out: torch.Tensor
    ) -> None:
        """Bags of `kjt` holding a row that `touched` (the batch just updated) looked up are
        looked up again through the group's own kernel; their values in `out` are replaced."""
        if not kjt.keys():  # this rank holds none of the group's tables
            return
        tables = group.tables
        by_table: dict[str, list[torch.Tensor]] = {}
        for key in touched.keys():  # a table's touched rows: from every feature reading it
            by_table.setdefault(tables[key], []).append(touched[key].values())
        rows = {t: torch.unique(torch.cat(ids)) for t, ids in by_table.items()}
        if group.sequence:
            self._refresh_rows(group, kjt, rows, out)
            return
        stale = torch.cat([_bags_holding(kjt[key], rows[tables[key]]) for key in kjt.keys()])
        lengths = kjt.lengths()
        self.stats["bags"] += lengths.numel()
        n_stale = int(stale.sum())
        if n_stale == 0:
            return
        self.stats["refreshed_bags"] += n_stale
        again = KeyedJaggedTensor(
            keys=kjt.keys(),
            values=kjt.values()[torch.repeat_interleave(stale, lengths)],
            lengths=torch.where(stale, lengths, 0),
            stride=kjt.stride(),
        )
        with torch.no_grad():
            fresh = group.lookup(again)
        values = out.detach()  # the same storage the exchange reads from
        for key, stale_f in zip(kjt.keys(), stale.split(kjt.stride()), strict=True):
            samples = stale_f.nonzero().squeeze(1)
            c0, c1 = group.columns[key]
            values[samples, c0:c1] = fresh[samples, c0:c1]

    def _refresh_rows(
        self,
        group: _Group,
        kjt: KeyedJaggedTensor,
        rows: dict[str, torch.Tensor],
        out: torch.Tensor,
    ) -> None:
        """A sequence group's `_refresh_group`: its lookup output holds one row per id (in
        `kjt`'s order), so the ids holding a touched row are looked up again."""
        tables = group.tables
        stale = torch.cat([torch.isin(kjt[key].values(), rows[tables[key]]) for key in kjt.keys()])
        self.stats["bags"] += stale.numel()
        n_stale = int(stale.sum())
        if n_stale == 0:
            return
        self.stats["refreshed_bags"] += n_stale
        lengths = kjt.lengths()
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        again = KeyedJaggedTensor(
            keys=kjt.keys(),
            values=kjt.values()[stale],
            lengths=torch.bincount(bag[stale], minlength=lengths.numel()).to(lengths.dtype),
            stride=kjt.stride(),
        )
        with torch.no_grad():
            fresh = group.lookup(again)
        out.detach()[stale] = fresh.view(-1, out.shape[1])

    def backward(self, step: Step, exchanged: bool) -> None:
        """One backward through the lookups with the whole batch's gradient. Exchanged
        (sharded) tables: the fused TBE kernels apply the optimizer once, as in the plain
        loop. Data-parallel tables: their weights get gradients, averaged with the dense
        ones."""
        outputs, grads = [], []
        for m, ms, gs in zip(self.modules, step.modules, step.grads, strict=True):
            for group, t, g in zip(m.groups, ms.looked_up, gs, strict=True):
                if (group.exchange is not None) == exchanged and t.requires_grad:
                    outputs.append(t)
                    grads.append(g)
        if outputs:
            torch.autograd.backward(outputs, grads)


def _bags_holding(jt, rows: torch.Tensor) -> torch.Tensor:
    """Per bag of `jt`: does it hold any of `rows`?"""
    lengths = jt.lengths()
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    out = torch.zeros(lengths.numel(), dtype=torch.bool, device=lengths.device)
    out[bag[torch.isin(jt.values(), rows)]] = True
    return out


def _batch_per_rank(ctx: EmbeddingBagCollectionContext, local: int, world: int) -> list[int]:
    for sc in ctx.sharding_contexts:
        if sc is not None and sc.batch_size_per_rank:
            return list(sc.batch_size_per_rank)
    return [local] * world
