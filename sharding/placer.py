"""Longest-first placement of table pieces on ranks, each rank with its own speed and memory.

A piece is a table's rows x columns (a whole table, a column piece, a cold part or one of
its row parts). The placer keeps, per rank, the seconds of work placed so far (dense work
of its batch, lookups) and the bytes it sends and receives in the embedding all-to-all,
within its node and across nodes, as the cost model counts them (`sharding.cost_model`).
Each piece goes where the step then ends soonest as the cost model adds it up: the slowest
rank's lookups plus the slowest rank's exchange (collectives make every rank wait for the
slowest at each stage, so a rank slow at lookups and another slow at sending both count;
ties go to the placement with the smaller sum of squares of both stages over all ranks),
never over a rank's memory (`sharding.memory`: its room for tables at its batch, each
piece with its input and output buffers): device memory first; on GPU clusters host memory
with an HBM cache of the piece's hottest rows (hit rate from the coverage curve) where no
device has room.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from sharding.batch_split import dense_s_per_sample
from sharding.bound import lookup_rates
from sharding.memory import piece_buffer_bytes, table_room
from sharding.types import (
    FLOAT_BYTES,
    PlanDoesNotFitError,
    PlanInputs,
    Shard,
    TableStats,
    Tier,
)


@dataclass
class Piece:
    table: TableStats
    rows: int
    cols: int
    lookup_share: float  # share of the table's lookups (1 - coverage of the hot part)
    sparse_exchange: bool
    part: int = 0  # a row part's index (row c in part c mod k)
    hot: int = 0  # the table's hottest rows replicated elsewhere (a cold part's offset)
    group: bool = False  # placed as a table-row-wise group on one whole node (`place_group`)
    either: bool = False  # a group only where it ends the step sooner than the piece alone

    def cache_hit(self, coverage: Callable[[int], float], cache_rows: int) -> float:
        """Share of the piece's lookups a cache of its `cache_rows` hottest rows serves: its
        rows are a 1 / k sample of the table's rows after the hot ones, so the cache holds
        about the table's next cache_rows x k hottest."""
        if cache_rows <= 0:
            return 0.0
        k = (self.table.rows - self.hot) / self.rows
        base = coverage(self.hot) if self.hot else 0.0
        return min(1.0, (coverage(self.hot + int(cache_rows * k)) - base) / max(1e-12, 1 - base))

    def volume(self) -> float:
        """Bytes the piece's owner exchanges per sample of another rank (one way)."""
        t = self.table
        vectors = t.lookups_per_sample * self.lookup_share if self.sparse_exchange else 1.0
        return vectors * self.cols * FLOAT_BYTES

    def buffer_bytes(self, samples: float) -> float:
        """Its input and output buffers in device memory for `samples` (`sharding.memory`)."""
        return piece_buffer_bytes(
            self.table, self.cols, self.lookup_share, self.sparse_exchange, samples
        )

    def looked_up_bytes(self, samples: float) -> float:
        t = self.table
        return samples * t.lookups_per_sample * self.lookup_share * self.cols * t.weight_bytes


WHOLE = -1  # `_cache_sizes`: the piece whole in device memory, not behind a cache
MAX_CACHE_SHARE = 0.99  # the largest cache, a share of a piece's rows (`sharding.emit`)


class Placer:
    """Places pieces one at a time (`place`); `expect` first announces all of them."""

    def __init__(self, inputs: PlanInputs, batch: list[int], speed_aware: bool) -> None:
        self.inputs = inputs
        self.free_hbm = table_room(inputs, batch)
        self.room = self.free_hbm.copy()  # before anything is placed
        self.free_host = np.array(inputs.host_budget(), dtype=np.float64)
        devs = inputs.devices
        # seconds per byte looked up (forward + backward) on each rank, fast and host memory
        self.per_byte = 1 / np.array(lookup_rates(inputs))
        self.per_byte_host = np.array(
            [(1 + d.emb_bwd_factor) / d.host_read_bytes_per_s for d in devs]
        )
        # a cold part's sequence work on its owner, per lookup and per byte of its vector
        self.seq_lookup = np.array([d.sequence_s_per_lookup for d in devs])
        self.seq_byte = np.array([d.sequence_s_per_byte for d in devs])
        self.b = np.asarray(batch, dtype=np.float64)
        self.load = self.b * dense_s_per_sample(inputs)
        if not speed_aware:  # a speed-blind planner sees every rank as rank 0
            self.per_byte[:] = self.per_byte[0]
            self.per_byte_host[:] = self.per_byte_host[0]
            self.load[:] = 0.0
        self.dense = self.load.copy()  # each rank's dense work; load - dense: its lookups
        net = inputs.network  # forward + backward
        self.intra_per_byte = 2.0 / net.intra_alltoall.bytes_per_s
        self.inter_per_byte = 2.0 / net.alltoall.bytes_per_s
        self.node = np.array([r.node for r in inputs.ranks])
        if np.any(np.diff(self.node) < 0):
            raise ValueError("ranks must be numbered node by node (as resolve_cluster does)")
        self.node = np.unique(self.node, return_inverse=True)[1]  # 0, 1, ... in order
        self.starts = np.flatnonzero(np.diff(self.node, prepend=-1))  # each node's first rank
        self.index = np.arange(len(self.node))
        self.node_batch = np.bincount(self.node, weights=self.b)[self.node]  # per rank
        self.total = float(self.b.sum())
        # samples a rank's piece serves per vector byte: its node mates', other nodes'
        self.to_mates = self.node_batch - self.b
        self.to_others = self.total - self.node_batch
        ends = [*self.starts[1:], len(self.node)]
        self.mates = [slice(a, e) for a, e in zip(self.starts, ends, strict=True)]  # per node
        w = len(batch)
        self.sent_intra, self.sent_inter = np.zeros(w), np.zeros(w)
        self.recv_intra, self.recv_inter = np.zeros(w), np.zeros(w)
        self.placed: list[tuple[Piece, Shard]] = []  # in placement order (`improve` moves)
        self.pending_buffers = 0.0  # buffers of the expected pieces not yet placed
        # how much of them each rank keeps free when a piece goes to its fast memory: its
        # share (1), or more where the pieces left for host memory found none
        self.buffer_reserve = 1.0

    def expect(self, pieces: list[Piece]) -> None:
        """Pieces still to place: until placed, every rank receives their vectors (counted
        as if from other nodes; placing moves a node's share to the intra-node link)."""
        self.recv_inter = self.b * sum(p.volume() for p in pieces)
        self.pending_buffers = sum(p.buffer_bytes(self.total) for p in pieces)

    def cost(self, p: Piece) -> np.ndarray:
        """Seconds the piece adds to each rank if placed there (fast memory), its sending
        counted in full: the piece's size, for ordering and cutting."""
        v = p.volume()
        return p.looked_up_bytes(self.total) * self.per_byte + (
            self.to_mates * v * self.intra_per_byte + self.to_others * v * self.inter_per_byte
        )

    def _exchange_s(self, si, ri, se, re) -> np.ndarray:
        return np.maximum(
            np.maximum(si, ri) * self.intra_per_byte, np.maximum(se, re) * self.inter_per_byte
        )

    def exchange(self) -> np.ndarray:
        """Each rank's predicted exchange so far."""
        return self._exchange_s(self.sent_intra, self.recv_intra, self.sent_inter, self.recv_inter)

    def score(self) -> tuple[float, float]:
        """What placement minimises, then what breaks its ties: the slowest rank's lookups
        plus the slowest rank's exchange, then the sum of both stages' squares over all
        ranks (so several ranks tied at the top drain one by one)."""
        look, exch = self.load - self.dense, self.exchange()
        return float(look.max() + exch.max()), float(np.sum(look**2) + np.sum(exch**2))

    def _finish_exchange(self, p: Piece) -> np.ndarray:
        """Each rank's exchange with the piece placed there: the larger of what it would
        send and receive on each link."""
        v = p.volume()
        si = self.sent_intra + self.to_mates * v
        se = self.sent_inter + self.to_others * v
        re = self.recv_inter - self.b * v  # its own samples' vectors stay home
        return self._exchange_s(si, self.recv_intra, se, re)

    def _commit(self, r: int, p: Piece, lookup_s: float, sign: float = 1.0) -> None:
        """Account for the piece on rank r (sign -1: take it away again)."""
        v = sign * p.volume()
        self.load[r] += sign * lookup_s
        self.sent_intra[r] += self.to_mates[r] * v
        self.sent_inter[r] += self.to_others[r] * v
        mates = self.mates[self.node[r]]  # they now receive it within the node
        self.recv_inter[mates] -= self.b[mates] * v
        own = self.recv_intra[r]  # r itself receives nothing of it
        self.recv_intra[mates] += self.b[mates] * v
        self.recv_intra[r] = own

    def _best(self, p: Piece, lookup_s: np.ndarray, allowed: np.ndarray) -> tuple[int, float]:
        """The allowed rank where the step ends soonest (`score`) with the piece placed there
        (`lookup_s`: its lookup seconds on each rank), and that score; counting the
        candidate, its node mates (they now get the piece's vectors within the node, not
        across) and every other node (unchanged)."""
        v = p.volume()
        look = self.load - self.dense
        exch = self.exchange()
        exch_fin = self._finish_exchange(p)
        mates = self._exchange_s(
            self.sent_intra,
            self.recv_intra + self.b * v,
            self.sent_inter,
            self.recv_inter - self.b * v,
        )
        # the slowest lookups: the candidate's with the piece, or the slowest rank's now
        # (lookup_s >= 0: the slowest rank itself only gets slower)
        slowest = np.maximum(look + lookup_s, look.max()) + self._max_with(exch_fin, mates, exch)
        slowest[~allowed] = np.inf
        # ties: the change in both stages' sum of squares over all ranks
        mate_gain = mates**2 - exch**2
        node_gain = np.add.reduceat(mate_gain, self.starts)[self.node]
        spread = (look + lookup_s) ** 2 - look**2 + node_gain - mate_gain + exch_fin**2 - exch**2
        r = int(np.lexsort((spread, slowest))[0])
        return r, float(slowest[r])

    def _max_with(self, own: np.ndarray, mates: np.ndarray, now: np.ndarray) -> np.ndarray:
        """Per candidate rank r: the largest of own[r], the `mates` value of r's node mates
        and the `now` value of every rank on another node."""
        starts, idx = self.starts, self.index
        # per node, the largest and second largest value of a mate, and who has the largest
        top1 = np.maximum.reduceat(mates, starts)
        who = np.minimum.reduceat(np.where(mates == top1[self.node], idx, len(idx)), starts)
        masked = mates.copy()
        masked[who] = -np.inf
        top2 = np.maximum.reduceat(masked, starts)
        mate_max = np.where(who[self.node] == idx, top2[self.node], top1[self.node])
        outside = self._outside(now)[self.node]
        return np.maximum(np.maximum(own, mate_max), outside)

    def table_bytes(self, p: Piece) -> float:
        """The piece's weights and optimizer state."""
        return p.rows * self.inputs.row_bytes(p.cols)

    def hbm_need(self, p: Piece) -> float:
        """Device bytes the piece takes in fast memory: its rows and its buffers."""
        return self.table_bytes(p) + p.buffer_bytes(self.total)

    def buffers_fit_nowhere(self, p: Piece) -> bool:
        """Whether host memory would hold the piece but no device has room for its
        buffers (fast memory taken by the pieces placed before it)."""
        host = self.free_host >= self.table_bytes(p)
        return bool(host.any() and not (self.free_hbm >= p.buffer_bytes(self.total)).any())

    def fits_somewhere(self, p: Piece) -> bool:
        buffers = p.buffer_bytes(self.total)
        host = (self.free_host >= self.table_bytes(p)) & (self.free_hbm >= buffers)
        return bool((self.free_hbm >= self.hbm_need(p)).any() or host.any())

    def _sequence_s(self, p: Piece) -> np.ndarray:
        """The owner's sequence work for a cold part on each rank (0 for pooled pieces)."""
        if not p.sparse_exchange:
            return np.zeros_like(self.b)
        lookups = self.total * p.table.lookups_per_sample * p.lookup_share
        return lookups * (self.seq_lookup + p.cols * FLOAT_BYTES * self.seq_byte)

    def _lookup_s(self, p: Piece) -> np.ndarray:
        """The piece's lookup seconds on each rank from device memory, its owner's sequence
        work included."""
        return p.looked_up_bytes(self.total) * self.per_byte + self._sequence_s(p)

    def place(self, p: Piece, coverage: Callable[[int], float]) -> Shard:
        buffers = p.buffer_bytes(self.total)
        self.pending_buffers = max(0.0, self.pending_buffers - buffers)
        need = self.hbm_need(p)
        lookup_s = self._lookup_s(p)
        # device memory left for the buffers of the pieces still to come (a rank's share):
        # filled to the brim, it would turn away a later piece that host memory could hold
        reserve = min(1.0, self.buffer_reserve / len(self.b)) * self.pending_buffers
        fits = self.free_hbm - reserve >= need
        host_fits = (self.free_host >= self.table_bytes(p)) & (self.free_hbm >= buffers)
        if not fits.any() and (self.inputs.cpu or not host_fits.any()):
            fits = self.free_hbm >= need
        if fits.any():
            r, _ = self._best(p, lookup_s, fits)
            self.free_hbm[r] -= need
            self._commit(r, p, lookup_s[r])
            shard = Shard(
                p.table.name,
                r,
                p.rows,
                p.cols,
                lookup_share=p.lookup_share,
                sparse_exchange=p.sparse_exchange,
            )
            self.placed.append((p, shard))
            return shard
        need = self.table_bytes(p)
        if self.inputs.cpu or not host_fits.any():
            where = "any rank's memory" if self.inputs.cpu else "device or host memory anywhere"
            raise PlanDoesNotFitError(
                f"table {p.table.name}: a piece of {p.rows:,} x {p.cols} "
                f"({need / 2**30:.2f} GiB, and {buffers / 2**30:.2f} GiB of buffers in device "
                f"memory) fits no {where} (largest free: device "
                f"{self.free_hbm.max() / 2**30:.2f} GiB, host "
                f"{self.free_host.max() / 2**30:.2f} GiB)"
            )
        row_bytes = p.cols * p.table.weight_bytes  # an HBM cache holds weights alone
        # a cache leaves room for the buffers of the pieces still to come
        room = self.free_hbm - buffers - self.pending_buffers
        cache_rows = np.minimum(p.rows, np.maximum(0, room // row_bytes)).astype(int)
        hit = np.array([p.cache_hit(coverage, int(c)) for c in cache_rows])
        # misses read at host bandwidth, hits at HBM bandwidth
        looked = p.looked_up_bytes(self.total)
        lookup_s = looked * (hit * self.per_byte + (1 - hit) * self.per_byte_host)
        lookup_s += self._sequence_s(p)
        r, _ = self._best(p, lookup_s, host_fits)
        self.free_host[r] -= need
        self.free_hbm[r] -= cache_rows[r] * row_bytes + buffers
        self._commit(r, p, lookup_s[r])
        tier = Tier.cached if cache_rows[r] > 0 else Tier.host
        shard = Shard(
            p.table.name,
            r,
            p.rows,
            p.cols,
            tier,
            hit_rate=float(hit[r]),
            lookup_share=p.lookup_share,
            sparse_exchange=p.sparse_exchange,
            cache_rows=int(cache_rows[r]),
        )
        self.placed.append((p, shard))
        return shard

    def share_caches(self) -> None:
        """On each rank holding pieces in host memory: its device memory shared anew among
        its pieces (not groups), each whole in device memory or in host memory behind an
        HBM cache of its hottest rows, by the lookups each byte serves from HBM
        (`_cache_sizes`); kept where the rank's lookups get faster. Placed longest first, the
        pieces that came last found no room for a cache, though the pieces placed before
        them may serve fewer lookups per byte (TorchRec sizes every cache at once)."""
        mine: dict[int, list[int]] = {}
        for i, (_, s) in enumerate(self.placed):
            if not s.node_reduce:
                mine.setdefault(s.rank, []).append(i)
        for r, idx in mine.items():
            if any(self.placed[i][1].tier != Tier.hbm for i in idx):
                self._share_caches(r, idx)

    def _share_caches(self, r: int, idx: list[int]) -> None:
        pieces = [self.placed[i][0] for i in idx]
        shards = [self.placed[i][1] for i in idx]
        whole = [self.table_bytes(p) for p in pieces]
        row_w = [p.cols * p.table.weight_bytes for p in pieces]  # a cache holds weights
        in_hbm = [
            w if s.tier == Tier.hbm else s.cache_rows * rw
            for s, w, rw in zip(shards, whole, row_w, strict=True)
        ]
        in_host = [0.0 if s.tier == Tier.hbm else w for s, w in zip(shards, whole, strict=True)]
        hbm = self.free_hbm[r] + sum(in_hbm)
        if sum(whole) > self.free_host[r] + sum(in_host):
            return  # every piece behind a cache needs host memory for all its rows
        looked = [p.looked_up_bytes(self.total) for p in pieces]
        saved = self.per_byte_host[r] - self.per_byte[r]  # per byte served from HBM
        hits = [s.hit_rate if s.tier != Tier.hbm else 1.0 for s in shards]
        coverage = [self.inputs.coverage[p.table.name] for p in pieces]
        rows = _cache_sizes(pieces, coverage, looked, row_w, whole, hbm)
        hit = [
            1.0 if n == WHOLE else p.cache_hit(c, n)
            for p, c, n in zip(pieces, coverage, rows, strict=True)
        ]
        gain = saved * sum(x * (h - g) for x, h, g in zip(looked, hit, hits, strict=True))
        if gain <= 1e-12 * self.load[r]:
            return
        self.load[r] -= gain
        self.free_hbm[r] = hbm - sum(
            w if n == WHOLE else n * rw for w, n, rw in zip(whole, rows, row_w, strict=True)
        )
        self.free_host[r] += sum(in_host) - sum(
            w for w, n in zip(whole, rows, strict=True) if n != WHOLE
        )
        for i, s, n, h in zip(idx, shards, rows, hit, strict=True):
            if n == WHOLE:
                new = replace(s, tier=Tier.hbm, hit_rate=1.0, cache_rows=0)
            else:
                new = replace(s, tier=Tier.cached if n else Tier.host, hit_rate=h, cache_rows=n)
            self.placed[i] = (self.placed[i][0], new)

    def _alone_s(self, p: Piece) -> float:
        """The step's `score` with the piece whole on the best rank with room in device
        memory (inf if none has)."""
        fits = self.free_hbm >= self.hbm_need(p)
        if not fits.any():
            return float("inf")
        return self._best(p, self._lookup_s(p), fits)[1]

    def _outside(self, values: np.ndarray) -> np.ndarray:
        """Per node: the largest of `values` on the other nodes."""
        node_max = np.maximum.reduceat(values, self.starts)
        first, second = _top_two(node_max)
        out = np.full(len(node_max), node_max[first])
        out[first] = second
        return out

    def place_group(self, p: Piece) -> list[Shard] | None:
        """The piece as TorchRec's table-row-wise: its rows in even blocks over every rank
        of one node (ceil(rows / ranks) each, as TorchRec cuts them), partial sums reduced
        within the node, one vector per other node's sample sent across by the node's ranks
        together. On the node where the step then ends soonest (`score`; groups come longest
        first, so this balances them over the nodes); None if no node's ranks all have room
        in device memory, or (`p.either`) if the piece on one rank ends the step as soon."""
        v = p.volume()
        best, best_key = None, None
        look, exch = self.load - self.dense, self.exchange()
        look_outside = self._outside(look)
        exch_outside = self._outside(exch)
        for n in np.unique(self.node):
            members = np.flatnonzero(self.node == n)
            size = len(members)
            block = -(-p.rows // size)
            rows = np.array([max(0, min(block, p.rows - j * block)) for j in range(size)])
            need, lookup_s, scatter, remote = self._group_work(p, members, rows)
            if (self.free_hbm[members] < need).any():
                continue
            look_n = look[members] + lookup_s
            exch_n = self._exchange_s(
                self.sent_intra[members] + scatter,
                self.recv_intra[members] + scatter,
                self.sent_inter[members] + remote,
                self.recv_inter[members] - self.b[members] * v,
            )
            key = (
                max(look_n.max(), look_outside[n]) + max(exch_n.max(), exch_outside[n]),
                float(look_n.sum() + exch_n.sum()),
            )  # then the least loaded node
            if best_key is None or key < best_key:
                best, best_key = (members, rows, need, lookup_s, scatter, remote), key
        if best is None or (p.either and self._alone_s(p) <= best_key[0] * (1 + 1e-12)):
            return None
        members, rows, need, lookup_s, scatter, remote = best
        self.pending_buffers = max(0.0, self.pending_buffers - p.buffer_bytes(self.total))
        self._commit_group(members, need, lookup_s, scatter, remote, v)
        shards = []
        for r, n_rows in zip(members, rows, strict=True):
            share = float(p.lookup_share * n_rows / p.rows)
            shard = Shard(
                p.table.name, int(r), int(n_rows), p.cols, lookup_share=share, node_reduce=True
            )
            self.placed.append((p, shard))
            shards.append(shard)
        return shards

    def _group_work(self, p: Piece, members: np.ndarray, rows: np.ndarray) -> tuple:
        """A group's bytes on each member, its lookup seconds there, and the bytes each
        member sends and receives within the node and sends across nodes."""
        v, size = p.volume(), len(members)
        lookup_s = p.looked_up_bytes(self.total) * rows / p.rows * self.per_byte[members]
        scatter = v * self.total * (size - 1) / size
        remote = (self.total - self.node_batch[members]) * v / size
        # each member's buffers: its ids, and its partial sums for every sample both ways
        buffers = np.array(
            [
                piece_buffer_bytes(p.table, p.cols, p.lookup_share * n / p.rows, False, self.total)
                for n in rows
            ]
        )
        return rows * self.inputs.row_bytes(p.cols) + buffers, lookup_s, scatter, remote

    def _commit_group(self, members, need, lookup_s, scatter, remote, v, sign=1.0) -> None:
        """Account for a table-row-wise group on `members` (sign -1: take it away)."""
        self.free_hbm[members] -= sign * need
        self.load[members] += sign * lookup_s
        self.sent_intra[members] += sign * scatter
        self.recv_intra[members] += sign * scatter
        self.sent_inter[members] += sign * remote
        self.recv_inter[members] -= sign * self.b[members] * v

    def take(self, table: str) -> None:
        """Remove every placed piece of a table (all in device memory) from the ranks."""
        mine = [(p, s) for p, s in self.placed if p.table.name == table]
        if any(s.tier != Tier.hbm for _, s in mine):
            raise ValueError(f"table {table}: only pieces in device memory can be taken back")
        self.placed = [(p, s) for p, s in self.placed if p.table.name != table]
        group = [s for _, s in mine if s.node_reduce]
        if group:
            p = mine[0][0]
            members = np.array([s.rank for s in group])
            work = self._group_work(p, members, np.array([s.rows for s in group]))
            self._commit_group(members, *work, p.volume(), sign=-1.0)
        for p, s in mine:
            if not s.node_reduce:
                self._commit(s.rank, p, float(self._lookup_s(p)[s.rank]), sign=-1.0)
                self.free_hbm[s.rank] += self.hbm_need(p)

    _STATE = (
        "free_hbm",
        "free_host",
        "load",
        "sent_intra",
        "sent_inter",
        "recv_intra",
        "recv_inter",
    )  # what placing changes, besides `placed`

    def snapshot(self) -> tuple:
        """The placement so far, for `restore`."""
        return [getattr(self, n).copy() for n in self._STATE], list(self.placed)

    def restore(self, state: tuple) -> None:
        arrays, placed = state
        for name, a in zip(self._STATE, arrays, strict=True):
            setattr(self, name, a.copy())
        self.placed = list(placed)

    def improve(self, max_moves: int) -> int:
        """Local search after the greedy pass: move a piece in device memory to the rank
        where the step ends soonest (`_best`), when that keeps the step's `score` and lowers
        its sum of squares (no move is ever undone). Candidates: the pieces of the rank
        slowest at lookups and of the rank slowest at exchanging, then the largest others (a
        rank slow from receiving gets faster by holding a piece). Returns the moves made."""
        moves = 0
        by_size = sorted(range(len(self.placed)), key=lambda i: -self.placed[i][0].volume())
        while moves < max_moves:
            worst, spread = self.score()
            slowest = {int(np.argmax(self.load - self.dense)), int(np.argmax(self.exchange()))}
            mine = [i for i in by_size if self.placed[i][1].rank in slowest]
            moved = False
            for i in mine + [i for i in by_size[:64] if i not in mine]:
                p, shard = self.placed[i]
                if shard.tier != Tier.hbm or shard.node_reduce:  # groups move whole
                    continue
                lookup_s = self._lookup_s(p)
                need = self.hbm_need(p)
                a = shard.rank
                self._commit(a, p, lookup_s[a], sign=-1.0)
                self.free_hbm[a] += need
                fits = self.free_hbm >= need
                r, _ = self._best(p, lookup_s, fits)
                self._commit(r, p, lookup_s[r])
                after, after_spread = self.score()
                if r != a and after <= worst * (1 + 1e-12) and after_spread < spread * (1 - 1e-9):
                    self.free_hbm[r] -= need
                    self.placed[i] = (p, replace(shard, rank=r))
                    moves, moved = moves + 1, True
                    break
                self._commit(r, p, lookup_s[r], sign=-1.0)  # no better: put it back
                self._commit(a, p, lookup_s[a])
                self.free_hbm[a] -= need
            if not moved:
                break
        return moves


def _top_two(values: np.ndarray) -> tuple[int, float]:
    """Where the largest value is, and the largest of the others (-inf if none)."""
    first = int(values.argmax())
    others = values.copy()
    others[first] = -np.inf
    return first, float(others.max())


def _cache_sizes(
    pieces: list[Piece],
    coverage: list[Callable[[int], float]],
    looked: list[float],
    row_bytes: list[int],
    whole: list[float],
    room: float,
) -> list[int]:
    """Per piece, the rows of its HBM cache, or WHOLE (in device memory whole), within
    `room` bytes, greedily by the lookups a byte serves (`looked`: bytes a step per piece).
    Cache sizes step through powers of two of rows (coverage curves are concave, so a step
    serves fewer lookups a byte than the one before) up to MAX_CACHE_SHARE of the rows
    (the largest cache TorchRec's plans take, `sharding.emit`), then the piece whole (its
    optimizer state too); the last step that fits is cut to the room left."""
    rows = [0] * len(pieces)
    hit = [0.0] * len(pieces)
    top = [int(MAX_CACHE_SHARE * p.rows) for p in pieces]
    # per piece, its step at its current size while the room left is at least `need` (the
    # room only shrinks): (per_byte, nxt, need); None: work it out. A step cut to the room
    # left depends on the room, so it is never kept
    kept: list[tuple[float, int, float] | None] = [None] * len(pieces)

    def used(j: int) -> float:
        return whole[j] if rows[j] == WHOLE else rows[j] * row_bytes[j]

    def step(j: int) -> tuple[float, int]:
        k = kept[j]
        if k is not None and k[2] <= room:
            return k[0], k[1]
        if rows[j] == WHOLE:
            kept[j] = (0.0, WHOLE, -math.inf)
            return 0.0, WHOLE
        if rows[j] >= top[j]:  # the cache at its largest: the piece whole, if it fits
            more, nxt, bytes_ = 1.0 - hit[j], WHOLE, whole[j] - used(j)
            full = True
        else:
            step_to = min(top[j], max(1024, 2 * rows[j]))
            nxt = min(step_to, rows[j] + int(room // row_bytes[j]))
            full = nxt == step_to
            more = pieces[j].cache_hit(coverage[j], nxt) - hit[j] if nxt > rows[j] else 0.0
            bytes_ = (nxt - rows[j]) * row_bytes[j]
        if bytes_ > room or bytes_ <= 0:  # no step now, nor with less room later
            kept[j] = (0.0, rows[j], -math.inf)
            return 0.0, rows[j]
        value = looked[j] * more / bytes_
        if full:  # the same while the room holds it
            kept[j] = (value, nxt, bytes_)
        return value, nxt

    while True:
        per_byte, nxt, j = max(((*step(j), j) for j in range(len(pieces))), default=(0, 0, -1))
        if per_byte <= 0:
            return rows
        before = used(j)
        rows[j] = nxt
        kept[j] = None
        room -= used(j) - before
        hit[j] = 1.0 if nxt == WHOLE else pieces[j].cache_hit(coverage[j], nxt)
