"""Deduplicated key routing and exchange of a table-wise (or column-wise) group.

TorchRec's pooled exchange sends one vector per sample and feature, and its input
all-to-all every id of every bag. Under power-law ids most of a micro-batch's lookups hit a
few rows, so here:
- key routing: the requester works out each micro-batch's distinct (feature, id), sorted,
  and routes only those through TorchRec's input all-to-all (`route_distinct`: all of a
  micro-batch's distinct ids in its first bag; lengths still go, a few bytes a bag);
- the owner looks them up as single-id bags, one per (requester, micro-batch, distinct
  id), through the group's own TBE, and sends each requester its block of rows;
- the requester pools its bags from those rows, and in backward sums each row's gradient
  over its bags before sending it back; the fused update runs once per batch on each row's
  summed gradient.

Both sides know every block's size from the same distinct ids, so nothing else is
exchanged first. The arithmetic differs from the pooled exchange only in the order of sums
(a row's gradient is summed per micro-batch first): equal within rounding, not bit for bit.

Shapes: b = samples of one micro-batch of one rank, n = distinct (feature, id) of one
(requester, micro-batch) block, F = features of one owner, D = their embedding dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

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


@dataclass
class DedupBatch:
    """One batch's blocks: those this rank receives ([k][o]), those it sends as owner
    ([k][s]) and where each block's rows sit in its unique lookups' output ([k][s]: bag
    and feature position of each row)."""

    received: list[list[_Block]] = field(default_factory=list)
    sent: list[list[_Block]] = field(default_factory=list)
    where: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)


def _block(kjt: KeyedJaggedTensor, keys: torch.Tensor, rows, requester: bool) -> _Block:
    """Distinct (feature, id) of the bags `rows` (samples) of the features at positions
    `keys` of `kjt`, in one pass over all those features."""
    lengths, offsets = kjt.lengths(), kjt.offsets()
    if isinstance(rows, slice):
        rows = torch.arange(rows.start, rows.stop, device=lengths.device)
    if not len(keys):  # an owner with no table of this group
        none = torch.zeros(0, dtype=torch.int64, device=lengths.device)
        return _Block(none, [], none, none)
    b = len(rows)
    bags = (keys[:, None] * kjt.stride() + rows[None, :]).reshape(-1)  # feature-major
    lens = lengths[bags]
    bag = torch.repeat_interleave(torch.arange(len(bags), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens  # each bag's first id among the block's
    values = kjt.values()[offsets[bags][bag] + torch.arange(len(bag), device=bag.device)
                          - first[bag]]  # fmt: skip
    feature = bag // max(b, 1)
    if not requester:  # the requester routed each feature's distinct ids, sorted
        return _Block(values, torch.bincount(feature, minlength=len(keys)).tolist())
    span = int(values.max()) + 1 if len(values) else 1
    keys_, inverse = torch.unique(feature * span + values, return_inverse=True)
    counts = torch.bincount(keys_ // span, minlength=len(keys)).tolist()
    # target row in the block's [b x F] bags: sample * F + feature
    return _Block(keys_ % span, counts, inverse, (bag % max(b, 1)) * len(keys) + feature)


def route_distinct(
    kjt: KeyedJaggedTensor, distinct: dict[str, list[torch.Tensor]], samples: list
) -> KeyedJaggedTensor:
    """What goes into TorchRec's input all-to-all: `kjt`, but each feature of `distinct`
    carries only each micro-batch's distinct ids, all in that micro-batch's first bag, so
    the id exchange sends every distinct id once (the bag lengths still go, as before)."""
    stride, by_name = kjt.stride(), kjt.to_dict()
    lengths, values = kjt.lengths().clone(), []
    for i, f in enumerate(kjt.keys()):
        if f not in distinct:
            values.append(by_name[f].values())
            continue
        lens = lengths[i * stride : (i + 1) * stride]
        lens.zero_()
        held = []
        for rows, ids in zip(samples, distinct[f], strict=True):
            if len(ids):  # a micro-batch with ids has samples: its first one holds them
                first = rows.start if isinstance(rows, slice) else int(rows[0])
                lens[first] = len(ids)
                held.append((first, ids))
        values += [ids for _, ids in sorted(held, key=lambda h: h[0])]
    values = torch.cat(values) if values else kjt.values().new_empty(0)  # every bag empty
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=lengths, stride=stride)


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
        self.columns = columns
        for r, (names, dims) in enumerate(zip(features_per_rank, dims_per_rank, strict=True)):
            if len(set(dims)) > 1 or len(set(names)) < len(names):
                raise NotImplementedError(
                    f"pipeline.dedup: '{fqn}' holds tables of different dims ({sorted(set(dims))}) "
                    f"or two column shards of one table on rank {r}; use pipeline.dedup=false"
                )
        self.dim = [d[0] if d else 0 for d in dims_per_rank]  # D of each owner
        d = self.dim[self.rank]
        if any(columns[f] != (columns[f][0], columns[f][0] + d) or columns[f][0] % d
               for f in features_per_rank[self.rank]):  # fmt: skip
            raise NotImplementedError(
                f"pipeline.dedup: '{fqn}' lays its lookup's columns out in an unexpected "
                f"order ({columns}); use pipeline.dedup=false"
            )
        self.stats = stats  # counts rows sent (dedup_rows) and the bags they replace

    # owner side: which single-id bags to look up, and where each block's rows are
    def owner_input(
        self, kjt: KeyedJaggedTensor, plan: ChunkPlan, state: DedupBatch
    ) -> KeyedJaggedTensor:
        """The unique lookups of every (micro-batch, requester) block of this owner's
        stacked input (`route_distinct`'s: each block's distinct ids): feature f's bags are
        its blocks' ids, block after block, one id a bag; features with fewer pad with
        empty bags."""
        names = self.features[self.rank]
        if not names:
            return kjt
        if list(kjt.keys()) != names:
            raise RuntimeError(f"pipeline.dedup: input features {kjt.keys()} != shard {names}")
        device = kjt.values().device
        keys = torch.arange(len(names), device=device)
        d = self.dim[self.rank]  # feature f's rows sit in output columns of block columns[f]
        position = torch.tensor([self.columns[f][0] // d for f in names], device=device)
        per_feature: list[list[torch.Tensor]] = [[] for _ in names]
        used = [0] * len(names)
        for k in range(plan.n):
            blocks, where = [], []
            for s in range(self.world):
                block = _block(kjt, keys, plan.rows(s, k), requester=False)
                counts = torch.tensor(block.counts, device=device)
                feature = torch.repeat_interleave(keys, counts)
                first = torch.tensor(used, device=device) - (torch.cumsum(counts, 0) - counts)
                where.append((first[feature] + torch.arange(len(feature), device=device),
                              position[feature]))  # fmt: skip
                blocks.append(block)
                for f, part in enumerate(block.ids.split(block.counts)):
                    per_feature[f].append(part)
                    used[f] += len(part)
                self.stats["dedup_rows"] += len(block.ids)
                self.stats["dedup_bags"] += plan.sizes[s][k] * len(names)
            state.sent.append(blocks)
            state.where.append(where)
        stride = max(max(used), 1)
        values = torch.cat([t for parts in per_feature for t in parts])
        bag = torch.arange(stride, device=device)
        lengths = (bag[None, :] < torch.tensor(used, device=device)[:, None]).reshape(-1)
        lengths = lengths.to(kjt.lengths().dtype)
        return KeyedJaggedTensor(keys=names, values=values, lengths=lengths, stride=stride)

    # requester side: the same blocks, from this rank's own batch
    def requester_input(self, kjt: KeyedJaggedTensor, samples: list, state: DedupBatch) -> None:
        """Each micro-batch's (`samples`: its samples of this rank's batch) distinct rows
        from each owner, and how its bags pool from them."""
        at = {f: i for i, f in enumerate(kjt.keys())}
        device = kjt.values().device
        keys = [torch.tensor([at[f] for f in self.features[o]], dtype=torch.int64, device=device)
                for o in range(self.world)]  # fmt: skip
        state.received = [
            [_block(kjt, keys[o], rows, True) for o in range(self.world)] for rows in samples
        ]

    def distinct(self, state: DedupBatch) -> dict[str, list[torch.Tensor]]:
        """Per feature of the group: each micro-batch's distinct ids, sorted."""
        out: dict[str, list[torch.Tensor]] = {}
        for k, blocks in enumerate(state.received):
            for o, blk in enumerate(blocks):
                for f, ids in zip(self.features[o], blk.ids.split(blk.counts), strict=True):
                    per_k = out.setdefault(f, [])
                    if len(per_k) == k:  # a column-split feature's owners share its ids
                        per_k.append(ids)
        return out

    def _rows(self, out: torch.Tensor) -> torch.Tensor:
        """The owner's lookup output (or its gradient) as [bags, features, D]."""
        return out.view(out.shape[0], -1, self.dim[self.rank])

    def _all_to_all(self, send: list[torch.Tensor], recv_sizes: list[int]):
        """One asynchronous all-to-all: `send[r]` to rank r; returns the receive buffer
        (rank by rank, `recv_sizes` long) and the work to wait for."""
        data = torch.cat(send)
        recv = data.new_empty(sum(recv_sizes))
        work = dist.all_to_all_single(
            recv, data, output_split_sizes=recv_sizes,
            input_split_sizes=[len(t) for t in send], group=self.pg, async_op=True,
        )  # fmt: skip
        return recv, work

    def forward(self, out: torch.Tensor, state: DedupBatch, k: int, b: int) -> Pending:
        """Send each requester its block's rows of `out` (the unique lookups' output);
        receive mine and pool my `b` samples' bags: b x (every owner's F x D)."""
        rows = self._rows(out) if self.features[self.rank] else None
        send = [rows[state.where[k][s]].reshape(-1) if rows is not None else out.new_empty(0)
                for s in range(self.world)]  # fmt: skip
        received = state.received[k]
        recv_sizes = [len(blk.ids) * self.dim[o] for o, blk in enumerate(received)]
        recv, work = self._all_to_all(send, recv_sizes)

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
        recv, work = self._all_to_all(send, recv_sizes)

        def finish() -> torch.Tensor:
            if get_gradient_division():
                recv.div_(self.world)
            rows = self._rows(out) if self.features[self.rank] else None
            for s, part in enumerate(recv.split(recv_sizes)):
                if recv_sizes[s]:
                    rows[state.where[k][s]] = part.view(-1, d)
            return out

        return Pending(work, finish)
