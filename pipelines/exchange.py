"""The pooled-embedding all-to-all of a table-wise (or column-wise) sharded group, and the
reduce-scatter of a row-wise one, in micro-batch chunks, forward and backward, as plain
asynchronous collectives.

TorchRec's `PooledEmbeddingsAllToAll` moves a whole batch and puts its backward inside
autograd, where the engine waits for it at once. Here each chunk is its own
`all_to_all_single(async_op=True)`; the caller decides what runs while it is in flight.

Layout (the same as TorchRec's, so the result is the same tensor): the owner's local
lookup output holds the samples of every rank, rank by rank, one column block of
`dim_sum_per_rank[owner]` wide. Rank `r` receives, for its own samples, one block from
every owner and concatenates them along columns in owner order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import JaggedTensor


def micro_sizes(batch: int, n: int, align: int = 1) -> list[int]:
    """`batch` samples in `n` micro-batches as equal as can be in whole units of `align`
    samples (earlier ones one unit larger); the last also takes the `batch % align` rest.
    So every boundary falls on a multiple of `align` (`dense_step.alignment`)."""
    units, rest = divmod(batch, align)
    sizes = [(units // n + (1 if k < units % n else 0)) * align for k in range(n)]
    sizes[-1] += rest
    return sizes


@dataclass
class ChunkPlan:
    """Which samples of every rank's batch micro-batch `k` holds, the same on all ranks:
    consecutive ones, or with `orders` (each rank's sample order, from clustering) the
    k-th slice of that order; sizes from `micro_sizes(batch, n, align)`."""

    batch_per_rank: list[int]
    n: int
    orders: list[torch.Tensor] | None = None
    align: int = 1  # micro-batch boundaries on multiples of this many samples

    def __post_init__(self) -> None:
        self.sizes = [micro_sizes(b, self.n, self.align) for b in self.batch_per_rank]  # [rank][k]
        self.rank_offset = [0]
        for b in self.batch_per_rank[:-1]:
            self.rank_offset.append(self.rank_offset[-1] + b)

    def samples(self, rank: int, k: int) -> slice | torch.Tensor:
        """Micro-batch k of `rank`: its samples' positions in that rank's batch."""
        first = sum(self.sizes[rank][:k])
        window = slice(first, first + self.sizes[rank][k])
        return window if self.orders is None else self.orders[rank][window]

    def rows(self, rank: int, k: int) -> slice | torch.Tensor:
        """The same samples' rows in an owner's stacked (all ranks) lookup output."""
        at, offset = self.samples(rank, k), self.rank_offset[rank]
        return slice(at.start + offset, at.stop + offset) if isinstance(at, slice) else at + offset


class Pending:
    """An in-flight exchange: `wait()` gives the received tensor, shaped."""

    def __init__(self, work, finish) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish()


class ChunkedPooledExchange:
    """Forward and backward exchange of one pooled group in micro-batch chunks."""

    def __init__(self, pg: dist.ProcessGroup, dim_sum_per_rank: list[int]) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.dims = list(dim_sum_per_rank)
        self.local_dim = self.dims[self.rank]
        self.width = sum(self.dims)  # of what a rank receives for its samples
        self.col_starts = [sum(self.dims[:o]) for o in range(len(self.dims))]

    def forward(self, local: torch.Tensor, plan: ChunkPlan, k: int) -> Pending:
        """Send each rank its chunk-k rows of `local` (all ranks' samples x my columns);
        receive my chunk-k samples x every owner's columns."""
        world = len(self.dims)
        send = torch.cat([local[plan.rows(s, k)].reshape(-1) for s in range(world)])
        mine = plan.sizes[self.rank][k]
        recv = local.new_empty(mine * sum(self.dims))
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[mine * d for d in self.dims],
            input_split_sizes=[plan.sizes[s][k] * self.local_dim for s in range(world)],
            group=self.pg,
            async_op=True,
        )

        def finish() -> torch.Tensor:
            parts = recv.split([mine * d for d in self.dims])
            return torch.cat(
                [p.view(mine, d) for p, d in zip(parts, self.dims, strict=True)], dim=1
            )

        return Pending(work, finish)

    def backward(self, grad: torch.Tensor, plan: ChunkPlan, k: int, out: torch.Tensor) -> Pending:
        """The reverse: my chunk-k samples' gradient (every owner's columns) goes back to
        the owners; what I receive lands in `out` (my lookup output's gradient) at the
        rows of chunk k of every rank, divided by the world size when TorchRec's gradient
        division is on (its default: the sparse counterpart of DDP's averaging)."""
        world = len(self.dims)
        mine = plan.sizes[self.rank][k]
        send = torch.cat(
            [
                grad[:, c : c + d].reshape(-1)
                for c, d in zip(self.col_starts, self.dims, strict=True)
            ]
        )
        recv_sizes = [plan.sizes[s][k] * self.local_dim for s in range(world)]
        recv = grad.new_empty(sum(recv_sizes))
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=recv_sizes,
            input_split_sizes=[mine * d for d in self.dims],
            group=self.pg,
            async_op=True,
        )

        def finish() -> torch.Tensor:
            if get_gradient_division():  # as TorchRec's own backward all-to-all does
                recv.div_(world)
            for s, part in enumerate(recv.split(recv_sizes)):
                out[plan.rows(s, k)] = part.view(plan.sizes[s][k], self.local_dim)
            return out

        return Pending(work, finish)


class ChunkedReduceScatter:
    """Forward and backward exchange of one row-wise or table-row-wise group in micro-batch
    chunks.

    Row-wise: every table's rows in blocks over all ranks, so each rank's lookups are partial
    sums for every rank's samples, which TorchRec reduce-scatters. Table-row-wise: a node's
    tables in row blocks over its L ranks; TorchRec reduce-scatters within the node (local
    rank j receives the sums for the samples of the ranks of local rank j on every node, its
    cross group) and then all-to-alls across nodes within the cross group (each rank
    receives its samples with every node's columns); the lookup output holds the samples
    cross group by cross group (TorchRec's staggered id all-to-all). Row-wise is the case of
    one node (`cross_pg` None). Per chunk: the reduce-scatter as an all-to-all of each
    rank's chunk-k rows, the received partials added in rank order (`OrderedReduceScatter`'s
    order: a collective's own can change with the tensor's size, gloo's does), then the
    cross-node all-to-all of the sums; backward the reverse (all-to-all, then all-gather),
    each stage's gradient divided by its group's size where TorchRec divides it."""

    def __init__(
        self,
        intra_pg: dist.ProcessGroup,
        dim_sum_per_node: list[int],
        cross_pg: dist.ProcessGroup | None = None,
    ) -> None:
        self.intra_pg, self.cross_pg = intra_pg, cross_pg
        self.local = dist.get_world_size(intra_pg)
        self.local_rank = dist.get_rank(intra_pg)
        self.nodes = 1 if cross_pg is None else dist.get_world_size(cross_pg)
        self.node = 0 if cross_pg is None else dist.get_rank(cross_pg)
        self.dims = list(dim_sum_per_node)  # each node's columns
        self.width = sum(self.dims)  # of what a rank receives for its samples
        self.node_dim = self.dims[self.node]

    def _group(self, j: int) -> list[int]:
        """The ranks of local rank j, node by node (a cross group)."""
        return [n * self.local + j for n in range(self.nodes)]

    def _offsets(self, plan: ChunkPlan) -> dict[int, int]:
        """Each rank's first row in the (staggered) lookup output."""
        offsets, row = {}, 0
        for r in (r for j in range(self.local) for r in self._group(j)):
            offsets[r], row = row, row + plan.batch_per_rank[r]
        return offsets

    @staticmethod
    def _rows(plan: ChunkPlan, offsets: dict[int, int], s: int, k: int) -> slice | torch.Tensor:
        """Rank s's chunk-k samples' rows in the lookup output."""
        at, offset = plan.samples(s, k), offsets[s]
        return slice(at.start + offset, at.stop + offset) if isinstance(at, slice) else at + offset

    def _sizes(self, plan: ChunkPlan, j: int, k: int) -> list[int]:
        return [plan.sizes[r][k] for r in self._group(j)]

    def forward(self, local: torch.Tensor, plan: ChunkPlan, k: int) -> Pending:
        mine = plan.sizes[self.local * self.node + self.local_rank][k]
        offsets = self._offsets(plan)
        send = torch.cat(
            [
                local[self._rows(plan, offsets, r, k)].reshape(-1)
                for j in range(self.local)
                for r in self._group(j)
            ]
        )
        group = sum(self._sizes(plan, self.local_rank, k))  # my cross group's chunk
        recv = local.new_empty(self.local * group * self.node_dim)
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[group * self.node_dim] * self.local,
            input_split_sizes=[
                sum(self._sizes(plan, j, k)) * self.node_dim for j in range(self.local)
            ],
            group=self.intra_pg,
            async_op=True,
        )

        def finish() -> torch.Tensor:
            work.wait()
            summed = ordered_sum(recv.view(self.local, group, self.node_dim))
            if self.cross_pg is None:
                return summed
            out = local.new_empty(mine * self.width)
            to = [b * self.node_dim for b in self._sizes(plan, self.local_rank, k)]
            dist.all_to_all_single(
                out,
                summed.reshape(-1),
                group=self.cross_pg,
                output_split_sizes=[mine * d for d in self.dims],
                input_split_sizes=to,
            )
            parts = out.split([mine * d for d in self.dims])
            return torch.cat([p.view(mine, d) for p, d in zip(parts, self.dims, strict=True)], 1)

        return Pending(None, finish)

    def backward(self, grad: torch.Tensor, plan: ChunkPlan, k: int, out: torch.Tensor) -> Pending:
        if self.cross_pg is None:  # row-wise: the reduce-scatter's backward starts now
            return self._gather_within(grad.reshape(-1), plan, k, out)
        # table-row-wise: the cross-node all-to-all's backward first, then within the node
        mine = grad.shape[0]
        starts = [sum(self.dims[:n]) for n in range(self.nodes)]
        send = torch.cat(
            [grad[:, c : c + d].reshape(-1) for c, d in zip(starts, self.dims, strict=True)]
        )
        sizes = self._sizes(plan, self.local_rank, k)
        recv = grad.new_empty(sum(sizes) * self.node_dim)
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=[b * self.node_dim for b in sizes],
            input_split_sizes=[mine * d for d in self.dims],
            group=self.cross_pg,
            async_op=True,
        )

        def finish() -> torch.Tensor:
            work.wait()
            if get_gradient_division():  # as TorchRec's all-to-all backward
                recv.div_(self.nodes)
            return self._gather_within(recv, plan, k, out).wait()

        return Pending(None, finish)

    def _gather_within(
        self, recv: torch.Tensor, plan: ChunkPlan, k: int, out: torch.Tensor
    ) -> Pending:
        """The within-node reduce-scatter's backward (an all-gather, as an all-to-all) of
        chunk k's summed gradient `recv`: every rank's partials' gradient lands in `out`."""
        every = [sum(self._sizes(plan, j, k)) * self.node_dim for j in range(self.local)]
        gathered = recv.new_empty(sum(every))
        work = dist.all_to_all_single(
            gathered,
            recv.repeat(self.local),
            output_split_sizes=every,
            input_split_sizes=[recv.numel()] * self.local,
            group=self.intra_pg,
            async_op=True,
        )

        def finish() -> torch.Tensor:
            if get_gradient_division():  # as TorchRec's reduce-scatter backward
                gathered.div_(self.local)
            parts = iter(
                gathered.split(
                    [b * self.node_dim for j in range(self.local) for b in self._sizes(plan, j, k)]
                )
            )
            offsets = self._offsets(plan)
            for j in range(self.local):
                for r in self._group(j):
                    out[self._rows(plan, offsets, r, k)] = next(parts).view(-1, self.node_dim)
            return out

        return Pending(work, finish)


@dataclass
class SequenceBatch:
    """One batch's bag lengths of a sequence group: as its owner holds them (`owned`: my
    tables' features x every rank's samples, rank by rank) and as this rank asked
    (`asked`: the group's features x my samples); and, per chunk, which rows of my lookup
    output went to each rank (the backward puts their gradients back there)."""

    owned: torch.Tensor
    asked: torch.Tensor
    sent: dict = field(default_factory=dict)  # k -> (rows of my lookup output, per-rank counts)
    received: dict = field(default_factory=dict)  # k -> (per-owner counts, per-feature lengths)
    starts: torch.Tensor | None = None  # each owned bag's first row, worked out once a batch


class ChunkedSequenceExchange:
    """Forward and backward exchange of one table-wise sequence group (an
    `EmbeddingCollection`'s) in micro-batch chunks: every id's own row, not a pooled bag.

    Layout (TorchRec's `SequenceEmbeddingsAllToAll`): the owner's lookup output holds one row
    per id, feature by feature, then source rank by rank, then sample by sample. For chunk k
    the owner sends rank s, feature by feature, the rows of s's chunk-k samples; rank s
    receives, owner by owner, its features' rows for those samples, which is its own
    features in the group's order (`feature_names()`: owner by owner). `jagged` cuts them into
    one `JaggedTensor` per feature, what the module's forward returns for those samples."""

    def __init__(
        self, pg: dist.ProcessGroup, features_per_rank: list[int], dim: int, names: list[str]
    ) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.features_per_rank = list(features_per_rank)
        self.world = len(self.features_per_rank)
        self.dim = self.width = dim
        self.names = list(names)  # the group's features (embedding names), owner by owner

    def _owned(self, state: SequenceBatch, plan: ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = state.owned.view(self.features_per_rank[self.rank], sum(plan.batch_per_rank))
        if state.starts is None:  # the same for every chunk of the batch
            flat = lengths.reshape(-1)
            state.starts = (torch.cumsum(flat, 0) - flat).view_as(lengths)
        return lengths, state.starts

    def _asked(self, state: SequenceBatch, plan: ChunkPlan, k: int) -> torch.Tensor:
        """My chunk-k samples' lengths: the group's features x those samples."""
        mine = plan.batch_per_rank[self.rank]
        return state.asked.view(len(self.names), mine)[:, plan.samples(self.rank, k)]

    def forward(
        self, local: torch.Tensor, plan: ChunkPlan, k: int, state: SequenceBatch
    ) -> Pending:
        lengths, starts = self._owned(state, plan)
        rows, counts = [], []
        for s in range(self.world):
            at = plan.rows(s, k)
            r = _expand(starts[:, at].reshape(-1), lengths[:, at].reshape(-1))
            rows.append(r)
            counts.append(r.numel())
        rows = torch.cat(rows)
        state.sent[k] = (rows, counts)
        asked = self._asked(state, plan, k)
        per_feature = asked.sum(1).tolist()
        bounds = [sum(self.features_per_rank[:o]) for o in range(self.world + 1)]
        recv_counts = [sum(per_feature[bounds[o] : bounds[o + 1]]) for o in range(self.world)]
        state.received[k] = (recv_counts, asked, per_feature)
        recv = local.new_empty(sum(recv_counts) * self.dim)
        work = dist.all_to_all_single(
            recv,
            local[rows].reshape(-1),
            output_split_sizes=[c * self.dim for c in recv_counts],
            input_split_sizes=[c * self.dim for c in counts],
            group=self.pg,
            async_op=True,
        )
        return Pending(work, lambda: recv.view(-1, self.dim))

    def jagged(self, values: torch.Tensor, state: SequenceBatch, k: int) -> dict[str, JaggedTensor]:
        """Chunk k's received rows (`forward`'s result, or a tensor of its shape holding
        their graph) as each feature's `JaggedTensor` over my chunk-k samples."""
        _, asked, per_feature = state.received[k]
        parts = values.split(per_feature)
        return {
            name: JaggedTensor(values=v, lengths=asked[f])
            for f, (name, v) in enumerate(zip(self.names, parts, strict=True))
        }

    def backward(
        self, grad: torch.Tensor, plan: ChunkPlan, k: int, out: torch.Tensor, state: SequenceBatch
    ) -> Pending:
        """The reverse: each received row's gradient goes back to its owner, which puts it
        at the row it sent, divided by the world size where TorchRec divides it."""
        rows, counts = state.sent[k]
        recv_counts = state.received[k][0]
        recv = grad.new_empty(sum(counts) * self.dim)
        work = dist.all_to_all_single(
            recv,
            grad.reshape(-1),
            output_split_sizes=[c * self.dim for c in counts],
            input_split_sizes=[c * self.dim for c in recv_counts],
            group=self.pg,
            async_op=True,
        )

        def finish() -> torch.Tensor:
            if get_gradient_division():  # as TorchRec's sequence all-to-all backward
                recv.div_(self.world)
            out[rows] = recv.view(-1, self.dim)
            return out

        return Pending(work, finish)


def _expand(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The positions start, start+1, ..., start+length-1 of every (start, length), in order."""
    total = int(lengths.sum())
    first = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
    return first + torch.arange(total, dtype=starts.dtype, device=starts.device)


def ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """Sum over the first dimension, left to right (rank 0's partial first)."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


class _Summed(torch.autograd.Function):
    """The reduce-scatter's result as a function of `local` for autograd: forward passes the
    received sum through; backward is the exchange's (an all-gather of the gradient)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, summed: torch.Tensor, exchange, plan: ChunkPlan):
        ctx.exchange, ctx.plan, ctx.shape = exchange, plan, local.shape
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(ctx.shape)
        ctx.exchange.backward(grad.contiguous(), ctx.plan, 0, out).wait()
        return out, None, None, None


class _Reduced(Awaitable[torch.Tensor]):
    """The reduce-scatter in flight, launched when the output dist is called (as TorchRec's
    is, so a pipeline can overlap it); waiting sums what arrived."""

    def __init__(
        self, local: torch.Tensor, exchange: ChunkedReduceScatter, plan: ChunkPlan
    ) -> None:
        super().__init__()
        self._local, self._exchange, self._plan = local, exchange, plan
        self._pending = exchange.forward(local.detach(), plan, 0)

    def _wait_impl(self) -> torch.Tensor:
        return _Summed.apply(self._local, self._pending.wait(), self._exchange, self._plan)


class OrderedReduceScatter(torch.nn.Module):
    """In place of TorchRec's `PooledEmbeddingsReduceScatter` in a row-wise group's output
    dist: the same result up to the order of the sum (ranks' partials added in rank order,
    as `ChunkedReduceScatter` adds each chunk's), the same bytes on the wire as a ring
    reduce-scatter. Installed in every pipeline on CPU ranks (`install_ordered_reduce_scatter`)
    so that the nested pipeline's chunks sum as the plain loop does at any world size."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        super().__init__()
        self._pg = pg

    def forward(
        self, local_embs: torch.Tensor, input_splits: list[int] | None = None
    ) -> Awaitable[torch.Tensor]:
        world = dist.get_world_size(self._pg)
        splits = list(input_splits) if input_splits else [local_embs.shape[0] // world] * world
        exchange = ChunkedReduceScatter(self._pg, [local_embs.shape[1]])
        return _Reduced(local_embs, exchange, ChunkPlan(splits, 1))  # the batch: one chunk


def install_ordered_reduce_scatter(model: torch.nn.Module) -> int:
    """Every row-wise and table-row-wise group of the model's sharded collections reduces
    with `OrderedReduceScatter` (table-row-wise: within the node, before TorchRec's own
    all-to-all across nodes); the number of groups changed."""
    changed = 0
    for m in model.modules():
        if not isinstance(m, ShardedEmbeddingBagCollection):
            continue
        for od in m._output_dists:
            if isinstance(od, RwPooledEmbeddingDist) and od._codecs is None:
                od._dist = OrderedReduceScatter(od._pg)
                changed += 1
            elif isinstance(od, TwRwPooledEmbeddingDist) and not (
                od._intra_codecs or od._cross_codecs
            ):
                od._intra_dist = OrderedReduceScatter(od._intra_pg)
                od._cross_dist = PooledEmbeddingsAllToAll(  # what TorchRec makes on first use
                    pg=od._cross_pg, dim_sum_per_rank=od._dim_sum_per_node, device=od._device
                )
                changed += 1
    return changed
