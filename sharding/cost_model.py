"""Predict per-device memory and per-step time of a placement, as pure functions.

Units are in the names (_bytes, _s, _per_s). Inputs are plain dataclasses: the resolved
cluster (`RankDevice`s), the tables with their access statistics, where each shard sits,
and `DeviceCost` / `LinkCost` constants (datasheet-derived for GPUs, calibrated for local
CPU ranks by `python -m benchmarks.calibrate`; see `sharding.calibration`).

Model of one synchronous step on `world` ranks, batch `b_r` samples on rank r, B = sum b_r:
- embedding lookup, forward: every shard reads (samples it serves) x (lookups per sample) x
  (its columns) x 4 bytes; HBM-resident rows at `emb_read_bytes_per_s`, cache misses at
  `host_read_bytes_per_s`. Backward + optimizer update = forward x `emb_bwd_factor`.
- all-to-all: ids (8 bytes per lookup + 4 per bag length) forward; pooled embeddings
  forward and their gradients backward: one vector of the shard's columns per sample and
  feature (TorchRec's pooled output a2a sends empty bags too). A table-row-wise group
  (`node_reduce`) first reduce-scatters its partial sums among its ranks on the node, then
  sends one vector per sample of another node (TorchRec's TWRW). Bytes to ranks of the same
  node go over the intra-node link, the rest over the inter-node one, concurrently: time =
  latency + the larger over the two links of (the larger of bytes sent and received) /
  bandwidth.
- dense: 6 FLOPs per parameter and sample (2 forward, 4 backward) / `dense_flops_per_s`,
  plus the feature interaction's (DLRM's dot products, `dot_interaction_flops`) /
  `interaction_flops_per_s` (batched small products run slower than the MLPs' GEMMs).
- all-reduce of dense gradients and of data-parallel tables: ring, 2(W-1)/W x bytes.
- under the nested pipeline's N micro-batches, each further micro-batch's fixed overhead
  (`micro_batch_overhead_s`: its dense step's launches and bookkeeping) and each further
  chunk of the embedding exchange its collective's latency again, both ways.
- a fixed per-step overhead (framework, Python, kernel launches), a per-sample one
  (`sample_overhead_s`: id routing, permutes, loss), and on CPU ranks the batch assembly
  that runs on the training thread (`input_s_per_sample`).
- on CPU ranks, the network's own CPU work: gloo's TCP sends and receives take the rank's
  core (`LinkCost.cpu_s_per_byte` per byte sent or received, measured at one core; a rank
  at a fraction of a core, `DeviceCost.core_speed`, takes longer). An exchange that runs
  alone hides it in its own time; one hidden under compute lengthens that compute.
- on emulated CPU ranks (each a share of a core), the step at least the busiest rank's whole
  CPU work, its network's included, at its share's speed (`StepCost.cpu_floor_s`): the
  stages leave gloo's work inside the waits it runs in, which a quota-bound rank lacks.
Each stage ends in a collective, so the step is the sum over stages of the slowest rank;
a rank's fixed and per-sample overheads run in one stretch between the all-reduce and the
next batch's ids (the slowest rank's sum: `StepCost.fixed_s`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from sharding.constants import datasheet_rates, precision_factor
from sharding.types import (
    FLOAT_BYTES,
    ID_BYTES,
    LENGTH_BYTES,
    DeviceCost,
    LinkCost,
    NetworkCost,
    OptimizerState,
    RankDevice,
    Schedule,
    Shard,
    StepCost,
    TableStats,
    Tier,
)

# Train pipelines by name (pipelines.types.PipelineName) -> the schedule that models them.
# TorchRec's SemiSync hides the embedding exchange under the previous batch's dense work
# (one step stale), which the nested schedule's many-micro-batch limit approximates.
# Lite keeps the ids' all-to-all in the step; the fused pipeline's lookup under the optimizer
# step is not priced (the dense optimizer step is not a stage of the model)
_PIPELINE_SCHEDULES = {
    "plain": "plain",
    "base": "plain",
    "sparse_dist": "sparse_dist",
    "sparse_dist_lite": "plain",
    "fused_sparse_dist": "sparse_dist",
    "semi_sync": "nested",
    "nested": "nested",
}


def schedule_of(pipeline: str) -> Schedule:
    if pipeline not in _PIPELINE_SCHEDULES:
        raise ValueError(
            f"no cost model schedule for pipeline '{pipeline}'; "
            f"known: {sorted(_PIPELINE_SCHEDULES)}"
        )
    return Schedule(_PIPELINE_SCHEDULES[pipeline])


STEP_PARTS = (
    "lookups",
    "dense",
    "all-reduce",
    "overhead + input",
    "split tables",
    "exchange left exposed",
    "quota-bound CPU",
    "feeding the batch",
)


def step_parts_s(cost: StepCost, schedule: Schedule, micro_batches: int = 1) -> dict[str, float]:
    """`cost.step_s` split into its parts, which add up to it: each per-rank stage at its
    slowest rank (collectives make every rank wait for it), the all-reduce beyond the
    lookups it crosses under (their backward; under nested micro-batches the next batch's
    lookups too) and the fixed overheads, what of the id and embedding exchange the
    schedule leaves exposed, what the busiest rank's CPU work adds beyond all that
    (`StepCost.cpu_floor_s`), and what feeding the batch (host work, copy to the device)
    adds to the step."""
    lookups = max(cost.lookup_fwd_s) + max(cost.lookup_bwd_s)
    nested = schedule == Schedule.nested and micro_batches > 1
    under = lookups if nested else max(cost.lookup_bwd_s)
    parts = {
        "lookups": lookups,
        "dense": max(cost.dense_s),
        "all-reduce": max(0.0, cost.allreduce_s - under),
        "overhead + input": cost.fixed_s(schedule, micro_batches),
        "split tables": max(cost.split_s, default=0.0),
    }
    critical, device = (
        cost.critical_path_s(schedule, micro_batches),
        cost.device_step_s(schedule, micro_batches),
    )
    parts["exchange left exposed"] = critical - sum(parts.values())
    parts["quota-bound CPU"] = device - critical
    parts["feeding the batch"] = cost.step_s(schedule, micro_batches) - device
    return parts


def exposed_exchange_passes(schedule: Schedule, micro_batches: int = 1) -> float:
    """How many whole embedding exchanges (forward and backward: 2) a schedule leaves
    exposed at least: all of them, except under `nested` with N > 1 micro-batches, the
    last gradient chunk's 1/N (`StepCost.device_step_s`: the first forward chunk can hide
    under the previous step's optimizer step and overheads)."""
    n = max(1, micro_batches)
    return 1.0 / n if schedule == Schedule.nested and n > 1 else 2.0


def vectors_per_sample(s: Shard, t: TableStats) -> float:
    """Vectors a shard's owner sends per sample of another rank (and gradients back): one
    pooled vector, or with a cold-only exchange one per lookup it serves."""
    share = s.rows / t.rows if s.lookup_share is None else s.lookup_share
    return t.lookups_per_sample * share if s.sparse_exchange else 1.0


def memory_bytes(
    shards: Sequence[Shard],
    world: int,
    opt: OptimizerState | None = None,
    weight_bytes: int = FLOAT_BYTES,
) -> list[dict[str, int]]:
    """Per rank: bytes in HBM and in host memory, weights (`weight_bytes` a value) plus
    optimizer state."""
    opt = opt or OptimizerState()
    hbm, host = [0] * world, [0] * world
    everyone = 0  # bytes of data-parallel copies, on every rank
    for s in shards:
        weights = s.rows * s.cols * weight_bytes
        state = s.rows * opt.per_row_bytes + s.rows * s.cols * opt.per_value_bytes
        if s.dp:
            everyone += weights + state
        elif s.tier == Tier.hbm:
            hbm[s.rank] += weights + state
        elif s.tier == Tier.host:
            host[s.rank] += weights + state
        else:  # cached: all rows in host memory, the hot ones mirrored in HBM
            host[s.rank] += weights + state
            cached = s.cache_rows * s.cols * weight_bytes if s.cache_rows else weights * s.hit_rate
            hbm[s.rank] += int(cached)
    return [{"hbm": hbm[r] + everyone, "host": host[r]} for r in range(world)]


def ring_bytes(nbytes: float, world: int) -> float:
    """What each rank sends (and receives) in a ring all-reduce of `nbytes`: 2(W-1)/W."""
    return 2 * (world - 1) / world * nbytes if world > 1 else 0.0


def allreduce_s(
    nbytes: float, world: int, network: NetworkCost, per_node: Sequence[int] | None = None
) -> float:
    """One all-reduce of `nbytes` over `world` ranks: a ring, 2(W-1) latency hops and
    2(W-1)/W of the bytes each way; with `network.tree_allreduce`, NCCL's double binary tree
    where it is faster (2 log2 W hops, the bytes twice). The ring's per-byte cost is the
    lower of the two, so it is also the marginal cost the bound and the planners price.
    With `network.hierarchical_allreduce` and `per_node` (ranks per node) over more than one
    node: `hierarchical_allreduce_s`."""
    if world < 2:
        return 0.0
    if network.hierarchical_allreduce and per_node is not None and len(per_node) > 1:
        return hierarchical_allreduce_s(nbytes, per_node, network)
    link = network.allreduce
    ring = 2 * (world - 1) * link.latency_s + ring_bytes(nbytes, world) / link.bytes_per_s
    if not network.tree_allreduce:
        return ring
    hops = 2 * math.ceil(math.log2(world))
    return min(ring, hops * link.latency_s + 2 * nbytes / link.bytes_per_s)


def hierarchical_allreduce_s(nbytes: float, per_node: Sequence[int], network: NetworkCost) -> float:
    """Summed within each node onto its first rank, all-reduced among the nodes' first
    ranks, sent back within the node (`pipelines.dense_reduce`, hierarchical): within the
    largest node a reduce and a broadcast over the intra-node link (each ceil(log2 L) hops
    moving the bytes once), across nodes one rank per node over the inter-node link (ring
    or tree, as `allreduce_s`). A calibrated CPU link has no intra-node figure: its own
    link prices both, an upper estimate for ranks sharing a host."""
    local = max(per_node)
    intra = network.intra_alltoall
    within = 0.0
    if local > 1:
        within = 2 * (math.ceil(math.log2(local)) * intra.latency_s + nbytes / intra.bytes_per_s)
    flat = replace(network, allreduce=network.alltoall, hierarchical_allreduce=False)
    return within + allreduce_s(nbytes, len(per_node), flat)


def ranks_per_node(nodes: Sequence[int]) -> np.ndarray:
    """How many ranks each node holds, from each rank's node (nodes with none left out)."""
    counts = np.bincount(np.asarray(nodes, dtype=np.int64))
    return counts[counts > 0]


def hierarchical_pays(nbytes: float, per_node: Sequence[int], network: NetworkCost) -> bool:
    """Whether the hierarchical reduction of `nbytes` is priced faster than the flat one on
    nodes of `per_node` ranks (`trainer.dense_allreduce=auto` with TorchRec's planner, whose
    plan is made in the ranks: the dense parameters' bytes)."""
    world = sum(per_node)
    flat = allreduce_s(nbytes, world, replace(network, hierarchical_allreduce=False))
    return len(per_node) > 1 and hierarchical_allreduce_s(nbytes, per_node, network) < flat


def dense_s_per_sample(d: DeviceCost, dense_params: int, interaction_flops: float) -> float:
    """Seconds of dense work per sample on a device: 6 FLOPs per parameter (2 forward, 4
    backward) at its dense rate, and the feature interaction's at its own rate."""
    rate = d.interaction_flops_per_s or d.dense_flops_per_s
    return 6.0 * dense_params / d.dense_flops_per_s + interaction_flops / rate


def step_cost(
    tables: Sequence[TableStats],
    shards: Sequence[Shard],
    batch_per_rank: Sequence[int],
    devices: Sequence[DeviceCost],
    network: NetworkCost,
    dense_params: int,
    interaction_flops_per_sample: float = 0.0,
    nodes: Sequence[int] | None = None,
) -> StepCost:
    """Stage times of one training step for a placement (see the module docstring).
    `nodes`: each rank's node (default: all on one node)."""
    world = len(batch_per_rank)
    b = np.asarray(batch_per_rank, dtype=np.float64)
    node = np.zeros(world, dtype=np.int64) if nodes is None else np.asarray(nodes, np.int64)
    ex = _Exchange(b, node)
    lookup, seq_lookups, seq_bytes, dp_bytes, (n_split, split_lookups) = _shard_work(
        tables, shards, devices, ex
    )
    emb, ids, sent, (emb_parts, ids_parts), emb_latency = ex.times(network)
    dense = [
        float(n * dense_s_per_sample(d, dense_params, interaction_flops_per_sample))
        for n, d in zip(b, devices, strict=True)
    ]
    grad_bytes = dense_params * FLOAT_BYTES + dp_bytes
    allreduce = allreduce_s(grad_bytes, world, network, ranks_per_node(node))
    comm_cpu = _comm_cpu_s(
        ex, network, grad_bytes, devices, {"ids": ids, "emb": emb, "allreduce": [allreduce] * world}
    )
    split_work = [
        n * d.sequence_s_per_lookup
        + nb * d.sequence_s_per_byte
        + (d.sequence_s_fixed if n else 0.0)
        + n_split * d.split_s_per_table
        + r_b * split_lookups * d.split_s_per_lookup
        for n, nb, r_b, d in zip(
            seq_lookups.tolist(), seq_bytes.tolist(), b.tolist(), devices, strict=True
        )
    ]
    lookup_bwd = [x * d.emb_bwd_factor for x, d in zip(lookup, devices, strict=True)]
    per_sample = [
        float(n) * (d.input_s_per_sample + d.sample_overhead_s)
        for n, d in zip(b, devices, strict=True)
    ]
    fixed = [d.step_overhead_s + x for d, x in zip(devices, per_sample, strict=True)]
    return StepCost(
        lookup_fwd_s=lookup.tolist(),
        lookup_bwd_s=lookup_bwd,
        ids_a2a_s=ids,
        emb_a2a_fwd_s=emb,
        emb_a2a_bwd_s=list(emb),
        dense_s=dense,
        allreduce_s=allreduce,
        overhead_s=max(d.step_overhead_s for d in devices),
        micro_batch_s=max(d.micro_batch_overhead_s for d in devices),
        emb_latency_s=emb_latency,
        input_s=max(per_sample),
        rank_fixed_s=fixed,
        a2a_bytes=sent,
        ids_a2a_parts_s=ids_parts,
        emb_a2a_parts_s=emb_parts,
        allreduce_link="nic" if len(set(node.tolist())) > 1 else "fabric",
        allreduce_bytes=grad_bytes,
        comm_cpu_s=comm_cpu,
        split_s=split_work,
        **_quota_work_s(devices, (lookup.tolist(), lookup_bwd, dense, split_work, fixed)),
    )


def _quota_work_s(devices: Sequence[DeviceCost], stages: tuple) -> dict:
    """`StepCost`'s fields for ranks at a share of a core (none where every rank has a whole
    one): per rank its work outside the network's, the stages' (`stages`: per-rank lists of
    lookups both ways, dense, sequence, fixed and per-sample overheads), and each
    micro-batch's past the first."""
    if all(d.core_speed >= 1.0 for d in devices):
        return {}
    return {
        "work_s": [sum(s) for s in zip(*stages, strict=True)],
        "micro_work_s": [d.micro_batch_overhead_s for d in devices],
    }


def _shard_work(
    tables: Sequence[TableStats],
    shards: Sequence[Shard],
    devices: Sequence[DeviceCost],
    ex: _Exchange,
) -> tuple:
    """Each shard's part of a step: per rank its lookup time, its sequence lookups and their
    bytes, the bytes of data-parallel copies (all-reduced), and the tables split into hot
    and cold parts with their lookups a sample; its exchange added to `ex`."""
    b, node, world = ex.b, ex.node, ex.world
    by_name = {t.name: t for t in tables}
    seq_lookups = np.zeros(world)  # cold lookups a rank looks up or pools as sequences
    seq_bytes = np.zeros(world)  # ... and the bytes of their vectors
    dp_bytes = 0
    split: dict[str, float] = {}  # split tables' lookups a sample
    groups: dict[tuple[str, int], list[float]] = {}  # table-row-wise: [ranks, their batch]
    for s in shards:
        if s.node_reduce and not s.dp:
            g = groups.setdefault((s.table, int(node[s.rank])), [0, 0.0])
            g[0], g[1] = g[0] + 1, g[1] + b[s.rank]
    read_s = np.array([1 / d.emb_read_bytes_per_s for d in devices])
    host_s = np.array([1 / d.host_read_bytes_per_s for d in devices])
    # per-shard arithmetic on Python floats (a numpy scalar costs ten times as much): the
    # same float64 operations in the same order
    reads, hosts, nodes, looked = read_s.tolist(), host_s.tolist(), node.tolist(), [0.0] * world
    local = 0.0  # bytes per sample every rank looks up in its own data-parallel copies
    for s in shards:
        t = by_name[s.table]
        share = s.rows / t.rows if s.lookup_share is None else s.lookup_share
        if s.dp:  # looked up locally for the rank's own samples; gradients all-reduced
            local += t.lookups_per_sample * share * s.cols * t.weight_bytes
            if s.rows < t.rows and t.name not in split:  # a hot part: the table is split
                split[t.name] = t.lookups_per_sample
            dp_bytes += s.rows * s.cols * t.weight_bytes
            continue
        looked_up = ex.total * t.lookups_per_sample * share * s.cols * t.weight_bytes
        hit = 1.0 if s.tier == Tier.hbm else (s.hit_rate if s.tier == Tier.cached else 0.0)
        looked[s.rank] += looked_up * (hit * reads[s.rank] + (1 - hit) * hosts[s.rank])
        if s.sparse_exchange:
            cold = t.lookups_per_sample * share
            seq_lookups[s.rank] += ex.total * cold
            seq_lookups += b * cold  # every rank pools its own samples' cold lookups
            seq_bytes[s.rank] += ex.total * cold * s.cols * FLOAT_BYTES
            seq_bytes += b * cold * s.cols * FLOAT_BYTES
        vec = vectors_per_sample(s, t) * s.cols * FLOAT_BYTES
        group, members_batch = groups[(s.table, nodes[s.rank])] if s.node_reduce else (0, 0)
        ids = t.lookups_per_sample * share * ID_BYTES + LENGTH_BYTES
        ex.add(s.rank, vec, ids, group, members_batch)
    lookup = np.array(looked) + b * local * read_s
    return lookup, seq_lookups, seq_bytes, dp_bytes, (len(split), sum(split.values()))


def _comm_cpu_s(
    ex: _Exchange,
    network: NetworkCost,
    grad_bytes: float,
    devices: Sequence[DeviceCost],
    wall_s: dict[str, list[float]],
) -> dict[str, list[float]]:
    """Per rank, the compute time each exchange's CPU work takes (`StepCost.comm_cpu_s`):
    the bytes it sends and receives on each link times that link's CPU cost, over the
    rank's core speed, at most the exchange's own time on that rank (`wall_s`): the link's
    calibrated time already holds a transfer its CPU work slowed. The ring all-reduce sends
    and receives 2(W-1)/W of the bytes each."""
    intra, inter = network.intra_alltoall.cpu_s_per_byte, network.alltoall.cpu_s_per_byte
    if not (intra or inter or network.allreduce.cpu_s_per_byte):
        return {}
    (si, ri, se, re), (isi, iri, ise, ire) = ex._bytes()
    world = ex.world
    ring = 2 * ring_bytes(grad_bytes, world)  # sent and received
    cpu = {
        "ids": (isi + iri) * intra + (ise + ire) * inter,
        "emb": (si + ri) * intra + (se + re) * inter,
        "allreduce": np.full(world, ring * network.allreduce.cpu_s_per_byte),
    }
    speed = np.array([d.core_speed for d in devices])
    return {k: np.minimum(v / speed, wall_s[k]).tolist() for k, v in cpu.items()}


class _Exchange:
    """Bytes each rank sends and receives in the all-to-alls, within its node and across.

    A shard on rank o sends, per sample of rank r != o, `vec` bytes forward (gradients the
    same back) and receives `ids` bytes of ids; a table-row-wise group of g ranks on a node
    instead reduce-scatters its partial sums for all samples within the group ((g-1)/g of
    them leave each member) and each member sends 1/g of the vectors for the samples of
    every other rank: across nodes, and to ranks of its node outside the group (TorchRec's
    groups span `local_world_size` ranks, which need not match our nodes)."""

    def __init__(self, batch: np.ndarray, node: np.ndarray) -> None:
        self.b, self.node = batch, node
        self.total = float(batch.sum())
        self.node_batch = np.bincount(node, weights=batch)
        self.world = len(batch)
        # `add`'s per-shard sums: Python floats in lists (numpy scalars cost ten times as
        # much), numpy arrays from `_bytes` on
        self._node, self._b = node.tolist(), batch.tolist()
        self._node_batch = self.node_batch.tolist()
        zeros = lambda: [0.0] * self.world  # noqa: E731
        self.sent_intra, self.sent_inter, self.recv_intra, self.recv_inter = (
            zeros() for _ in "1234"
        )
        self.vec_own, self.ids_own, self.cross_own = zeros(), zeros(), zeros()
        self.member_vec = zeros()  # per rank: vectors of the groups it belongs to

    def add(self, owner: int, vec: float, ids: float, group: int = 0, members_batch=0.0) -> None:
        """A shard on `owner`; `group` > 0: one of that many table-row-wise shards of a
        table on the owner's node, whose ranks hold `members_batch` samples."""
        n = self._node[owner]
        local = self._node_batch[n] - self._b[owner]  # samples of the owner's node's others
        remote = self.total - self._node_batch[n]
        self.ids_own[owner] += ids
        if group:  # table-row-wise: reduce-scatter in the group, then 1/g of the rest
            scatter = vec * self.total * (group - 1) / group
            self.sent_intra[owner] += scatter + vec * (self._node_batch[n] - members_batch) / group
            self.recv_intra[owner] += scatter
            self.sent_inter[owner] += vec * remote / group
            self.cross_own[owner] += vec / group
            self.member_vec[owner] += vec
            return
        self.vec_own[owner] += vec
        self.sent_intra[owner] += vec * local
        self.sent_inter[owner] += vec * remote

    def times(
        self, network: NetworkCost
    ) -> tuple[list[float], list[float], list[float], tuple, float]:
        """Per rank: the embedding exchange's time (one way), the ids', the bytes it sends
        in all of them (forward, backward and ids), and both times split by link: per
        rank, on its NIC share (`nic`, across nodes) and within its node (`fabric`), each
        with that link's latency; and the embedding exchange's latency (each collective's,
        the largest any rank pays: what each further chunk of it pays again)."""
        (si, ri, se, re), (isi, iri, ise, ire) = self._bytes()
        intra, inter = network.intra_alltoall, network.alltoall

        def time(si, ri, se, re) -> tuple[list[float], float]:
            """Per rank, and the largest latency a rank pays."""
            out, most = [], 0.0
            for a, c, e, f in zip(si, ri, se, re, strict=True):
                busy = max(max(a, c) / intra.bytes_per_s, max(e, f) / inter.bytes_per_s)
                latency = inter.latency_s if max(e, f) > 0 else intra.latency_s
                out.append(latency + busy if busy > 0 else 0.0)
                most = max(most, latency if busy > 0 else 0.0)
            return out, most

        def on(link: LinkCost, sent: np.ndarray, received: np.ndarray) -> list[float]:
            busy = np.maximum(sent, received) / link.bytes_per_s
            return np.where(busy > 0, link.latency_s + busy, 0.0).tolist()

        emb, emb_latency = time(si, ri, se, re)
        ids, _ = time(isi, iri, ise, ire)
        sent = 2 * (si + se) + isi + ise
        parts = (
            {"nic": on(inter, se, re), "fabric": on(intra, si, ri)},
            {"nic": on(inter, ise, ire), "fabric": on(intra, isi, iri)},
        )
        return emb, ids, sent.tolist(), parts, emb_latency

    def _bytes(self) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Per rank (sent within its node, received within, sent across, received across),
        for the embeddings (one way) and for the ids."""
        b, node = self.b, self.node
        sent_intra, sent_inter, vec_own, ids_own, cross_own, member_vec = map(
            np.array,
            (
                self.sent_intra,
                self.sent_inter,
                self.vec_own,
                self.ids_own,
                self.cross_own,
                self.member_vec,
            ),
        )
        per_node = lambda x: np.bincount(node, weights=x, minlength=len(self.node_batch))  # noqa: E731
        vec_node, ids_node, cross_node = per_node(vec_own), per_node(ids_own), per_node(cross_own)
        # vectors arrive for a rank's own samples from every owner but itself
        recv_intra = np.array(self.recv_intra) + b * (vec_node[node] - vec_own)
        recv_inter = np.array(self.recv_inter) + b * (vec_node.sum() - vec_node[node])
        recv_inter += b * (cross_node.sum() - cross_node[node])
        recv_intra += b * (cross_node[node] - member_vec)  # from a group it is not in
        # ids go the other way: from every rank to each owner, for the sender's samples
        ids_sent_intra = b * (ids_node[node] - ids_own)
        ids_sent_inter = b * (ids_node.sum() - ids_node[node])
        ids_recv_intra = ids_own * (self.node_batch[node] - b)
        ids_recv_inter = ids_own * (self.total - self.node_batch[node])
        return (
            (sent_intra, recv_intra, sent_inter, recv_inter),
            (ids_sent_intra, ids_recv_intra, ids_sent_inter, ids_recv_inter),
        )


def dot_interaction_flops(features: int, dim: int) -> float:
    """Forward + backward FLOPs per sample of DLRM's pairwise dot interaction of `features`
    vectors (the tables plus the dense arch output): a features x features Gram matrix."""
    return 6.0 * features * features * dim


def datasheet_device_cost(device: RankDevice, precision: str = "fp32") -> DeviceCost:
    """A GPU's constants from its datasheet and the assumed efficiencies (sharding.constants),
    its dense part at `precision`."""
    speed = device.speed * precision_factor(device.kind, precision)
    return DeviceCost(**datasheet_rates(device.hbm_gbyte_s, speed, device.host_to_device_gbyte_s))


def spec_network_cost(gbps: float, latency_us: float) -> NetworkCost:
    link = LinkCost(latency_s=latency_us * 1e-6, bytes_per_s=gbps * 1e9 / 8)
    return NetworkCost(alltoall=link, allreduce=link)
