"""The deduplicated exchange of a table-wise (or column-wise) group: unique rows, not bags.

TorchRec's pooled exchange sends one vector per sample and feature. Under power-law ids
most of a micro-batch's lookups hit a few rows, so here an owner sends, for each requester
and micro-batch, each distinct row its samples look up once; the requester pools its bags
from those rows, and in backward sums each row's gradient over its bags before sending it
back. The owner's lookup is of single-id bags, one per (requester, micro-batch, distinct
id), through the group's own TBE, so the update is still the fused kernel's, once per batch,
on each row's summed gradient.

Both sides compute the same distinct ids from the same bags (the owner from its input
all-to-all, the requester from its own batch), sorted by (feature, id), so no sizes need to
be exchanged first. The arithmetic differs from the pooled exchange only in the order of
sums (a row's gradient is summed per micro-batch first): equal within rounding, not bit for
bit.

Shapes: b = samples of one micro-batch of one rank, n = distinct (feature, id) of one
(requester, micro-batch) block, F = features of one owner, D = their embedding dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from pipelines.exchange import ChunkPlan, Pending


@dataclass
class _Block:
    """The distinct rows one requester's micro-batch needs from one owner."""

    ids: torch.Tensor  # n distinct ids, sorted by (feature, id)
    counts: list[int]  # per feature of the owner: how many of the n
    # requester side only: per lookup, its distinct row (index into ids) and its target
    # row in the micro-batch's [b x F] bags (sample * F + feature position)
    inverse: torch.Tensor | None = None
    target: torch.Tensor | None = None


def _chunk(jt: JaggedTensor, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of the bags `rows` of `jt`, in bag order, and each id's bag (0..len(rows)-1)."""
    lengths, offsets = jt.lengths(), jt.offsets()
    if isinstance(rows, slice):
        rows = torch.arange(rows.start, rows.stop, device=lengths.device)
    lens = lengths[rows]
    bag = torch.repeat_interleave(torch.arange(len(rows), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens  # each bag's first id among the chunk's
    pos = offsets[rows][bag] + torch.arange(len(bag), device=bag.device) - first[bag]
    return jt.values()[pos], bag


@dataclass
class DedupBatch:
    """One batch's blocks: those this rank sends as owner ([k][s]) and where each sits in
    its unique lookups ([k][s][f]: first bag), and those it receives ([k][o])."""

    sent: list[list[_Block]]
    first: list[list[list[int]]]
    received: list[list[_Block]] | None = None


def _block(jts: list[JaggedTensor], rows, requester: bool) -> _Block:
    """Distinct (feature, id) of the bags `rows` over the owner's features `jts`."""
    if not jts:  # an owner with no table of this group
        none = torch.zeros(0, dtype=torch.int64)
        return _Block(none, [], none, none)
    ids, bags, feats = [], [], []
    for f, jt in enumerate(jts):
        v, bag = _chunk(jt, rows)
        ids.append(v)
        bags.append(bag)
        feats.append(torch.full_like(v, f))
    values, feature = torch.cat(ids), torch.cat(feats)
    span = int(values.max()) + 1 if len(values) else 1
    keys, inverse = torch.unique(feature * span + values, return_inverse=True)
    counts = torch.bincount(keys // span, minlength=len(jts)).tolist()
    block = _Block(keys % span, counts)
    if requester:
        block.inverse = inverse
        block.target = torch.cat(bags) * len(jts) + feature
    return block


class DedupExchange:
    """Forward and backward exchange of one pooled group's unique rows, per micro-batch."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        features_per_rank: list[list[str]],
        dims_per_rank: list[list[int]],
        columns: dict[str, tuple[int, int]],
        fqn: str,
        stats: dict[str, int],
    ) -> None:
        """`columns`: where each of this rank's features sits in its lookup's output."""
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.world = len(features_per_rank)
        self.features = features_per_rank
        self.dims = dims_per_rank
        self.columns = columns
        for r, (names, dims) in enumerate(zip(features_per_rank, dims_per_rank, strict=True)):
            if len(set(dims)) > 1 or len(set(names)) < len(names):
                raise NotImplementedError(
                    f"pipeline.dedup: '{fqn}' holds tables of different dims ({sorted(set(dims))}) "
                    f"or two column shards of one table on rank {r}; use pipeline.dedup=false"
                )
        self.dim = [d[0] if d else 0 for d in dims_per_rank]  # D of each owner
        self.stats = stats  # counts rows sent (dedup_rows) and the bags they replace

    # owner side: which single-id bags to look up, and where each block's rows are
    def owner_input(
        self, kjt: KeyedJaggedTensor, plan: ChunkPlan
    ) -> tuple[KeyedJaggedTensor, DedupBatch]:
        """The unique lookups of every (micro-batch, requester) block of this owner's
        stacked input: feature f's bags are its blocks' distinct ids, block after block,
        one id a bag; features with fewer pad with empty bags."""
        names = self.features[self.rank]
        state = DedupBatch([], [])
        if not names:
            return kjt, state
        if list(kjt.keys()) != names:
            raise RuntimeError(f"pipeline.dedup: input features {kjt.keys()} != shard {names}")
        jts = [kjt[f] for f in names]
        per_feature: list[list[torch.Tensor]] = [[] for _ in names]
        used = [0] * len(names)
        for k in range(plan.n):
            blocks, firsts = [], []
            for s in range(self.world):
                block = _block(jts, plan.rows(s, k), requester=False)
                blocks.append(block)
                firsts.append(list(used))
                for f, part in enumerate(block.ids.split(block.counts)):
                    per_feature[f].append(part)
                    used[f] += len(part)
                self.stats["dedup_rows"] += len(block.ids)
                self.stats["dedup_bags"] += plan.sizes[s][k] * len(names)
            state.sent.append(blocks)
            state.first.append(firsts)
        stride = max(max(used), 1)
        values = torch.cat([t for parts in per_feature for t in parts])
        lengths = torch.zeros(len(names) * stride, dtype=kjt.lengths().dtype, device=values.device)
        for f, n in enumerate(used):
            lengths[f * stride : f * stride + n] = 1
        return KeyedJaggedTensor(keys=names, values=values, lengths=lengths, stride=stride), state

    # requester side: the same blocks, from this rank's own batch
    def requester_input(self, kjt: KeyedJaggedTensor, plan: ChunkPlan, state: DedupBatch) -> None:
        by_name = kjt.to_dict()
        state.received = [
            [_block([by_name[f] for f in self.features[o]], plan.samples(self.rank, k), True)
             for o in range(self.world)]
            for k in range(plan.n)
        ]  # fmt: skip

    def _rows(self, out: torch.Tensor, state: DedupBatch, k: int, s: int) -> list[torch.Tensor]:
        """Views of the owner's lookup output (or its gradient) holding block (k, s)."""
        block, first = state.sent[k][s], state.first[k][s]
        cols = [self.columns[f] for f in self.features[self.rank]]
        return [out[i : i + n, c0:c1]
                for (c0, c1), i, n in zip(cols, first, block.counts, strict=True)]  # fmt: skip

    def forward(self, out: torch.Tensor, state: DedupBatch, k: int, b: int) -> Pending:
        """Send each requester its block's rows of `out` (the unique lookups' output);
        receive mine and pool my `b` samples' bags: b x (every owner's F x D)."""
        send = [torch.cat([r.reshape(-1) for r in self._rows(out, state, k, s)])
                if self.features[self.rank] else out.new_empty(0)
                for s in range(self.world)]  # fmt: skip
        received = state.received[k]
        recv_sizes = [len(blk.ids) * self.dim[o] for o, blk in enumerate(received)]
        recv = out.new_empty(sum(recv_sizes))
        work = dist.all_to_all_single(
            recv, torch.cat(send), output_split_sizes=recv_sizes,
            input_split_sizes=[len(t) for t in send], group=self.pg, async_op=True,
        )  # fmt: skip

        def finish() -> torch.Tensor:
            pooled = []
            for o, (part, blk) in enumerate(zip(recv.split(recv_sizes), received, strict=True)):
                f, d = len(self.features[o]), self.dim[o]
                if not f:
                    continue
                rows = part.view(-1, d)
                bags = rows.new_zeros(b * f, d).index_add_(0, blk.target, rows[blk.inverse])
                pooled.append(bags.view(b, f * d))
            return torch.cat(pooled, dim=1)

        return Pending(work, finish)

    def backward(self, grad: torch.Tensor, state: DedupBatch, k: int, out: torch.Tensor) -> Pending:
        """The reverse: each distinct row's gradient, summed over my bags that hold it, goes
        to its owner; what I receive lands in `out` (the unique lookups' gradient), divided
        by the world size when TorchRec's gradient division is on."""
        send, col = [], 0
        b = grad.shape[0]
        for o, blk in enumerate(state.received[k]):
            f, d = len(self.features[o]), self.dim[o]
            if not f:
                send.append(grad.new_empty(0))
                continue
            bags = grad[:, col : col + f * d].reshape(b * f, d)
            col += f * d
            rows = grad.new_zeros(len(blk.ids), d).index_add_(0, blk.inverse, bags[blk.target])
            send.append(rows.reshape(-1))
        d = self.dim[self.rank]
        recv_sizes = ([len(state.sent[k][s].ids) * d for s in range(self.world)]
                      if self.features[self.rank] else [0] * self.world)  # fmt: skip
        recv = grad.new_empty(sum(recv_sizes))
        work = dist.all_to_all_single(
            recv, torch.cat(send), output_split_sizes=recv_sizes,
            input_split_sizes=[len(t) for t in send], group=self.pg, async_op=True,
        )  # fmt: skip

        def finish() -> torch.Tensor:
            if get_gradient_division():
                recv.div_(self.world)
            for s, part in enumerate(recv.split(recv_sizes)):
                if not recv_sizes[s]:
                    continue
                rows = part.view(-1, d)
                at = 0
                views = self._rows(out, state, k, s)
                for view, n in zip(views, state.sent[k][s].counts, strict=True):
                    view.copy_(rows[at : at + n])
                    at += n
            return out

        return Pending(work, finish)
