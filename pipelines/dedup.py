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

With `grads=False` (`pipeline.dedup_grads=false`) only the forward is deduplicated: every id
is routed as TorchRec routes it, the owner works each block's distinct rows out of them and
looks them up beside the full lookup (whose graph the update runs through), and the
gradients go back pooled, one vector per sample and feature (`ChunkedPooledExchange`). The
requester pools each bag from its rows in the bag's order, as the TBE does, so the result is
the plain loop's bit for bit, for about two thirds of the pooled exchange's bytes where ids
repeat within a micro-batch.

Both sides know every block's size from the same distinct ids, so nothing else is
exchanged first. On a GPU each side works out all its blocks (every micro-batch and owner,
or every micro-batch and requester) at once on the device, with sorts and scatters whose
sizes are known, and reads their sizes on the host once a step (`BatchLookups.read`, the
one read in `owner_input`): the all-to-alls need their split sizes there, and nothing else
waits for the device (`tests/unit/test_dedup_blocks.py` counts the reads). On a CPU, where
a read waits for nothing, each side keys every lookup by (block, feature, id) and takes one
`unique` (on 32-bit keys where they fit), which is faster there; both give the same blocks,
bit for bit (tested). There, where every bag holds one id, a requester pools a block's bags
by one gather of their rows (`_Block.gather`: what the sum of one row is).

With gradients deduplicated the arithmetic differs from the pooled exchange only in the
order of sums (a row's gradient is summed per micro-batch first): equal within rounding,
not bit for bit.

Shapes: b = samples of one micro-batch of one rank, n = distinct (feature, id) of one
(requester, micro-batch) block, F = features of one owner, D = their embedding dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
    # one id a bag: each bag's distinct row, in bag order (its pooling is a gather)
    gather: torch.Tensor | None = None


@dataclass
class DedupBatch:
    """One batch's blocks: those this rank receives ([k][o]), those it sends as owner
    ([k][s]) and where each block's rows sit in its unique lookups' output ([k][s]: bag
    and feature position of each row)."""

    received: list[list[_Block]] = field(default_factory=list)
    sent: list[list[_Block]] = field(default_factory=list)
    where: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    # forward-only dedup (`grads=False`): the owner's single-id bags of every block and
    # their lookup (no graph), what the chunks send; the full lookup keeps the graph
    unique: KeyedJaggedTensor | None = None
    rows: torch.Tensor | None = None


def _unique(keys: torch.Tensor, bound: int, inverse: bool = False):
    """`torch.unique(keys, return_inverse=inverse)` of int64 keys below `bound`, on 32-bit
    keys where they fit: a CPU sorts those faster (0.85 against 1.87 ms for 53,248 keys on
    one core of this project's machine, torch 2.14.1, 2026-12-07)."""
    if bound > torch.iinfo(torch.int32).max:
        return torch.unique(keys, return_inverse=inverse)
    out = torch.unique(keys.int(), return_inverse=inverse)
    return (out[0].long(), out[1]) if inverse else out.long()


def _blocks(
    kjt: KeyedJaggedTensor, keys: list[torch.Tensor], samples: list, cache: dict
) -> list[list[_Block]]:
    """A requester's blocks ([micro-batch][owner]) of `samples` (a list of bag sets: each a
    slice or a tensor of samples) of the features at positions `keys[o]` of `kjt` (owner
    o's, in its order), on their own (the CPU path: there reading a size is free) but in one
    pass over every owner: each block's distinct (feature, id), with each lookup's distinct
    row and target bag. One `unique` over every block's lookups keyed by (micro-batch,
    column, id), the columns every owner's features in owner order, gives each block's
    distinct ids in (feature, id) order. What depends only on the micro-batch sizes and the
    owners' features is made once (`cache`)."""
    lengths, offsets = kjt.lengths(), kjt.offsets()
    device = lengths.device
    f_per = [len(k) for k in keys]
    if not sum(f_per):  # no owner holds a table of this group
        none = torch.zeros(0, dtype=torch.int64, device=device)
        return [[_Block(none, [], none, none) for _ in keys] for _ in samples]
    rows = [
        torch.arange(r.start, r.stop, device=device) if isinstance(r, slice) else r for r in samples
    ]
    sizes, c, n, w = [len(r) for r in rows], sum(f_per), len(rows), len(keys)
    key = ("blocks", tuple(sizes), tuple(f_per), device)
    if key not in cache:
        # per column (every owner's features, owner after owner): its owner, the owner's
        # feature count and the column's place among them; per bag of the step's bags
        # (micro-batch after micro-batch, each column after column, each sample): its
        # (micro-batch, column), its (micro-batch, owner) block and its target bag
        owner, per_owner, place = (
            torch.tensor(t, device=device)
            for t in zip(*[(o, f, p) for o, f in enumerate(f_per) for p in range(f)], strict=True)
        )
        column = torch.cat([torch.arange(c, device=device).repeat_interleave(b) for b in sizes])
        local = torch.cat([torch.arange(b, device=device).repeat(c) for b in sizes])
        micro = torch.arange(n, device=device).repeat_interleave(
            torch.tensor(sizes, device=device) * c
        )
        block, target = micro * w + owner[column], local * per_owner[column] + place[column]
        # with one id a bag, each block's bags in target order: their place among the bags
        starts = torch.cumsum(torch.bincount(block, minlength=n * w), 0)
        slot = target + (starts - torch.bincount(block, minlength=n * w))[block]
        cache[key] = (micro * c + column, block, target, torch.argsort(slot))
    group, block, target, by_target = cache[key]
    columns = torch.cat(keys)  # each column's feature position in the batch
    bags = torch.cat([(columns[:, None] * kjt.stride() + r[None, :]).reshape(-1) for r in rows])
    lens = lengths[bags]
    values = kjt.values()
    one_hot = len(values) == len(bags) and bool((lens == 1).all())
    if one_hot:
        values = values[offsets[bags]]
    else:
        bag = torch.repeat_interleave(
            torch.arange(len(bags), device=device), lens, output_size=int(lens.sum())
        )
        first = torch.cumsum(lens, 0) - lens  # each bag's first id among the lookups
        values = values[offsets[bags][bag] + torch.arange(len(bag), device=device) - first[bag]]
        group, block, target = group[bag], block[bag], target[bag]
    span = int(values.max()) + 1 if len(values) else 1
    keys_, inverse = _unique(group * span + values, n * c * span, inverse=True)
    counts = torch.bincount(keys_ // span, minlength=n * c).view(n, c)
    distinct = torch.stack([part.sum(1) for part in counts.split(f_per, dim=1)], dim=1)
    distinct = distinct.reshape(-1)  # per (micro-batch, owner) block
    inverse = inverse - (torch.cumsum(distinct, 0) - distinct)[block]
    per_block = distinct.tolist()
    lookups = torch.bincount(block, minlength=n * w).tolist()
    counts = counts.tolist()
    gathers = inverse[by_target].split(lookups) if one_hot else [None] * len(lookups)
    blocks = iter(
        zip(
            (keys_ % span).split(per_block),
            inverse.split(lookups),
            target.split(lookups),
            gathers,
            strict=True,
        )
    )
    out = []
    for k in range(n):
        row, at = [], 0
        for f in f_per:
            ids, inv, tgt, gather = next(blocks)
            row.append(_Block(ids, counts[k][at : at + f], inv, tgt, gather))
            at += f
        out.append(row)
    return out


def _owner_blocks(
    kjt: KeyedJaggedTensor, f: int, samples: list, distinct: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An owner's rows of every block of `samples` (block j: the bags of the samples
    `samples[j]`, of every one of `kjt`'s `f` features), sorted by (block, feature, id), each
    row's (block, feature) (block * f + feature), and how many each (block, feature) holds
    ([blocks, f]). `distinct`: the ids are every id routed, and each block's distinct ones
    are kept; else they are already its distinct ids (`route_distinct`'s, sorted)."""
    lengths, values, stride = kjt.lengths(), kjt.values(), kjt.stride()
    device = values.device
    of_sample = torch.empty(stride, dtype=torch.int64, device=device)
    for j, rows in enumerate(samples):
        of_sample[rows] = j
    # each bag's (block, feature): the bags feature after feature, sample after sample
    group = (of_sample[None, :] * f + torch.arange(f, device=device)[:, None]).reshape(-1)
    # unless every bag holds one id (checked on a CPU only: there a read waits for nothing)
    one_hot = device.type == "cpu" and len(values) == len(lengths) and bool((lengths == 1).all())
    if not one_hot:
        group = group[
            torch.repeat_interleave(
                torch.arange(len(lengths), device=device), lengths, output_size=len(values)
            )
        ]
    if distinct:
        span = int(values.max()) + 1 if len(values) else 1
        keys = _unique(group * span + values, len(samples) * f * span)
        group, ids = keys // span, keys % span
    else:
        order = torch.sort(group, stable=True).indices
        group, ids = group[order], values[order]
    return ids, group, torch.bincount(group, minlength=len(samples) * f).view(len(samples), f)


class BatchLookups:
    """Every lookup of a rank's batch, indexed once a step for the dedup groups of one
    module, on the batch's device. Every size the host needs (each block's, each feature's
    and each micro-batch's first sample) is asked for with `need` and read in one go by
    `read`: the one host read of the requester side a step, whatever the micro-batches,
    owners and groups (what stays on the device never waits for it)."""

    def __init__(self, kjt: KeyedJaggedTensor, samples: list) -> None:
        self.kjt, self.n = kjt, len(samples)
        values, lengths, stride = kjt.values(), kjt.lengths(), kjt.stride()
        device = values.device
        self.values = values
        micro = torch.full((stride,), self.n, dtype=torch.int64, device=device)
        local = torch.zeros(stride, dtype=torch.int64, device=device)
        firsts, self._sizes = [], []
        for k, rows in enumerate(samples):
            size = rows.stop - rows.start if isinstance(rows, slice) else len(rows)
            self._sizes.append(size)
            micro[rows] = k
            local[rows] = torch.arange(size, device=device)
            firsts.append(
                torch.arange(rows.start, rows.start + min(size, 1), device=device)
                if isinstance(rows, slice)
                else rows[:1]
            )
        self._micro, self._local = micro, local  # of each sample
        self.samples = samples
        self._reads: list[torch.Tensor] = []
        self._first = self.need(torch.cat(firsts).to(torch.int64))
        per_feature = lengths.view(len(kjt.keys()), stride).sum(1) if stride else lengths
        self._per_feature = self.need(per_feature.reshape(-1))

    @functools.cached_property
    def _indexed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each lookup's feature (position in the batch), micro-batch and place in it."""
        lengths, stride = self.kjt.lengths(), max(self.kjt.stride(), 1)
        bag = torch.repeat_interleave(
            torch.arange(len(lengths), device=lengths.device), lengths, output_size=len(self.values)
        )
        sample = bag % stride
        return bag // stride, self._micro[sample], self._local[sample]

    @property
    def feature(self) -> torch.Tensor:
        return self._indexed[0]

    @property
    def micro(self) -> torch.Tensor:
        return self._indexed[1]

    @property
    def local(self) -> torch.Tensor:
        return self._indexed[2]

    @functools.cached_property
    def by_value(self) -> torch.Tensor:
        """The lookups in id order (stable): what every group's distinct rows start from."""
        return torch.sort(self.values, stable=True).indices

    @functools.cached_property
    def by_local(self) -> torch.Tensor:
        """The lookups by place in their micro-batch (stable): every group's bag order."""
        return torch.sort(self.local, stable=True).indices

    def need(self, sizes: torch.Tensor) -> int:
        """Ask for `sizes` (int64, 1-d, on the device) on the host; its index in `read`."""
        self._reads.append(sizes)
        return len(self._reads) - 1

    def read(self) -> list[list[int]]:
        """The one host read: every tensor asked for, as lists."""
        lengths = [len(t) for t in self._reads]
        flat = torch.cat(self._reads).tolist() if self._reads else []
        out, at = [], 0
        for n in lengths:
            out.append(flat[at : at + n])
            at += n
        return out

    def first_samples(self, host: list[list[int]]) -> list[int | None]:
        """Each micro-batch's first sample (None for an empty one)."""
        firsts = iter(host[self._first])
        return [next(firsts) if size else None for size in self._sizes]

    def feature_lengths(self, host: list[list[int]]) -> list[int]:
        """How many ids each feature of the batch holds."""
        return host[self._per_feature]


def route_distinct(
    kjt: KeyedJaggedTensor,
    distinct: dict[str, list[torch.Tensor]],
    first: list[int | None],
    feature_lengths: list[int],
) -> KeyedJaggedTensor:
    """What goes into TorchRec's input all-to-all: `kjt`, but each feature of `distinct`
    carries only each micro-batch's distinct ids, all in that micro-batch's first bag
    (`first`: each micro-batch's first sample), so the id exchange sends every
    distinct id once (the bag lengths still go, as before). `feature_lengths`: how many ids
    each feature of `kjt` holds (known on the host: nothing is read from the device)."""
    stride = kjt.stride()
    lengths, values = kjt.lengths().clone(), []
    for i, (f, part) in enumerate(
        zip(kjt.keys(), kjt.values().split(feature_lengths), strict=True)
    ):
        if f not in distinct:
            values.append(part)
            continue
        lens = lengths[i * stride : (i + 1) * stride]
        lens.zero_()
        held = []
        for at, ids in zip(first, distinct[f], strict=True):
            if len(ids):  # a micro-batch with ids has samples: its first one holds them
                lens[at] = len(ids)
                held.append((at, ids))
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
        grads: bool = True,
    ) -> None:
        """`columns`: where each of this rank's features sits in its lookup's output;
        `grads`: the gradients go back as unique rows too (else pooled, bit for bit)."""
        self.pg = pg
        self.grads = grads
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
        if any(
            columns[f] != (columns[f][0], columns[f][0] + d) or columns[f][0] % d
            for f in features_per_rank[self.rank]
        ):
            raise NotImplementedError(
                f"pipeline.dedup: '{fqn}' lays its lookup's columns out in an unexpected "
                f"order ({columns}); use pipeline.dedup=false"
            )
        self.stats = stats  # counts rows sent (dedup_rows) and the bags they replace
        # what depends only on the layout (positions, columns, `_blocks`' index tensors)
        self._layout_cache: dict = {}

    # owner side: which single-id bags to look up, and where each block's rows are
    def owner_input(
        self,
        kjt: KeyedJaggedTensor,
        plan: ChunkPlan,
        state: DedupBatch,
        batched: bool | None = None,
    ) -> KeyedJaggedTensor:
        """The unique lookups of every (micro-batch, requester) block of this owner's
        stacked input (`route_distinct`'s: each block's distinct ids): feature f's bags are
        its blocks' ids, block after block ((micro-batch, requester) order), one id a bag;
        features with fewer pad with empty bags. On a GPU (`batched`) with one host read,
        the blocks' sizes; on a CPU in one pass (`_owner_in_one_pass`), the same output.
        Forward-only dedup (`grads=False`): `kjt` holds every id, and each block's distinct
        ones are worked out here, in that one pass."""
        names = self.features[self.rank]
        if not names:
            return kjt
        if list(kjt.keys()) != names:
            raise RuntimeError(f"pipeline.dedup: input features {kjt.keys()} != shard {names}")
        if not self.grads or not (
            kjt.values().device.type != "cpu" if batched is None else batched
        ):
            return self._owner_in_one_pass(kjt, plan, state)
        values, lengths, stride = kjt.values(), kjt.lengths(), kjt.stride()
        device, f, blocks = values.device, len(names), plan.n * self.world
        block = torch.full((stride,), blocks, dtype=torch.int64, device=device)
        for k in range(plan.n):
            for s in range(self.world):
                block[plan.rows(s, k)] = k * self.world + s
        bag = torch.repeat_interleave(
            torch.arange(len(lengths), device=device), lengths, output_size=len(values)
        )
        feature = bag // max(stride, 1)
        g = block[bag % max(stride, 1)]
        # each feature's ids block after block (within a block, the one bag holding them)
        by_feature = torch.sort(feature * (blocks + 1) + g, stable=True).indices
        counts = torch.zeros(f * (blocks + 1), dtype=torch.int64, device=device)
        counts = counts.scatter_add_(0, feature * (blocks + 1) + g, torch.ones_like(g))
        per_feature_dev = counts.view(f, blocks + 1).sum(1)  # ids of each feature
        starts = torch.cumsum(per_feature_dev, 0) - per_feature_dev
        bag_of = torch.empty_like(by_feature)  # each id's bag among its feature's
        bag_of[by_feature] = torch.arange(len(values), device=device) - starts[feature[by_feature]]
        # each block's ids in its order: feature by feature, as its requester sorted them
        by_block = torch.sort(g * f + feature, stable=True).indices
        position = self._columns(names, device)
        where_bag, where_col = bag_of[by_block], position[feature[by_block]]
        host = torch.cat([counts, per_feature_dev]).tolist()  # the one host read
        counts_of, used = host[: f * (blocks + 1)], host[f * (blocks + 1) :]
        ids, at = values[by_block], 0
        for k in range(plan.n):
            sent, where = [], []
            for s in range(self.world):
                b = k * self.world + s
                per_feature = [counts_of[i * (blocks + 1) + b] for i in range(f)]
                size = sum(per_feature)
                sent.append(_Block(ids[at : at + size], per_feature))
                where.append((where_bag[at : at + size], where_col[at : at + size]))
                at += size
                self.stats["dedup_rows"] += size
                self.stats["dedup_bags"] += plan.sizes[s][k] * f
            state.sent.append(sent)
            state.where.append(where)
        width = max(max(used), 1)
        bags = torch.arange(width, device=device)[None, :] < per_feature_dev[:, None]
        lengths = bags.reshape(-1).to(lengths.dtype)
        return KeyedJaggedTensor(
            keys=names, values=values[by_feature], lengths=lengths, stride=width
        )

    def _owner_in_one_pass(
        self, kjt: KeyedJaggedTensor, plan: ChunkPlan, state: DedupBatch
    ) -> KeyedJaggedTensor:
        """`owner_input` on a CPU (a size read there waits for nothing), every (micro-batch,
        requester) block in one pass; also forward-only dedup's, whose blocks' distinct
        ids it works out from every id routed."""
        names, device = self.features[self.rank], kjt.values().device
        f = len(names)
        samples = [plan.rows(s, k) for k in range(plan.n) for s in range(self.world)]
        ids, group, counts = _owner_blocks(kjt, f, samples, distinct=not self.grads)
        flat = counts.reshape(-1)
        feature = group % f
        # each row's bag among its feature's: its feature's rows in earlier blocks, then its
        # place among its block's (less the (block, feature)'s first row)
        earlier = (torch.cumsum(counts, 0) - counts).reshape(-1) - (torch.cumsum(flat, 0) - flat)
        bag = earlier[group] + torch.arange(len(ids), device=device)
        used = counts.sum(0)
        values = torch.empty_like(ids)
        values[(torch.cumsum(used, 0) - used)[feature] + bag] = ids  # feature by feature
        column = self._columns(names, device)[feature]
        host = torch.cat([flat, used]).tolist()  # the one host read
        per_block = [sum(host[b * f : (b + 1) * f]) for b in range(len(samples))]
        rows = iter(
            zip(ids.split(per_block), bag.split(per_block), column.split(per_block), strict=True)
        )
        for k in range(plan.n):
            blocks, where = [], []
            for s in range(self.world):
                b = k * self.world + s
                block_ids, block_bag, block_column = next(rows)
                blocks.append(_Block(block_ids, host[b * f : (b + 1) * f]))
                where.append((block_bag, block_column))
                self.stats["dedup_rows"] += len(block_ids)
                self.stats["dedup_bags"] += plan.sizes[s][k] * f
            state.sent.append(blocks)
            state.where.append(where)
        stride = max(max(host[len(flat) :]), 1)
        lengths = (torch.arange(stride, device=device)[None, :] < used[:, None]).reshape(-1)
        lengths = lengths.to(kjt.lengths().dtype)
        return KeyedJaggedTensor(keys=names, values=values, lengths=lengths, stride=stride)

    def _columns(self, names: list[str], device: torch.device) -> torch.Tensor:
        """Each of this owner's features' column block in its lookup's output."""
        key = ("columns", device)
        if key not in self._layout_cache:
            d = self.dim[self.rank]
            self._layout_cache[key] = torch.tensor(
                [self.columns[n][0] // d for n in names], device=device
            )
        return self._layout_cache[key]

    # requester side: the same blocks, from this rank's own batch
    def _positions(
        self, keys: list[str], device: torch.device, owned: bool = False
    ) -> list[torch.Tensor]:
        """Per owner: each feature of the batch's position among the owner's features, or
        the owner's feature count where it holds none (`owned`: the positions in the batch
        of the owner's features); made once (a host-to-device copy)."""
        key = (tuple(keys), device, owned)
        if key not in self._layout_cache:
            if owned:
                at = [[keys.index(f) for f in names] for names in self.features]
            else:
                at = [
                    [names.index(f) if f in names else len(names) for f in keys]
                    for names in self.features
                ]
            self._layout_cache[key] = [
                torch.tensor(a, dtype=torch.int64, device=device) for a in at
            ]
        return self._layout_cache[key]

    def requester_input(
        self, lookups: BatchLookups, state: DedupBatch, batched: bool | None = None
    ) -> Callable:
        """Each micro-batch's distinct rows from each owner, and how its bags pool from
        them: on a GPU (`batched`) for every micro-batch and owner at once on the device, on
        a CPU one `unique` over every owner's features' lookups (`_blocks`; a host read
        costs nothing there); the same blocks either way. Returns what
        fills `state.received` once `lookups.read()` has brought the blocks' sizes to the
        host."""
        n, values = lookups.n, lookups.values
        device = values.device
        if not (device.type != "cpu" if batched is None else batched):
            keys = self._positions(lookups.kjt.keys(), device, owned=True)
            received = _blocks(lookups.kjt, keys, lookups.samples, self._layout_cache)
            return lambda host: setattr(state, "received", received)
        found = []  # per owner: (features, ids, inverse, target, distinct and lookup sizes)
        for o, position in enumerate(self._positions(lookups.kjt.keys(), device)):
            f = len(self.features[o])
            if not f:
                found.append(None)
                continue
            p = position[lookups.feature]
            owned = (p < f) & (lookups.micro < n)
            group = torch.where(owned, lookups.micro * f + p, n * f)  # n * f: none of its
            # distinct rows: lookups sorted by (block, feature, id), a row where one starts
            by_id = lookups.by_value[torch.sort(group[lookups.by_value], stable=True).indices]
            g, v = group[by_id], values[by_id]
            new = torch.ones_like(g, dtype=torch.bool)
            new[1:] = (g[1:] != g[:-1]) | (v[1:] != v[:-1])
            row = torch.cumsum(new, 0) - 1
            ids = values.new_zeros(len(values)).scatter_(0, row, v)
            inverse = torch.empty_like(row)
            inverse[by_id] = row
            # the block's lookups in its bags' order: feature, sample, place in the bag
            order = lookups.by_local[torch.sort(group[lookups.by_local], stable=True).indices]
            target = (lookups.local * f + p)[order]
            zeros = torch.zeros(n * f + 1, dtype=torch.int64, device=device)
            rows = lookups.need(zeros.scatter_add(0, g, new.to(torch.int64))[:-1])
            count = lookups.need(zeros.scatter_add(0, group, torch.ones_like(group))[:-1])
            found.append((f, ids, inverse[order], target, rows, count))

        def finish(host: list[list[int]]) -> None:
            state.received = [[] for _ in range(n)]
            none = torch.zeros(0, dtype=torch.int64, device=device)
            for owner in found:
                if owner is None:  # an owner with no table of this group
                    for k in range(n):
                        state.received[k].append(_Block(none, [], none, none))
                    continue
                f, ids, inverse, target, rows, count = owner
                at_row = at_lookup = 0
                for k in range(n):
                    counts = host[rows][k * f : (k + 1) * f]
                    size, lookups_k = sum(counts), sum(host[count][k * f : (k + 1) * f])
                    end = at_lookup + lookups_k
                    state.received[k].append(
                        _Block(
                            ids[at_row : at_row + size],
                            counts,
                            inverse[at_lookup:end] - at_row,
                            target[at_lookup:end],
                        )
                    )
                    at_row, at_lookup = at_row + size, end

        return finish

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
            recv,
            data,
            output_split_sizes=recv_sizes,
            input_split_sizes=[len(t) for t in send],
            group=self.pg,
            async_op=True,
        )
        return recv, work

    def forward(self, out: torch.Tensor, state: DedupBatch, k: int, b: int) -> Pending:
        """Send each requester its block's rows of `out` (the unique lookups' output);
        receive mine and pool my `b` samples' bags: b x (every owner's F x D)."""
        rows = self._rows(out) if self.features[self.rank] else None
        send = [
            rows[state.where[k][s]].reshape(-1) if rows is not None else out.new_empty(0)
            for s in range(self.world)
        ]
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
                if blk.gather is not None:  # one id a bag: each bag is its row
                    bags = rows.index_select(0, blk.gather)
                else:
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
        recv_sizes = (
            [len(state.sent[k][s].ids) * d for s in range(self.world)]
            if self.features[self.rank]
            else [0] * self.world
        )
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
