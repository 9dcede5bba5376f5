"""A lower bound on the step time of any plan, under the cost model (`sharding.cost_model`).

No placement, replication or batch split of the tables can step faster than
`lower_bound_ms(inputs)` under the schedule `inputs.schedule`. It is the sum of:
- lookups: every table's forward, then its backward with the dense all-reduce crossing
  under it (nested micro-batches: under both), each from fast memory spread perfectly over
  the cluster's embedding speed for that pass; batch assembly likewise; the smallest fixed
  overhead;
- feeding the batch (GPU ranks: host work and the copy to the device), spread perfectly
  over the ranks: added in the plain loop, a floor under pipelined schedules;
- the larger of two bounds on dense work plus the exposed embedding exchange:
  - rank level: on the rank with the largest batch b, dense work runs at best at the fastest
    device's speed (and no split capped at b beats `capped_time`), and it exchanges at least
    b (B - b) / B x (bytes per sample of every exchanged table), whatever it owns, over
    its two links together (intra- and inter-node: max(x / u, y / v) >= (x + y) / (u + v));
  - node level: a node m with batch share x_m runs its dense work at best split over its
    own devices, and its ranks send or receive across nodes at least x_m (1 - x_m) B x the
    same bytes per sample, over their NIC shares. The least over all shares x of the
    slowest node is found by water-filling over a grid of x.
Per table, the bytes per sample are dim x (1 for TorchRec's pooled exchange; lookups x
(1 - coverage(h)) for a cold part exchanged alone; 0 replicated whole), replicating the
hottest h rows costs their gradients' ring all-reduce, and a cold part exchanged alone costs
each rank the pooling of its own samples' cold lookups (at the cheapest device's rate):
each table takes its cheapest h (`_Exchanged`). A plan that splits any table also pays the
sequence exchange's fixed cost once: the bound is the lesser of the two cases. b, h and x
are searched on grids where each interval is charged its cheapest end, so the result stays
a bound; the property tests in tests/unit/test_planners.py check it against random plans.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from sharding.batch_split import capped_time, dense_s_per_sample
from sharding.cost_model import allreduce_s, exposed_exchange_passes, ranks_per_node, ring_bytes
from sharding.memory import input_bytes_per_sample
from sharding.types import FLOAT_BYTES, Schedule

if TYPE_CHECKING:
    from sharding.types import PlanInputs


def lookup_rates(inputs: PlanInputs) -> list[float]:
    """Per rank: bytes a second it looks up, forward and backward, from fast memory."""
    return [d.emb_read_bytes_per_s / (1 + d.emb_bwd_factor) for d in inputs.devices]


def _emb_bytes(inputs: PlanInputs) -> float:
    return sum(
        inputs.global_batch * t.lookups_per_sample * t.dim * t.weight_bytes for t in inputs.tables
    )


def lookups_spread_s(inputs: PlanInputs) -> float:
    """Every table's lookups (forward and backward, from fast memory) spread perfectly over
    the cluster's total embedding speed: no placement looks them up sooner."""
    return _emb_bytes(inputs) / sum(lookup_rates(inputs))


def lookups_and_reduce_s(inputs: PlanInputs, allreduce: float) -> float:
    """The lookups forward, then their backward with the dense all-reduce crossing under it
    (`StepCost.backward_tail_s`), each pass spread perfectly over the cluster's speed for
    it: a step's slowest rank at each pass takes at least that, so no plan is quicker.
    Under nested micro-batches the all-reduce crosses under both passes (the update and
    the next batch's lookups, `StepCost.critical_path_s`): the longer of the two. Either
    way at most `lookups_spread_s` + `allreduce`."""
    if inputs.schedule == Schedule.nested and inputs.micro_batches > 1:
        return max(lookups_spread_s(inputs), allreduce)
    emb = _emb_bytes(inputs)
    fwd = emb / sum(d.emb_read_bytes_per_s for d in inputs.devices)
    bwd = emb / sum(
        d.emb_read_bytes_per_s / d.emb_bwd_factor if d.emb_bwd_factor > 0 else math.inf
        for d in inputs.devices
    )
    return fwd + max(bwd, allreduce)


def lower_bound_ms(inputs: PlanInputs) -> float:
    devs = inputs.devices
    per_sample_s = [d.input_s_per_sample + d.sample_overhead_s for d in devs]
    per_sample = 0.0
    if all(c > 0 for c in per_sample_s):
        per_sample = inputs.global_batch / sum(1 / c for c in per_sample_s)
    per_node = ranks_per_node([r.node for r in inputs.ranks])
    allreduce = allreduce_s(
        inputs.dense_params * FLOAT_BYTES, inputs.world, inputs.network, per_node
    )
    overhead = min(d.step_overhead_s for d in devs)
    dense_and_exchange = bound_guide(inputs).ms / 1000
    device = lookups_and_reduce_s(inputs, allreduce) + dense_and_exchange + per_sample + overhead
    serial, ahead = _feed_bound_s(inputs)
    if inputs.schedule == Schedule.plain:
        return 1000 * (device + serial)
    return 1000 * max(device, ahead)


def _feed_bound_s(inputs: PlanInputs) -> tuple[float, float]:
    """The least, over batch splits, of the slowest rank's host work plus copy, and of the
    longer of the slowest host work and the slowest copy (`StepCost.feed_s`): no split
    feeds the batch faster than every rank finishing together, B / sum_r (1 / c_r)."""
    if inputs.cpu:
        return 0.0, 0.0
    per_sample = input_bytes_per_sample(inputs)
    copy = [per_sample / d.host_read_bytes_per_s for d in inputs.devices]
    host = [d.host_s_per_sample for d in inputs.devices]

    def level(c: list[float]) -> float:
        return inputs.global_batch / sum(1 / x for x in c) if all(x > 0 for x in c) else 0.0

    serial = level([a + b for a, b in zip(host, copy, strict=True)])
    return serial, max(level(host), level(copy))


@dataclass
class BoundGuide:
    """Where the bound's relaxation is tight, as a hint for planners: its dense work plus
    exchange (`ms`), the batch split and prices at its optimum. A plan near the bound has
    about these batch shares and replicates per table the rows `hot_rows` picks."""

    ms: float
    split: bool  # the optimum splits tables (cold parts exchanged alone)
    node_shares: dict[int, float] = field(default_factory=dict)  # node -> its batch share
    largest_batch: float = 0.0  # one node: the largest batch of any rank
    price: float = 0.0  # seconds per float per sample exchanged, at the optimum
    pooled: float = 0.0  # samples whose cold lookups the busiest rank pools
    phi: _Exchanged | None = None

    def hot_rows(self) -> dict[str, int]:
        """Per table, the replicated rows that the bound's optimum takes at its prices."""
        return self.phi.choose(self.price, self.pooled) if self.phi else {}


def bound_guide(inputs: PlanInputs) -> BoundGuide:
    """The bound's dense-and-exchange part and where it is attained (`bound_guides`)."""
    return bound_guides(inputs)[0]


def bound_guides(inputs: PlanInputs) -> list[BoundGuide]:
    """A plan splits no table (no sequence exchange at all), or it does and pays the
    sequence exchange's fixed cost once; in the cheaper case, the larger of the rank- and
    node-level bounds (the bound) first, then the other level (a second hint)."""
    cases = [(_Exchanged(inputs, split=False), 0.0)]
    if inputs.cold_only_exchange and inputs.world > 1:
        fixed = min(d.sequence_s_fixed for d in inputs.devices)
        cases.append((_Exchanged(inputs, split=True), fixed))
    best: list[BoundGuide] = []
    for phi, fixed in cases:
        levels = sorted([_rank_level(inputs, phi), _node_level(inputs, phi)], key=lambda g: -g.ms)
        for g in levels:
            g.ms, g.phi, g.split = 1000 * (g.ms + fixed), phi, phi.split
        if not best or levels[0].ms < best[0].ms:
            best = levels
    return best


class _Exchanged:
    """phi(c, s): the least, over every table's replicated rows h, of c x (floats per sample
    the table still exchanges) + (seconds of its replicated rows' all-reduce) + s x (seconds
    per sample of pooling its cold lookups after a sequence exchange, at the cheapest
    device's rate). `split`: tables may keep a hot part and exchange the cold rest alone
    (else only whole-table replication). Increasing in c and s."""

    def __init__(self, inputs: PlanInputs, split: bool) -> None:
        w = inputs.world
        self.split = split
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.rows: dict[str, np.ndarray] = {}  # per table, the replicated rows of each part
        if w < 2:
            return
        ar_s = ring_bytes(FLOAT_BYTES, w) / inputs.network.allreduce.bytes_per_s
        seq_lookup = np.array([d.sequence_s_per_lookup for d in inputs.devices])
        seq_byte = np.array([d.sequence_s_per_byte for d in inputs.devices])
        for t in inputs.tables:
            h = np.unique(np.concatenate([[0], np.geomspace(1, t.rows, 100).round(), [t.rows]]))
            cov = np.array([inputs.coverage[t.name](int(k)) for k in h])
            whole = (h == 0) | (h == t.rows)
            share = np.where(whole, 1.0, np.minimum(1.0, t.lookups_per_sample * (1 - cov)))
            share[h == t.rows] = 0.0  # replicated whole: nothing exchanged
            seq = float(np.min(seq_lookup + t.dim * FLOAT_BYTES * seq_byte))
            pool = np.where(whole, 0.0, (1 - cov) * t.lookups_per_sample * seq)
            if not split:  # two options only: exchanged whole, or replicated whole
                h, share = np.array([0, t.rows]), np.array([1.0, 0.0])
                self.parts.append((share * t.dim, ar_s * h * t.dim, np.zeros(2)))
                self.rows[t.name] = h
                continue
            # interval [h_i, h_i+1]: exchange and pooling at its hot end, all-reduce at its
            # cold end (both shrink with more hot rows, the all-reduce grows)
            nxt = lambda x: np.append(x[1:], x[-1])  # noqa: E731
            self.parts.append(
                (
                    np.minimum(share, nxt(share)) * t.dim,
                    ar_s * h * t.dim,
                    np.minimum(pool, nxt(pool)),
                )
            )
            self.rows[t.name] = h

    def choose(self, c: float, s: float) -> dict[str, int]:
        """Per table, the replicated rows of its cheapest part at prices c and s."""
        return {
            name: int(h[np.argmin(c * vol + ar + s * pool)])
            for name, h, (vol, ar, pool) in zip(
                self.rows, self.rows.values(), self.parts, strict=True
            )
        }

    def __call__(self, c: np.ndarray, s: np.ndarray) -> np.ndarray:
        c, s = np.atleast_1d(c)[:, None], np.atleast_1d(s)[:, None]
        out = np.zeros(len(c))
        for vol, ar, pool in self.parts:
            out += (c * vol[None, :] + ar[None, :] + s * pool[None, :]).min(axis=1)
        return out


def _rank_level(inputs: PlanInputs, phi: _Exchanged) -> BoundGuide:
    """min over the largest batch b of dense(b) + exchange(b) (module docstring)."""
    big_b, w = inputs.global_batch, inputs.world
    sample_s = dense_s_per_sample(inputs)
    # the largest batch b on a grid; on an interval [b_i, b_i+1] the dense stage is at
    # least the fastest rank's at b_i and the best split capped at b_i+1 (capped_time)
    b = np.unique(
        np.concatenate(
            [np.geomspace(math.ceil(big_b / w), big_b, 200).round(), [math.ceil(big_b / w), big_b]]
        )
    )
    b_hi = np.append(b[1:], b[-1])
    dense_at = np.maximum(b * sample_s.min(), capped_time(big_b, sample_s, b_hi))
    f = b * (big_b - b) / big_b  # concave: its minimum on an interval is at an end
    f_min = np.minimum(f, b_hi * (big_b - b_hi) / big_b)
    if w < 2:
        i = int(np.argmin(dense_at))
        return BoundGuide(float(dense_at[i]), False, largest_batch=float(b[i]))
    net = inputs.network
    links = net.alltoall.bytes_per_s
    if len({r.node for r in inputs.ranks}) > 1:
        links += net.intra_alltoall.bytes_per_s  # both links at once, at best
    passes = exposed_exchange_passes(inputs.schedule, inputs.micro_batches)
    c = f_min * passes * FLOAT_BYTES / links
    # the largest-batch rank pools at least its own b samples' cold lookups
    total = dense_at + phi(c, b)
    i = int(np.argmin(total))
    return BoundGuide(
        float(total[i]), phi.split, largest_batch=float(b[i]), price=float(c[i]), pooled=float(b[i])
    )


def _node_level(inputs: PlanInputs, phi: _Exchanged) -> BoundGuide:
    """min over node batch shares x of (the slowest node's dense work) + (the exchange of
    the rank that exchanges most); 0 on one node.

    Node m with share x runs dense work at best B x D_m (its devices in perfect balance).
    Its ranks send or receive across nodes at least x (1 - x) B / L_m floats per float per
    sample exchanged, and its busiest rank (a batch between x B / L_m and x B) at least
    b (B - b) / B over both its links: the larger of the two prices the node's exchange
    (c_m(x)); its ranks pool at least x B / L_m samples' cold lookups (s_m(x)). For a dense
    level T every node has x_m <= u_m = T / (B D_m); the least max_m c_m(x_m) and the least
    max_m s_m(x_m) over shares summing to 1 under those caps (each by bisection on its
    level) bound the exchange from below, since phi increases in both. T is searched on a
    grid, each interval charged its cheapest end."""
    # Long (70 lines with this derivation): one argument, whose terms the code follows in
    # order; its closures share the grid, so split apart they would pass it all around.
    nodes = sorted({r.node for r in inputs.ranks})
    if len(nodes) < 2:
        return BoundGuide(0.0, phi.split)
    big_b = inputs.global_batch
    sample_s = dense_s_per_sample(inputs)
    passes = exposed_exchange_passes(inputs.schedule, inputs.micro_batches)
    net = inputs.network
    per_float = passes * FLOAT_BYTES * big_b / net.alltoall.bytes_per_s
    both = (
        passes * FLOAT_BYTES * big_b / (net.alltoall.bytes_per_s + net.intra_alltoall.bytes_per_s)
    )
    ranks = np.array([sum(r.node == m for r in inputs.ranks) for m in nodes], dtype=np.float64)
    dense = np.array(
        [1.0 / np.sum(1.0 / sample_s[[r.node == m for r in inputs.ranks]]) for m in nodes]
    )  # seconds per sample, in perfect balance
    t_min = big_b / np.sum(1.0 / dense)
    t_max = big_b * dense.max()  # the slowest node alone: every cap is 1
    levels = np.unique(
        np.concatenate([t_min * np.geomspace(1.0, 2.0, 120), np.geomspace(t_min, t_max, 240)])
    )
    caps = np.minimum(1.0, levels[:, None] / (big_b * dense[None, :]))  # u_m(T)
    fastest = np.array([sample_s[[r.node == m for r in inputs.ranks]].min() for m in nodes])
    # the busiest rank's batch, as a share of B, is at most what its dense work allows
    tau = levels[:, None] / (big_b * fastest[None, :])

    def price_of(x: np.ndarray) -> np.ndarray:
        """c_m(x) for shares x (levels x nodes)."""
        inter = per_float / ranks * x * (1 - x)
        y, top = x / ranks, np.minimum(x, tau)  # the busiest rank's batch lies in [y, top]
        rank = both * np.minimum(y * (1 - y), top * (1 - top))
        return np.maximum(inter, rank)

    def reach_c(lam: np.ndarray) -> np.ndarray:
        """Per level, the largest total share with every c_m(x_m) <= lam within the caps:
        the feasible x form intervals that end at the cap or at a smaller root."""
        one = np.ones_like(ranks)
        ends = [
            caps,
            tau,
            _root(lam, per_float / ranks, one),
            _root(lam, both * one, ranks),
            _root(lam, both * one, one),
        ]
        best = np.zeros_like(caps)
        for end in ends:
            x = np.minimum(end, caps)
            ok = price_of(x) <= lam[:, None] * (1 + 1e-9) + 1e-300
            best = np.where(ok, np.maximum(best, x), best)
        return best.sum(axis=1)

    def reach_s(sig: np.ndarray) -> np.ndarray:
        return np.minimum(caps, sig[:, None] * ranks[None, :] / big_b).sum(axis=1)

    price = _least(reach_c, max(per_float, both) / 4, len(levels))
    pooled = _least(reach_s, float(big_b), len(levels))
    # interval [T_i, T_i+1]: dense at its low end, exchange at its high end (more room)
    nxt = lambda x: np.append(x[1:], x[-1])  # noqa: E731
    total = levels + phi(nxt(price), nxt(pooled))
    i = int(np.argmin(total))
    j = min(i + 1, len(levels) - 1)
    x = _shares_at(float(nxt(price)[i]), caps[j], per_float / ranks, both, ranks)
    shares = {m: float(x[q]) for q, m in enumerate(nodes)}
    return BoundGuide(
        float(total[i]),
        phi.split,
        node_shares=shares,
        price=float(nxt(price)[i]),
        pooled=float(nxt(pooled)[i]),
    )


def _root(lam: np.ndarray, scale: np.ndarray, stretch: np.ndarray) -> np.ndarray:
    """The smaller x with scale * (x / stretch) (1 - x / stretch) = lam (inf: none)."""
    disc = 1 - 4 * lam[:, None] / scale[None, :]
    return np.where(disc < 0, np.inf, stretch[None, :] * (1 - np.sqrt(np.maximum(disc, 0))) / 2)


def _least(reach: Callable[[np.ndarray], np.ndarray], top: float, n: int) -> np.ndarray:
    """Per level (n of them), by bisection, the least price whose `reach` covers share 1."""
    lo, hi = np.zeros(n), np.full(n, top)
    for _ in range(60):
        mid = (lo + hi) / 2
        ok = reach(mid) >= 1.0 - 1e-12
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return lo  # a level no larger than the least feasible one: still a bound


def _shares_at(
    price: float, caps: np.ndarray, inter: np.ndarray, both: float, ranks: np.ndarray
) -> np.ndarray:
    """Node shares at the optimum: each node up to what the price allows (the smaller root);
    the rest to one node, the one with the most room (only one node can hold over half)."""
    lam, one = np.array([price]), np.ones_like(ranks)
    x = np.minimum(
        caps, np.minimum.reduce([_root(lam, inter, one)[0], _root(lam, both * one, ranks)[0]])
    )
    big = int(np.argmax(caps - x))
    x[big] = 0.0
    x[big] = max(0.0, 1 - x.sum())
    return x / x.sum()
