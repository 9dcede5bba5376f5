"""Dedup's blocks (`pipelines/dedup.py`) worked out for every micro-batch and owner at once
on the device (what a GPU runs), with one host read a side a step: the same blocks, bit for
bit, as the one-pass computation a CPU runs, on random batches with empty bags,
clustering orders, a column-split feature and an owner without tables; and no other host
read (`.tolist()`, `int(t)`, `unique`, ...) whatever the number of micro-batches and
owners."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from pipelines.dedup import BatchLookups, DedupBatch, DedupExchange, _Block, route_distinct
from pipelines.exchange import ChunkPlan

FEATURES = ["a", "b", "c", "d"]
# owner 0: a, b; owner 1: c and half of a's columns (a column-split table); owner 2: none
OWNED = [["a", "b"], ["c", "a"], []]
DIM = 4


def _exchange(rank: int) -> DedupExchange:
    """A DedupExchange as rank `rank` of OWNED builds it, without a process group."""
    ex = DedupExchange.__new__(DedupExchange)
    ex.pg, ex.rank, ex.world, ex.features = None, rank, len(OWNED), OWNED
    ex.columns = {f: (i * DIM, (i + 1) * DIM) for i, f in enumerate(OWNED[rank])}
    ex.dim = [DIM if names else 0 for names in OWNED]
    ex.stats, ex._layout_cache = {"dedup_rows": 0, "dedup_bags": 0}, {}
    ex.grads = True  # the gradients as unique rows too: the routed ids are distinct
    return ex


def _batch(gen: torch.Generator, batch: int, bags: str = "multi") -> KeyedJaggedTensor:
    """Bags of 0 to 4 ids ("multi"), every bag empty ("empty") or one id each ("one")."""
    if bags == "one":
        lengths = torch.ones(len(FEATURES) * batch, dtype=torch.int32)
    else:
        top = 1 if bags == "empty" else 5
        lengths = torch.randint(0, top, (len(FEATURES) * batch,), generator=gen, dtype=torch.int32)
    values = torch.randint(0, 12, (int(lengths.sum()),), generator=gen)  # many repeats
    return KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths, stride=batch)


def _samples(gen: torch.Generator, batch: int, n: int, clustered: bool) -> list:
    plan = ChunkPlan([batch], n, [torch.randperm(batch, generator=gen)] if clustered else None)
    return [plan.samples(0, k) for k in range(n)]


def _requester(
    kjt: KeyedJaggedTensor, samples: list, batched: bool = True
) -> tuple[DedupBatch, KeyedJaggedTensor]:
    """The requester side as a GPU runs it (batched) or a CPU (one `unique` per owner)."""
    ex, state = _exchange(0), DedupBatch()
    lookups = BatchLookups(kjt, samples)
    finish = ex.requester_input(lookups, state, batched=batched)
    host = lookups.read()
    finish(host)
    routed = route_distinct(
        kjt, ex.distinct(state), lookups.first_samples(host), lookups.feature_lengths(host)
    )
    return state, routed


def _same_block(got: _Block, want: _Block, fields: tuple[str, ...]) -> None:
    assert got.counts == want.counts
    for name in fields:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize(
    "n, clustered, bags",
    [
        (1, False, "multi"),
        (3, False, "multi"),
        (4, True, "multi"),
        (2, True, "empty"),
        (3, False, "one"),
        (4, True, "one"),
    ],
)
def test_the_requesters_blocks_are_the_per_block_ones(n: int, clustered: bool, bags: str):
    gen = torch.Generator().manual_seed(n)
    for _ in range(5):
        kjt = _batch(gen, 13, bags)
        samples = _samples(gen, 13, n, clustered)
        state, routed = _requester(kjt, samples)
        want = _requester(kjt, samples, batched=False)[0].received
        for k in range(n):
            for o in range(len(OWNED)):
                cpu = want[k][o]
                _same_block(state.received[k][o], cpu, ("ids", "inverse", "target"))
                # one id a bag: the CPU pools each bag by a gather, the sum's result
                assert (cpu.gather is not None) == (bags == "one")
                if cpu.gather is not None:
                    rows = torch.randn(len(cpu.ids), DIM, generator=gen)
                    summed = torch.zeros(len(cpu.gather), DIM).index_add_(
                        0, cpu.target, rows[cpu.inverse]
                    )
                    assert torch.equal(rows[cpu.gather], summed)
        # what is routed: each micro-batch's distinct ids, in its first sample's bag
        for f in ("a", "b", "c"):
            o = next(o for o, names in enumerate(OWNED) if f in names)
            bags = routed[f].to_dense()
            for k, rows in enumerate(samples):
                ids = want[k][o].ids.split(want[k][o].counts)[OWNED[o].index(f)]
                first = rows.start if isinstance(rows, slice) else int(rows[0])
                assert torch.equal(bags[first], ids)  # an empty one: its bag stays empty
            assert sum(len(b) for b in bags) == sum(
                len(want[k][o].ids.split(want[k][o].counts)[OWNED[o].index(f)]) for k in range(n)
            )
        assert torch.equal(routed["d"].values(), kjt["d"].values())  # not deduped: as it was


def _owner_input(gen: torch.Generator, plan: ChunkPlan, names: list[str]) -> KeyedJaggedTensor:
    """An owner's stacked input as route_distinct sends it: each block's distinct ids,
    sorted, in the first bag of the block's samples."""
    stride = sum(plan.batch_per_rank)
    lengths = torch.zeros(len(names), stride, dtype=torch.int32)
    values: list[list[torch.Tensor]] = [[] for _ in names]
    firsts = []
    for k in range(plan.n):
        for s in range(len(plan.batch_per_rank)):
            rows = plan.rows(s, k)
            first = rows.start if isinstance(rows, slice) else int(rows[0])
            for f in range(len(names)):
                ids = torch.unique(
                    torch.randint(
                        0, 30, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen
                    )
                )
                lengths[f, first] = len(ids)
                firsts.append((f, first, ids))
    for f, _first, ids in sorted(firsts, key=lambda x: (x[0], x[1])):
        values[f].append(ids)
    flat = torch.cat([torch.cat(v) if v else torch.zeros(0, dtype=torch.int64) for v in values])
    return KeyedJaggedTensor(keys=names, values=flat, lengths=lengths.reshape(-1), stride=stride)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("n, clustered", [(1, False), (3, False), (4, True)])
def test_the_owners_lookups_are_the_per_block_ones(rank: int, n: int, clustered: bool) -> None:
    gen = torch.Generator().manual_seed(10 * n + rank)
    batches = [13, 9, 11]
    orders = [torch.randperm(b, generator=gen) for b in batches] if clustered else None
    plan = ChunkPlan(batches, n, orders)
    ex = _exchange(rank)
    kjt = _owner_input(gen, plan, OWNED[rank])
    state, want_state = DedupBatch(), DedupBatch()
    got = ex.owner_input(kjt, plan, state, batched=True)
    stats = dict(ex.stats)
    want = _exchange(rank).owner_input(kjt, plan, want_state, batched=False)
    assert got.stride() == want.stride() and got.keys() == want.keys()
    assert torch.equal(got.values(), want.values())
    assert torch.equal(got.lengths().int(), want.lengths())
    for k in range(n):
        for s in range(len(batches)):
            _same_block(state.sent[k][s], want_state.sent[k][s], ("ids",))
            for a, b in zip(state.where[k][s], want_state.where[k][s], strict=True):
                assert torch.equal(a, b)
    assert stats["dedup_rows"] == len(kjt.values())
    assert stats["dedup_bags"] == sum(batches) * len(OWNED[rank])


@pytest.mark.parametrize(
    "n, clustered, one_hot",
    [(1, False, False), (3, False, False), (4, True, False), (3, False, True), (4, True, True)],
)
def test_forward_only_owners_work_each_blocks_distinct_rows_out_of_every_id(
    n: int, clustered: bool, one_hot: bool
) -> None:
    """`dedup_grads=false`: the owner gets every id (TorchRec's routing), and its blocks
    hold each (micro-batch, requester) block's distinct ids per feature, sorted, the ones
    its requester pools from; its unique lookups' bag `where` names holds that id. Bags of
    0 to 4 ids, or one each."""
    gen = torch.Generator().manual_seed(n)
    batches = [13, 9, 11]
    plan = ChunkPlan(
        batches, n, [torch.randperm(b, generator=gen) for b in batches] if clustered else None
    )
    names = OWNED[0]
    lengths = torch.randint(0, 5, (len(names) * sum(batches),), generator=gen, dtype=torch.int32)
    if one_hot:
        lengths = torch.ones_like(lengths)
    kjt = KeyedJaggedTensor(
        keys=names,
        values=torch.randint(0, 12, (int(lengths.sum()),), generator=gen),
        lengths=lengths,
        stride=sum(batches),
    )
    ex, state = _exchange(0), DedupBatch()
    ex.grads = False
    unique = ex.owner_input(kjt, plan, state)
    assert ex.stats["dedup_rows"] < len(kjt.values())  # repeats were removed
    for k in range(n):
        for s in range(len(batches)):
            rows = plan.rows(s, k)
            got = state.sent[k][s]
            for f, name in enumerate(names):
                jt = kjt[name]
                bags = jt.to_dense()
                picked = [bags[i] for i in torch.arange(sum(batches))[rows].tolist()]
                want = torch.unique(torch.cat(picked)) if picked else torch.zeros(0)
                ids = got.ids.split(got.counts)[f]
                assert torch.equal(ids, want.to(ids.dtype)), (k, s, name)
            bag, column = state.where[k][s]
            looked = [
                unique[names[int(c)]].to_dense()[int(b)] for b, c in zip(bag, column, strict=True)
            ]
            assert all(len(t) == 1 for t in looked)
            assert torch.equal(torch.cat(looked) if looked else got.ids, got.ids)


# Calls that read a tensor's values on the host (on a GPU: wait for the device)
HOST_READS = {
    "tolist",
    "item",
    "__int__",
    "__index__",
    "__bool__",
    "__float__",
    "unique",
    "unique_consecutive",
    "nonzero",
    "bincount",
    "masked_select",
}


class _HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.calls.append(name)
        if name == "__getitem__" and isinstance(args[1], torch.Tensor):
            if args[1].dtype == torch.bool:  # a mask: its size is read
                self.calls.append("mask index")
        if name == "repeat_interleave" and "output_size" not in kwargs:
            self.calls.append("repeat_interleave without output_size")
        return func(*args, **kwargs)


@pytest.mark.parametrize("n", [1, 4])
def test_one_host_read_a_side_whatever_the_micro_batches(n: int) -> None:
    gen = torch.Generator().manual_seed(0)
    kjt = _batch(gen, 16)
    samples = _samples(gen, 16, n, clustered=True)
    with _HostReads() as reads:
        _requester(kjt, samples)
    assert reads.calls == ["tolist"]
    plan = ChunkPlan([16, 12, 8], n, [torch.randperm(b, generator=gen) for b in (16, 12, 8)])
    owner = _owner_input(gen, plan, OWNED[1])
    ex = _exchange(1)
    ex.owner_input(owner, plan, DedupBatch(), batched=True)  # its column positions, made
    with _HostReads() as reads:
        ex.owner_input(owner, plan, DedupBatch(), batched=True)
    assert reads.calls == ["tolist"]
