"""The nested pipeline: inter-batch dual buffer + intra-batch frozen window, staleness-free.

One `progress()` call trains batch i. What runs, in order (the stages of the design):

1. data prefetch of batch i+1, with key-centric sample clustering (`clustering.py`);
2. host-to-device copy of batch i+1;
3. key routing of batch i+1: TorchRec's own input all-to-all, started now, waited for
   only when batch i's micro-batches are done; with `dedup`, only each micro-batch's
   distinct ids are routed (`dedup.py`);
4. embedding retrieval of batch i+1 (the local TBE lookup) into the prefetch buffer: with
   `lookahead`, before batch i's update (on GPUs on a side stream), and after the update
   the bags of batch i+1 that hold a row batch i touched are looked up again (the dual
   buffer refresh), so nothing is stale; without it, right after batch i's update;
5. batch i in N micro-batches under a frozen window: the pooled-embedding all-to-all of
   every chunk is in flight while earlier micro-batches' dense forward and backward run,
   and each micro-batch's gradient all-to-all runs under the next micro-batch's dense
   work. The embedding update happens once, on the whole batch's gradient, through the
   TBE's own fused backward: the result equals the plain loop for any optimizer. With
   `dedup` the chunks carry each micro-batch's distinct rows, pooled by the requester, and
   each row's gradient summed over its bags (equal within rounding: sums reorder).

The arithmetic is the plain loop's, in its order, not just close to it: clustering only
chooses which samples each micro-batch takes (the batch, its lookups and their update stay
in data order), and Linear layers' weight gradients are one product over the whole batch
(`_DeferredWeightGrads`), not a sum of N partial ones. Dense gradients are averaged over
ranks the way DDP does (divide by world, all-reduce sum), once per batch, in flight while
the embedding update runs.

Supported: pooled `EmbeddingBagCollection`s sharded table-wise, column-wise or
data-parallel (what TorchRec offers on CPU, and the usual GPU choices). Other sharded
modules raise at construction, naming the module and the sharding type.

The model contract is TorchRec's `DLRMTrain`: `model(batch) -> (loss, (loss, logits,
labels))`, the loss a mean over the rank's samples, sparse features used only through the
sharded modules. A model whose loss is already a sum over samples (scaled by a constant)
says so with `loss_reduction = "sum"`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.embedding_types import ShardingType
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    ShardedEmbeddingBagCollection,
    construct_output_kt,
)
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingDist
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist
from torchrec.distributed.train_pipeline import TrainPipeline
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.clustering import cluster_order
from pipelines.dedup import DedupBatch, DedupExchange, route_distinct
from pipelines.dense_step import (
    DeferredGrads,
    alignment,
    batch_loss_fn,
    loss_seed,
    reduce_per_tensor,
)
from pipelines.exchange import ChunkedPooledExchange, ChunkPlan, Pending

_EXCHANGED = {ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value,
              ShardingType.TABLE_COLUMN_WISE.value}  # fmt: skip


@dataclass
class _Group:
    """One sharding-type group of a sharded EBC: its lookup and how its output moves."""

    sharding_type: str
    lookup: torch.nn.Module
    exchange: ChunkedPooledExchange | None  # None: data-parallel, no exchange
    dedup: DedupExchange | None = None  # set: unique rows move instead of pooled bags

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

    def send(self, values: torch.Tensor, plan: ChunkPlan, state, k: int) -> Pending:
        if self.dedup is not None:
            return self.dedup.forward(values, state, k, plan.sizes[self.dedup.rank][k])
        return self.exchange.forward(values, plan, k)

    def send_back(self, grad: torch.Tensor, plan: ChunkPlan, state, k: int,
                  out: torch.Tensor) -> Pending:  # fmt: skip
        if self.dedup is not None:
            return self.dedup.backward(grad, state, k, out)
        return self.exchange.backward(grad, plan, k, out)


@dataclass
class _Module:
    fqn: str
    module: ShardedEmbeddingBagCollection
    groups: list[_Group]


@dataclass
class _ModuleStep:
    """One sharded module's state for one batch."""

    ctx: EmbeddingBagCollectionContext
    pending: Any  # the input dist's awaitable until it is waited for
    ids_sent: bool = False  # its second stage (the ids themselves) is in flight
    features: list[KeyedJaggedTensor] | None = None  # per group, after the input dist
    looked_up: list[torch.Tensor | None] = field(default_factory=list)  # graph, per group
    inputs: list[KeyedJaggedTensor | None] = field(default_factory=list)  # what was looked up
    dedup: list[DedupBatch | None] = field(default_factory=list)  # per group, with dedup


@dataclass
class _Step:
    batch: Batch
    order: torch.Tensor | None  # this rank's clustering order (None: data order)
    modules: list[_ModuleStep]
    orders: Any = None  # every rank's order: in flight, then a list
    grads: list[list[torch.Tensor]] | None = None  # per module and group, whole batch
    plans: list[ChunkPlan] | None = None  # per module: every rank's micro-batches


def _group_exchange(dist_module: torch.nn.Module, fqn: str, sharding_type: str):
    if isinstance(dist_module, DpPooledEmbeddingDist):
        return None
    if isinstance(dist_module, TwPooledEmbeddingDist) and sharding_type in _EXCHANGED:
        if dist_module._callbacks or dist_module._codecs is not None:
            raise NotImplementedError(
                f"pipeline=nested: '{fqn}' ({sharding_type}) uses output callbacks or "
                f"quantized comms, which the chunked exchange does not replicate; use "
                f"pipeline=sparse_dist for this plan"
            )
        return ChunkedPooledExchange(dist_module._pg, dist_module._dim_sum_per_rank)
    raise NotImplementedError(
        f"pipeline=nested: '{fqn}' is sharded {sharding_type}; the nested pipeline handles "
        f"table_wise, column_wise, table_column_wise and data_parallel pooled tables. Use "
        f"pipeline=sparse_dist, or a plan without {sharding_type} tables"
    )


class NestedPipeline(TrainPipeline[Any, Any]):
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        micro_batches: int = 4,
        cluster: bool = False,
        lookahead: bool = False,
        dedup: bool = False,
        per_tensor_reduce: bool = False,
    ) -> None:
        super().__init__()
        if micro_batches < 1:
            raise ValueError(f"pipeline.micro_batches must be >= 1, got {micro_batches}")
        self._dmp = model
        self._model = getattr(model, "module", model)  # DMP: the module without DDP
        self._optimizer = optimizer
        self._device = device
        self._n = micro_batches
        self._cluster = cluster
        self._lookahead = lookahead
        self._world = dist.get_world_size()
        # lookahead: bags looked up again / seen; dedup: rows sent / the pooled vectors
        # they replace (as owner)
        self.stats = {"refreshed_bags": 0, "bags": 0, "dedup_rows": 0, "dedup_bags": 0}
        self._modules = self._find_modules(dedup)  # after stats: dedup exchanges count there
        # everything not updated inside the TBE backward: dense layers, data-parallel tables
        # the dense layers: their gradients once per batch, averaged over ranks here as the
        # model's DDP does (data-parallel tables: inside their lookups' own DDP)
        tables = {id(p) for m in self._modules for p in m.module.parameters()}
        dense = {n: p for n, p in in_backward_optimizer_filter(self._model.named_parameters())
                 if id(p) not in tables}  # fmt: skip
        self._dense = list(dense.values())
        self._deferred = DeferredGrads(dense)
        self._per_tensor = per_tensor_reduce
        self._loss_fn = batch_loss_fn(self._model)
        self._align = 1  # samples; set from the dense features' dtype
        self._next: _Step | None = None
        self._stream = torch.cuda.Stream() if device.type == "cuda" else None

    def _find_modules(self, dedup: bool) -> list[_Module]:
        found = []
        for fqn, m in self._model.named_modules():
            if not isinstance(m, ShardedModule):
                continue
            if not isinstance(m, ShardedEmbeddingBagCollection):
                raise NotImplementedError(
                    f"pipeline=nested handles sharded EmbeddingBagCollections; '{fqn}' is a "
                    f"{type(m).__name__}. For hybrid plans set planner.cold_only_exchange="
                    f"false (pooled cold parts), or use pipeline=sparse_dist"
                )
            groups = [
                _Group(st, lookup, _group_exchange(od, fqn, st))
                for st, lookup, od in zip(
                    m._sharding_types, m._lookups, m._output_dists, strict=True
                )
            ]
            for group, sharding in zip(groups, m._embedding_shardings, strict=True):
                if dedup and group.exchange is not None:
                    group.dedup = _dedup_exchange(group, sharding, fqn, self.stats)
            found.append(_Module(fqn, m, groups))
        if not found:
            raise ValueError("pipeline=nested: the model has no sharded embedding modules")
        return found

    # stages 1-3: fetch, cluster, copy, start the id all-to-all
    def _start(self, batch: Batch) -> _Step:
        order = None
        if self._cluster and self._n > 1:  # the batch stays in data order: only the
            # micro-batches take its samples in this order (the update sums as plain does)
            order = cluster_order(batch.sparse_features, self._n).to(self._device)
        batch = batch.to(self._device, non_blocking=True)
        self._align = alignment(batch.dense_features.dtype)
        steps = []
        for m in self._modules:
            ctx = EmbeddingBagCollectionContext()
            kjt, states = self._route_distinct(m, batch, order)
            steps.append(_ModuleStep(ctx, m.module.input_dist(ctx, kjt), dedup=states))
        return _Step(batch, order, steps)

    def _route_distinct(self, m: _Module, batch: Batch, order: torch.Tensor | None):
        """With dedup: each micro-batch's distinct rows per owner (and how its bags pool
        from them), and the ids to route: each micro-batch's distinct ids only."""
        states: list[DedupBatch | None] = [None] * len(m.groups)
        kjt = batch.sparse_features
        if not any(g.dedup is not None for g in m.groups):
            return kjt, states
        own = ChunkPlan([len(batch.labels)], self._n, None if order is None else [order],
                        self._align)  # fmt: skip
        samples = [own.samples(0, k) for k in range(self._n)]
        distinct: dict[str, list[torch.Tensor]] = {}
        for g, group in enumerate(m.groups):
            if group.dedup is not None:
                states[g] = DedupBatch()
                group.dedup.requester_input(kjt, samples, states[g])
                distinct.update(group.dedup.distinct(states[g]))
        return route_distinct(kjt, distinct, samples), states

    @staticmethod
    def _send_ids(step: _Step) -> None:
        """The id all-to-all is two collectives: lengths, then ids. Waiting for the first
        starts the second."""
        for ms in step.modules:
            if ms.features is None and not ms.ids_sent:
                ms.pending, ms.ids_sent = ms.pending.wait(), True

    def _wait_ids(self, step: _Step) -> None:
        self._send_ids(step)
        for ms in step.modules:
            if ms.features is None:
                ms.features = list(ms.pending.wait())
                ms.pending = None

    def _share_orders(self, step: _Step) -> None:
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

    def _orders(self, step: _Step) -> list[torch.Tensor] | None:
        if step.order is None:
            return None
        if isinstance(step.orders, tuple):
            work, gathered, sizes = step.orders
            work.wait()
            step.orders = [o[:n] for o, n in zip(gathered, sizes, strict=True)]
        return step.orders

    def _plans(self, step: _Step) -> list[ChunkPlan]:
        """Per module: which samples of every rank's batch each micro-batch takes."""
        if step.plans is None:
            size, orders = step.batch.dense_features.shape[0], self._orders(step)
            step.plans = [ChunkPlan(_batch_per_rank(ms.ctx, size, self._world), self._n, orders,
                                    self._align) for ms in step.modules]  # fmt: skip
        return step.plans

    # stage 4: the local lookups (graph kept: their backward is the fused update)
    def _look_up(self, step: _Step, exchanged: bool) -> None:
        self._wait_ids(step)
        self._share_orders(step)
        for mi, (m, ms) in enumerate(zip(self._modules, step.modules, strict=True)):
            if not ms.looked_up:
                ms.looked_up = [None] * len(m.groups)
                ms.inputs = list(ms.features)
            for g, group in enumerate(m.groups):
                if (group.exchange is not None) == exchanged and ms.looked_up[g] is None:
                    if group.dedup is not None:  # single-id bags of each block's rows
                        plan = self._plans(step)[mi]
                        ms.inputs[g] = group.dedup.owner_input(ms.features[g], plan, ms.dedup[g])
                    ms.looked_up[g] = group.lookup(ms.inputs[g])

    def _refresh(self, step: _Step, updated: _Step) -> None:
        """Look up again the bags of `step` that hold a row `updated`'s batch just changed."""
        for m, ms, us in zip(self._modules, step.modules, updated.modules, strict=True):
            for g, group in enumerate(m.groups):
                if group.exchange is None:
                    continue
                self._refresh_group(group, ms.inputs[g], us.features[g], ms.looked_up[g])

    def _refresh_group(self, group: _Group, kjt: KeyedJaggedTensor, touched: KeyedJaggedTensor,
                       out: torch.Tensor) -> None:  # fmt: skip
        """Bags of `kjt` holding a row that `touched` (the batch just updated) looked up are
        looked up again through the group's own kernel; their values in `out` are replaced."""
        if not kjt.keys():  # this rank holds none of the group's tables
            return
        tables = group.tables
        by_table: dict[str, list[torch.Tensor]] = {}
        for key in touched.keys():  # a table's touched rows: from every feature reading it
            by_table.setdefault(tables[key], []).append(touched[key].values())
        rows = {t: torch.unique(torch.cat(ids)) for t, ids in by_table.items()}
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

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        if not self._model.training:
            with torch.no_grad():
                return self._dmp(next(dataloader_iter).to(self._device))[1]
        if self._next is None:  # the first batch: nothing was prefetched
            self._next = self._start(next(dataloader_iter))
            self._look_up(self._next, exchanged=True)
        cur = self._next
        try:
            self._next = self._start(next(dataloader_iter))
        except StopIteration:
            self._next = None
        self._optimizer.zero_grad()
        self._look_up(cur, exchanged=False)  # data-parallel tables: local, no prefetch
        output = self._micro_batches(cur)
        self._backward_lookups(cur, exchanged=False)  # data-parallel tables' gradients
        # dense gradients: averaged over ranks like DDP, in flight during the update
        reduce = self._start_dense_reduce()
        nxt = self._next
        if nxt is not None and self._lookahead:
            with self._side():  # stage 4 for batch i+1, before i's update
                self._look_up(nxt, exchanged=True)
        self._backward_lookups(cur, exchanged=True)  # the fused update, once per batch
        if nxt is not None:
            if self._lookahead:
                self._join_side()
                self._refresh(nxt, cur)  # after both: whatever the lookup read is fixed
            else:
                self._look_up(nxt, exchanged=True)
        if reduce is not None:
            reduce()
        self._optimizer.step()
        return output

    def _side(self):
        """Where the lookahead lookup runs: a side CUDA stream on GPUs (it overlaps the
        update of batch i; the refresh afterwards makes any row it raced with exact),
        the calling thread on CPU."""
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _join_side(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
            for ms in self._next.modules:  # made on the side stream, used on the main one
                for t in ms.looked_up:
                    if t is not None:
                        t.record_stream(torch.cuda.current_stream())

    def _micro_batches(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = step.batch
        size = batch.dense_features.shape[0]
        plans = self._plans(step)
        rank = dist.get_rank()
        # every chunk's exchange is launched now, in order; micro-batch k waits for its own
        sends: list[list[list[Pending | None]]] = []  # [module][chunk][group]
        for m, ms, plan in zip(self._modules, step.modules, plans, strict=True):
            values = [t.detach() for t in ms.looked_up]
            sends.append([
                [g.send(v, plan, state, k) if g.exchange else None
                 for g, v, state in zip(m.groups, values, ms.dedup, strict=True)]
                for k in range(self._n)
            ])  # fmt: skip
        grads = [[torch.zeros_like(t) for t in ms.looked_up] for ms in step.modules]
        backs: list[Pending] = []
        logits = []
        deferred = self._deferred
        for k, b in enumerate(plans[0].sizes[rank]):
            if b == 0:  # none of my samples, but other ranks' chunk k still moves
                self._empty_micro_batch(step, k, plans, sends, grads, backs)
                continue
            mine = plans[0].samples(rank, k)  # this micro-batch's samples of my batch
            leaves = []
            for mi, (m, ms) in enumerate(zip(self._modules, step.modules, strict=True)):
                parts = []
                for g, group in enumerate(m.groups):
                    if group.exchange is None:
                        parts.append(ms.looked_up[g].detach()[mine])
                    else:
                        parts.append(sends[mi][k][g].wait())
                leaf = [p.requires_grad_() for p in parts]
                leaves.append(leaf)
                names, dims = m.module._embedding_names, m.module._embedding_dims
                m.module.forward = _returns(construct_output_kt(leaf, names, dims))
            try:
                with deferred:
                    deferred.start_micro_batch()
                    # requires grad so that every layer's output gradient is computed
                    dense = batch.dense_features[mine].requires_grad_()
                    sparse = _placeholder(batch.sparse_features, b)
                    logit = self._model.model(dense, sparse).squeeze(-1)
                    label = batch.labels[mine].float()
                    logit.backward(loss_seed(self._model, logit, label, size))
            finally:
                for m in self._modules:
                    del m.module.forward
            logits.append(logit.detach())
            for mi, (m, leaf) in enumerate(zip(self._modules, leaves, strict=True)):
                for g, group in enumerate(m.groups):
                    if group.exchange is None:
                        grads[mi][g][mine] = leaf[g].grad
                    else:  # in flight under the next micro-batch's dense work
                        state = step.modules[mi].dedup[g]
                        backs.append(group.send_back(leaf[g].grad, plans[mi], state, k,
                                                     grads[mi][g]))  # fmt: skip
            if k == 0 and self._next is not None:
                self._send_ids(self._next)
        inverse = None
        if step.order is not None:  # back to the data's sample order
            inverse = torch.empty_like(step.order)
            inverse[step.order] = torch.arange(len(step.order), device=step.order.device)
        deferred.accumulate(inverse, size)  # under the last gradient exchanges
        for pending in backs:
            pending.wait()
        step.grads = grads
        logit = torch.cat(logits)
        if inverse is not None:
            logit = logit[inverse]
        with torch.no_grad():  # the plain loop's loss: once, over the batch in data order
            loss = self._loss_fn(logit, batch.labels.float())
        return loss, logit, batch.labels

    def _empty_micro_batch(self, step: _Step, k: int, plans, sends, grads,
                           backs: list[Pending]) -> None:  # fmt: skip
        """Keep every rank's collectives in step when this rank's micro-batch k is empty (a
        batch smaller than N): receive its (empty) chunk, send back an empty gradient."""
        for mi, (m, plan) in enumerate(zip(self._modules, plans, strict=True)):
            for g, group in enumerate(m.groups):
                if group.exchange is not None:
                    sends[mi][k][g].wait()
                    empty = grads[mi][g].new_zeros(0, sum(group.exchange.dims))
                    state = step.modules[mi].dedup[g]
                    backs.append(group.send_back(empty, plan, state, k, grads[mi][g]))

    def _backward_lookups(self, step: _Step, exchanged: bool) -> None:
        """One backward through the lookups with the whole batch's gradient. Exchanged
        (sharded) tables: the fused TBE kernels apply the optimizer once, as in the plain
        loop. Data-parallel tables: their weights get gradients, averaged with the dense
        ones."""
        outputs, grads = [], []
        for m, ms, gs in zip(self._modules, step.modules, step.grads, strict=True):
            for group, t, g in zip(m.groups, ms.looked_up, gs, strict=True):
                if (group.exchange is not None) == exchanged and t.requires_grad:
                    outputs.append(t)
                    grads.append(g)
        if outputs:
            torch.autograd.backward(outputs, grads)

    def _start_dense_reduce(self):
        if self._world == 1 or not self._dense:
            return None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._dense]
        if self._per_tensor:  # as `dense_step.per_tensor_comm_hook` has DDP do it
            works = reduce_per_tensor(grads, self._world)

            def done() -> None:
                for w in works:
                    w.wait()
                for p, g in zip(self._dense, grads, strict=True):
                    p.grad = g

            return done
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self._world)
        work = dist.all_reduce(flat, async_op=True)

        def finish() -> None:
            work.wait()
            offset = 0
            for p, g in zip(self._dense, grads, strict=True):
                n = g.numel()
                p.grad = flat[offset : offset + n].view_as(p)
                offset += n

        return finish


def _dedup_exchange(group: _Group, sharding, fqn: str, stats: dict) -> DedupExchange:
    """The unique-row exchange of a sum-pooled table-wise / column-wise group."""
    pooling = {t.pooling for t in sharding.embedding_tables()}
    if pooling != {PoolingType.SUM}:
        raise NotImplementedError(
            f"pipeline.dedup: '{fqn}' ({group.sharding_type}) pools by "
            f"{sorted(p.name for p in pooling)}; unique rows are pooled by sum only. Use "
            f"pipeline.dedup=false"
        )
    return DedupExchange(group.exchange.pg, sharding.feature_names_per_rank(),
                         sharding._emb_dim_per_rank_per_feature(), group.columns, fqn,
                         stats)  # fmt: skip


def _returns(value):
    def forward(*_args, **_kwargs):
        return value

    return forward


def _placeholder(kjt: KeyedJaggedTensor, batch: int) -> KeyedJaggedTensor:
    """An empty KJT of `batch` samples: the micro-batch's sparse input is never read, the
    sharded modules return the exchanged embeddings instead."""
    keys = kjt.keys()
    return KeyedJaggedTensor(
        keys=keys,
        values=kjt.values()[:0],
        lengths=kjt.lengths().new_zeros(len(keys) * batch),
        stride=batch,
    )


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
