"""Planners: `hybrid` (ours), `greedy_size`, `round_robin`, and `torchrec` (TorchRec's own).

`hybrid` uses what the others ignore: the access frequency and each device's own speed.
1. Batch split: each rank's share of the global batch is proportional to its dense speed
   (Whale's hardware-aware data parallelism), instead of equal shares; then also shares
   capped where the largest-batch ranks' exchange costs more than the dense work it saves.
2. Hot rows replicated (HugeCTR's hybrid embedding): for each table the hottest h rows
   become a data-parallel part on every rank when the all-reduce of their gradients costs
   less than the all-to-all they save on the largest-batch rank; the cold rest then
   exchanges only its own lookups (a variable-length exchange). h comes from the table's
   coverage curve; h = rows is a small table replicated whole.
3. The rest is cut into pieces small enough to balance (column-wise; a cold part in row
   parts, each its own table), and placed longest first where the slowest rank ends
   fastest: each rank's lookups, dense work, and the larger of the bytes it sends and
   receives, never over its memory.
4. Tier: pieces that fit no device's fast memory go to host memory with an HBM cache of
   their hottest rows (sized by the coverage curve and the free HBM), else host memory.
The predicted step of the slowest rank is what this minimises, under each rank's capacity.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

import numpy as np

from sharding.cost_model import (
    FLOAT_BYTES,
    Shard,
    TableStats,
    Tier,
    exposed_exchange_passes,
    vectors_per_sample,
)
from sharding.plan_eval import (
    Plan,
    PlanDoesNotFitError,
    PlanInputs,
    TablePlan,
    capped_batch,
    check_fits,
    cold_part_rows,
    dense_s_per_sample,
    equal_batch,
    evaluate,
    proportional_batch,
)

MIN_COLS = 4  # TorchRec's column-wise shards keep dims that are multiples of 4
MAX_REPLICATED_SHARE = 0.3  # of the smallest rank's fast memory, for all hot rows together


@dataclass
class _Piece:
    table: TableStats
    rows: int
    cols: int
    lookup_share: float  # share of the table's lookups (1 - coverage of the hot part)
    sparse_exchange: bool
    part: int = 0  # a cold part's row part (cold row c in part c mod k)


class _Placer:
    """Longest-first placement of pieces on ranks, each with its own speed and memory."""

    def __init__(self, inputs: PlanInputs, batch: list[int], speed_aware: bool) -> None:
        self.inputs = inputs
        self.free_hbm = np.array(inputs.hbm_budget(), dtype=np.float64)
        self.free_host = np.array(inputs.host_budget(), dtype=np.float64)
        self.batch = batch
        self.speed_aware = speed_aware
        devs = inputs.devices
        # seconds per byte looked up (forward + backward) on each rank, fast and host memory
        self.per_byte = np.array([(1 + d.emb_bwd_factor) / d.emb_read_bytes_per_s for d in devs])
        self.per_byte_host = np.array(
            [(1 + d.emb_bwd_factor) / d.host_read_bytes_per_s for d in devs]
        )
        flops = 6.0 * inputs.dense_params + inputs.interaction_flops_per_sample
        self.load = np.array(
            [b * flops / d.dense_flops_per_s for b, d in zip(batch, devs, strict=True)]
        )
        if not speed_aware:  # a speed-blind planner sees every rank as rank 0
            self.per_byte[:] = self.per_byte[0]
            self.per_byte_host[:] = self.per_byte_host[0]
            self.load[:] = 0.0
        self.a2a_per_byte = 2.0 / inputs.network.alltoall.bytes_per_s  # forward + backward
        # exchange bytes per step of each rank: it sends its pieces' vectors to the others'
        # samples and receives, for its own samples, those of every piece it does not hold
        self.b = np.asarray(batch, dtype=np.float64)
        self.sent = np.zeros(len(batch))
        self.recv = np.zeros(len(batch))

    def expect(self, pieces: list[_Piece]) -> None:
        """Pieces still to place: until placed, every rank receives their vectors."""
        self.recv = self.b * sum(self.volume(p) for p in pieces)

    def volume(self, p: _Piece) -> float:
        """Bytes the piece's owner exchanges per sample of another rank."""
        vectors = p.table.lookups_per_sample * p.lookup_share if p.sparse_exchange else 1.0
        return vectors * p.cols * FLOAT_BYTES

    def cost(self, p: _Piece) -> np.ndarray:
        """Seconds the piece adds to each rank if placed there (fast memory), its sending
        counted in full: the piece's size, for ordering and cutting."""
        looked_up = self.b.sum() * p.table.lookups_per_sample * p.lookup_share * p.cols * 4
        return looked_up * self.per_byte + (self.b.sum() - self.b) * self.volume(p) * (
            self.a2a_per_byte
        )

    def _finish(self, p: _Piece, lookup_s: np.ndarray) -> tuple[np.ndarray, ...]:
        """Each rank's predicted time with the piece placed there: its work so far, the
        piece's lookups, and the larger of what it would send and receive."""
        v = self.volume(p)
        sent, recv = self.sent + (self.b.sum() - self.b) * v, self.recv - self.b * v
        return self.load + lookup_s + np.maximum(sent, recv) * self.a2a_per_byte, sent, recv

    def _commit(self, r: int, lookup_s: float, sent: np.ndarray, recv: np.ndarray) -> None:
        self.load[r] += lookup_s
        self.sent[r], self.recv[r] = sent[r], recv[r]

    def _best(self, finish: np.ndarray, allowed: np.ndarray) -> int:
        """The rank that leaves the slowest rank fastest; among equals, the one whose own
        time grows least (a rank that receives more than it sends gets faster by holding
        the piece, since its samples' vectors no longer cross the network)."""
        now = self.load + np.maximum(self.sent, self.recv) * self.a2a_per_byte
        top = np.argsort(-now)[:2]
        others = np.where(np.arange(len(now)) == top[0], now[top[-1]], now[top[0]])
        slowest = np.where(allowed, np.maximum(others, finish), np.inf)
        return int(np.lexsort((finish - now, slowest))[0])

    def place(self, p: _Piece, coverage) -> Shard:
        need = p.rows * self.inputs.row_bytes(p.cols)
        looked = self.b.sum() * p.table.lookups_per_sample * p.lookup_share * p.cols * 4
        lookup_s = looked * self.per_byte
        finish, sent, recv = self._finish(p, lookup_s)
        fits = self.free_hbm >= need
        if fits.any():
            r = self._best(finish, fits)
            self.free_hbm[r] -= need
            self._commit(r, lookup_s[r], sent, recv)
            return Shard(
                p.table.name, r, p.rows, p.cols,
                lookup_share=p.lookup_share, sparse_exchange=p.sparse_exchange,
            )  # fmt: skip
        if self.inputs.cpu:
            raise PlanDoesNotFitError(
                f"table {p.table.name}: a piece of {p.rows:,} x {p.cols} "
                f"({need / 2**30:.2f} GiB) fits no rank's memory (largest free: "
                f"{self.free_hbm.max() / 2**30:.2f} GiB)"
            )
        host_fits = self.free_host >= need
        if not host_fits.any():
            raise PlanDoesNotFitError(
                f"table {p.table.name}: a piece of {p.rows:,} x {p.cols} "
                f"({need / 2**30:.2f} GiB) fits neither device nor host memory anywhere"
            )
        row_bytes = p.cols * FLOAT_BYTES
        cache_rows = np.minimum(p.rows, np.maximum(0, self.free_hbm // row_bytes)).astype(int)
        hit = np.array([coverage(int(c)) if c > 0 else 0.0 for c in cache_rows])
        # misses read at host bandwidth, hits at HBM bandwidth
        lookup_s = looked * (hit * self.per_byte + (1 - hit) * self.per_byte_host)
        finish, sent, recv = self._finish(p, lookup_s)
        r = self._best(finish, host_fits)
        self.free_host[r] -= need
        self.free_hbm[r] -= cache_rows[r] * row_bytes
        self._commit(r, lookup_s[r], sent, recv)
        tier = Tier.cached if cache_rows[r] > 0 else Tier.host
        return Shard(p.table.name, r, p.rows, p.cols, tier, hit_rate=float(hit[r]),
                     lookup_share=p.lookup_share, sparse_exchange=p.sparse_exchange,
                     cache_rows=int(cache_rows[r]))  # fmt: skip


def _replicated_rows(
    inputs: PlanInputs, t: TableStats, budget_bytes: float, batch: list[int]
) -> int:
    """Hottest rows worth replicating: maximise all-to-all saved - all-reduce added."""
    w = inputs.world
    if w < 2 or budget_bytes <= 0:
        return 0
    cov = inputs.coverage[t.name]
    a2a, ar = inputs.network.alltoall, inputs.network.allreduce
    # forward + backward, this table's vectors on the rank with the largest batch b, which
    # sets the exchange's time: b (B - b) / B vectors when the exchange is balanced
    big_b, b = inputs.global_batch, max(batch)
    exchange_s = 2 * b * (big_b - b) / big_b * t.dim * FLOAT_BYTES / a2a.bytes_per_s
    seq_s = max(d.sequence_s_per_lookup for d in inputs.devices)
    best_h, best_gain = 0, 0.0
    candidates = sorted({t.rows, *(2**k for k in range(int(math.log2(max(t.rows, 1))) + 1))})
    for h in candidates:
        if h > t.rows or h * inputs.row_bytes(t.dim) > budget_bytes:
            break
        allreduce_s = 2 * (w - 1) / w * h * t.dim * FLOAT_BYTES / ar.bytes_per_s
        # with the pooled exchange a cold part still sends a vector per sample: only
        # replicating the whole table saves the exchange
        saved = cov(h) if inputs.cold_only_exchange else float(h == t.rows)
        gain = saved * exchange_s - allreduce_s
        if inputs.cold_only_exchange and h < t.rows:  # the cold part's sequence CPU work:
            # the owner looks up every sample's cold ids, each rank pools its own
            cold = (1 - cov(h)) * t.lookups_per_sample * inputs.global_batch * (1 + 1 / w)
            gain -= cold * seq_s
        if gain > best_gain:
            best_h, best_gain = h, gain
    return best_h


def _pieces(p: _Piece, cost: float, target: float, world: int) -> list[_Piece]:
    """A piece cut until each costs about `target`, in powers of two, at most one a rank.
    Column-wise (dims multiples of MIN_COLS); a cold part exchanged as sequences in row
    parts instead (an EmbeddingCollection shards table-wise here, and row parts keep every
    cold lookup one vector, where column pieces would each send one)."""
    t, k = p.table, 1
    if p.sparse_exchange:
        while cost / k > target and 2 * k <= min(world, p.rows):
            k *= 2
        rows = cold_part_rows(p.rows, k)
        return [_Piece(t, rows[j], p.cols, p.lookup_share / k, True, part=j) for j in range(k)]
    while cost / k > target and t.dim % (2 * k) == 0 and t.dim // (2 * k) >= MIN_COLS:
        if 2 * k > world:
            break
        k *= 2
    return [_Piece(t, p.rows, t.dim // k, p.lookup_share, False) for _ in range(k)]


def hybrid(inputs: PlanInputs) -> Plan:
    """Ours. Candidates, the cheapest under the cost model wins:
    - batch shares in proportion to dense speed, then shares capped where the exchange
      of the ranks with the largest batch costs more than the dense work it saves;
    - with split tables (sequence cold parts), also no split at all: the sequence
      exchange has a fixed cost per step that no single table's decision sees."""
    check_fits(inputs)
    batch = proportional_batch(inputs.global_batch, [d.dense_flops_per_s for d in inputs.devices])
    best = evaluate(_hybrid(inputs, batch), inputs)
    capped = _exchange_aware_batch(best, inputs)
    if capped != best.batch_per_rank:
        best = min(best, evaluate(_hybrid(inputs, capped), inputs), key=_step_ms)
    if inputs.cold_only_exchange and any(0 < t.replicated_rows < t.rows for t in best.tables):
        whole = _hybrid(replace(inputs, cold_only_exchange=False), best.batch_per_rank)
        best = min(best, evaluate(whole, inputs), key=_step_ms)
    return best


def _step_ms(plan: Plan) -> float:
    return plan.est_step_ms


def _exchange_aware_batch(plan: Plan, inputs: PlanInputs) -> list[int]:
    """The cap on any rank's batch that minimises dense work + input work + exchange, the
    exchange taken as balanced (each rank owning vectors in proportion to its batch: a rank
    with batch b then sends and receives b (B - b) / B of the plan's exchanged bytes per
    sample, see plan_eval.lower_bound_ms)."""
    big_b, w = inputs.global_batch, inputs.world
    by_name = {t.name: t for t in inputs.tables}
    volume = sum(s.cols * FLOAT_BYTES * vectors_per_sample(s, by_name[s.table])
                 for s in plan.shards() if not s.dp)  # fmt: skip
    sample_s = dense_s_per_sample(inputs)
    input_s = np.array([d.input_s_per_sample + d.sample_overhead_s for d in inputs.devices])
    caps = np.unique(np.linspace(math.ceil(big_b / w), max(plan.batch_per_rank), 64).round())
    passes = exposed_exchange_passes(inputs.schedule, inputs.micro_batches)
    best_cap, best_s = None, math.inf
    for cap in caps:
        b = np.array(capped_batch(big_b, sample_s, int(cap)))
        exchange = float(np.max(b * (big_b - b))) / big_b * volume
        s = (np.max(b * sample_s) + np.max(b * input_s)
             + passes * exchange / inputs.network.alltoall.bytes_per_s)  # fmt: skip
        if s < best_s:
            best_cap, best_s = int(cap), s
    return capped_batch(big_b, sample_s, best_cap) if best_cap else plan.batch_per_rank


def _hybrid(inputs: PlanInputs, batch: list[int]) -> Plan:
    placer = _Placer(inputs, batch, speed_aware=True)
    budget = MAX_REPLICATED_SHARE * min(inputs.hbm_budget())
    plans: dict[str, TablePlan] = {}
    pieces: list[tuple[float, int, _Piece]] = []
    # hottest-per-byte tables claim the replication budget first
    order = sorted(inputs.tables, key=lambda t: -inputs.coverage[t.name](1) / t.dim)
    for t in order:
        h = _replicated_rows(inputs, t, budget, batch)
        budget -= h * inputs.row_bytes(t.dim)
        placer.free_hbm -= h * inputs.row_bytes(t.dim)  # a copy on every rank
        cov_h = inputs.coverage[t.name](h) if h else 0.0
        everyone = list(range(inputs.world)) if h else []
        shards = [Shard(t.name, r, h, t.dim, dp=True, lookup_share=cov_h) for r in everyone]
        kind = "data_parallel" if h == t.rows else ""
        plans[t.name] = TablePlan(t.name, t.rows, t.dim, kind, everyone, Tier.hbm,
                                  hot_rows=h, replicated_rows=h, shards=shards)  # fmt: skip
        if h < t.rows:
            sparse = h > 0 and inputs.cold_only_exchange
            whole = _Piece(t, t.rows - h, t.dim, 1.0 - cov_h, sparse_exchange=sparse)
            pieces.append((float(placer.cost(whole).min()), len(pieces), whole))
    total = sum(c for c, _, _ in pieces)
    target = total / (2 * inputs.world) if pieces else 0.0
    split: list[tuple[float, int, _Piece]] = []
    for cost, _, p in pieces:
        cut = _pieces(p, cost, target, inputs.world)
        for q in cut:
            heapq.heappush(split, (-cost / len(cut), len(split), q))
        plans[p.table.name].cold_parts = len(cut) if p.sparse_exchange else 1
    placed: dict[str, list[tuple[int, Shard]]] = {t.name: [] for t in inputs.tables}
    placer.expect([q for _, _, q in split])
    while split:
        _, _, p = heapq.heappop(split)
        placed[p.table.name].append((p.part, placer.place(p, inputs.coverage[p.table.name])))
    for name, shards in placed.items():  # row parts in part order, column pieces as placed
        plans[name].shards += [s for _, s in sorted(shards, key=lambda x: x[0])]
    tables = [finish_table(plans[t.name]) for t in inputs.tables]
    return Plan("hybrid", inputs.cluster, tables, batch)


def finish_table(tp: TablePlan) -> TablePlan:
    """Sharding type, ranks, tier and rows in fast memory from a table's shards."""
    cold = [s for s in tp.shards if not s.dp]
    if not cold:
        return tp  # replicated whole: data_parallel on every rank
    kind = "column_wise" if len(cold) > 1 else "table_wise"
    if tp.cold_parts > 1:
        kind = f"table_wise_x{tp.cold_parts}"  # row parts, each its own table
    tp.sharding_type = f"hot_replicated+{kind}" if tp.replicated_rows else kind
    if not tp.replicated_rows:
        tp.ranks = sorted({s.rank for s in cold})
    tiers = {s.tier for s in cold}
    tp.tier = next(t for t in (Tier.host, Tier.cached, Tier.hbm) if t in tiers)
    fast = [s.rows if s.tier == Tier.hbm else s.cache_rows for s in cold]
    # columns of a row sit on several ranks; row parts each hold their own rows
    tp.hot_rows = tp.replicated_rows + (sum(fast) if tp.cold_parts > 1 else min(fast))
    return tp


def _simple(inputs: PlanInputs, name: str, choose) -> Plan:
    """Whole tables, one per rank as `choose(free_hbm, table)` picks; equal batch shares."""
    check_fits(inputs)
    batch = equal_batch(inputs.global_batch, inputs.world)
    placer = _Placer(inputs, batch, speed_aware=False)
    plans = []
    for i, t in enumerate(inputs.tables):
        p = _Piece(t, t.rows, t.dim, 1.0, sparse_exchange=False)
        need = t.rows * inputs.row_bytes(t.dim)
        r = choose(i, t, placer.free_hbm, need)
        if r is not None and placer.free_hbm[r] >= need:
            placer.free_hbm[r] -= need
            shard = Shard(t.name, r, t.rows, t.dim, Tier.hbm)
        else:
            shard = placer.place(p, inputs.coverage[t.name])
        plans.append(
            finish_table(TablePlan(t.name, t.rows, t.dim, "", [], Tier.hbm, 0, 0, [shard]))
        )
    return Plan(name, inputs.cluster, plans, batch)


def round_robin(inputs: PlanInputs) -> Plan:
    return _simple(inputs, "round_robin", lambda i, t, free, need: i % inputs.world)


def greedy_size(inputs: PlanInputs) -> Plan:
    tables = inputs.tables
    order = sorted(range(len(tables)), key=lambda i: -tables[i].rows * tables[i].dim)
    inputs_sorted = PlanInputs(**{**inputs.__dict__, "tables": [inputs.tables[i] for i in order]})
    plan = _simple(inputs_sorted, "greedy_size", lambda i, t, free, need: int(np.argmax(free)))
    by_name = {tp.name: tp for tp in plan.tables}
    plan.tables = [by_name[t.name] for t in inputs.tables]
    return plan


PLANNERS = {"hybrid": hybrid, "greedy_size": greedy_size, "round_robin": round_robin}
