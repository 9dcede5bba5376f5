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
  feature (TorchRec's pooled output a2a sends empty bags too). Time = latency + the larger of
  bytes sent and received / bandwidth.
- dense: 6 FLOPs per parameter and sample (2 forward, 4 backward) / `dense_flops_per_s`,
  plus the feature interaction's (DLRM's dot products, `dot_interaction_flops`) /
  `interaction_flops_per_s` (batched small products run slower than the MLPs' GEMMs).
- all-reduce of dense gradients and of data-parallel tables: ring, 2(W-1)/W x bytes.
- a fixed per-step overhead (framework, Python, kernel launches), a per-sample one
  (`sample_overhead_s`: id routing, permutes, loss), and on CPU ranks the batch assembly
  that runs on the training thread (`input_s_per_sample`).
Each stage ends in a collective, so the step is the sum over stages of the slowest rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from sharding.types import RankDevice

FLOAT_BYTES = 4
ID_BYTES = 8
LENGTH_BYTES = 4


class Tier(str, Enum):
    hbm = "hbm"  # device memory (fused)
    cached = "cached"  # host memory with an HBM cache of hot rows (fused_uvm_caching)
    host = "host"  # host memory (fused_uvm)


class Schedule(str, Enum):
    plain = "plain"  # nothing overlapped
    sparse_dist = "sparse_dist"  # TorchRec: the next batch's id all-to-all under this one
    nested = "nested"  # also the embedding all-to-all, in micro-batches under dense compute


# Train pipelines by name (pipelines.types.PipelineName) -> the schedule that models them.
# TorchRec's SemiSync hides the embedding exchange under the previous batch's dense work
# (one step stale), which the nested schedule's many-micro-batch limit approximates.
_PIPELINE_SCHEDULES = {"plain": "plain", "base": "plain", "sparse_dist": "sparse_dist",
                       "semi_sync": "nested", "nested": "nested"}  # fmt: skip


def schedule_of(pipeline: str) -> Schedule:
    if pipeline not in _PIPELINE_SCHEDULES:
        raise ValueError(f"no cost model schedule for pipeline '{pipeline}'; "
                         f"known: {sorted(_PIPELINE_SCHEDULES)}")  # fmt: skip
    return Schedule(_PIPELINE_SCHEDULES[pipeline])


@dataclass(frozen=True)
class TableStats:
    name: str
    rows: int
    dim: int
    lookups_per_sample: float = 1.0


@dataclass(frozen=True)
class Shard:
    """Part of a table on one rank: `rows` x `cols`. Data-parallel copies have dp=True."""

    table: str
    rank: int
    rows: int
    cols: int
    tier: Tier = Tier.hbm
    hit_rate: float = 1.0  # share of lookups served from HBM (cached tier)
    dp: bool = False
    # share of the table's lookups this shard serves; None: its share of rows (row-wise
    # shards see ids uniformly). A frequency split sets it: hot part cov(h), cold 1 - cov(h).
    lookup_share: float | None = None
    # True: only looked-up vectors cross the network (a variable-length exchange of a
    # cold part); False: TorchRec's pooled exchange, one vector per sample, empty or not.
    sparse_exchange: bool = False
    cache_rows: int = 0  # cached tier: rows the HBM cache holds (0: hit_rate x rows)


@dataclass(frozen=True)
class DeviceCost:
    emb_read_bytes_per_s: float
    host_read_bytes_per_s: float
    emb_bwd_factor: float
    dense_flops_per_s: float
    step_overhead_s: float
    input_s_per_sample: float = 0.0  # batch assembly on the training thread (0: runs ahead)
    interaction_flops_per_s: float = 0.0  # DLRM's batched dot products; 0: dense_flops_per_s
    sample_overhead_s: float = 0.0  # framework work per sample (id routing, permutes, loss)
    # CPU work per cold lookup exchanged as a sequence (a split table's cold part): the
    # embedding collection's per-id output, the variable-length exchange's bookkeeping and
    # the pooling after it; counted on the rank that looks it up and on the one that pools
    sequence_s_per_lookup: float = 0.0
    sequence_s_fixed: float = 0.0  # per step, on a rank with any sequence lookups


@dataclass(frozen=True)
class LinkCost:
    latency_s: float
    bytes_per_s: float

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class NetworkCost:
    alltoall: LinkCost
    allreduce: LinkCost


@dataclass
class OptimizerState:
    """Bytes of optimizer state per embedding row of dim d: rowwise Adagrad keeps one float."""

    per_row_bytes: int = FLOAT_BYTES
    per_value_bytes: int = 0


@dataclass
class StepCost:
    """Per-rank stage times (s) and the step time under a schedule."""

    lookup_fwd_s: list[float]
    lookup_bwd_s: list[float]
    ids_a2a_s: list[float]
    emb_a2a_fwd_s: list[float]
    emb_a2a_bwd_s: list[float]
    dense_s: list[float]
    allreduce_s: float
    overhead_s: float
    input_s: float = 0.0  # batch assembly and per-sample framework work
    sequence_s: list[float] = field(default_factory=list)  # per rank: sequence exchange CPU
    a2a_bytes: list[float] = field(default_factory=list)  # per rank, fwd + bwd, sent

    def step_s(self, schedule: Schedule = Schedule.plain, micro_batches: int = 1) -> float:
        lookup = max(self.lookup_fwd_s) + max(self.lookup_bwd_s)
        ids, dense = max(self.ids_a2a_s), max(self.dense_s)
        emb = max(self.emb_a2a_fwd_s) + max(self.emb_a2a_bwd_s)
        fixed = lookup + dense + self.allreduce_s + self.overhead_s + self.input_s
        fixed += max(self.sequence_s, default=0.0)
        if schedule == Schedule.plain:
            return fixed + ids + emb
        if schedule == Schedule.sparse_dist:  # the embedding exchange stays exposed
            return fixed + emb + max(0.0, ids - dense)
        n = max(1, micro_batches)  # nested: 1/n of the embedding exchange stays exposed; the
        # rest and the next batch's ids hide under dense compute as far as it lasts
        return fixed + emb / n + max(0.0, emb * (n - 1) / n + ids - dense)


def exposed_exchange_passes(schedule: Schedule, micro_batches: int = 1) -> float:
    """How many whole embedding exchanges (forward and backward: 2) a schedule leaves
    exposed at least: all of them, except under `nested`, 1/N of them (`StepCost.step_s`)."""
    return 2.0 / max(1, micro_batches) if schedule == Schedule.nested else 2.0


def vectors_per_sample(s: Shard, t: TableStats) -> float:
    """Vectors a shard's owner sends per sample of another rank (and gradients back): one
    pooled vector, or with a cold-only exchange one per lookup it serves."""
    share = s.rows / t.rows if s.lookup_share is None else s.lookup_share
    return t.lookups_per_sample * share if s.sparse_exchange else 1.0


def memory_bytes(
    shards: Sequence[Shard], world: int, opt: OptimizerState | None = None
) -> list[dict[str, int]]:
    """Per rank: bytes in HBM and in host memory, weights plus optimizer state."""
    opt = opt or OptimizerState()
    out = [{"hbm": 0, "host": 0} for _ in range(world)]
    for s in shards:
        weights = s.rows * s.cols * FLOAT_BYTES
        state = s.rows * opt.per_row_bytes + s.rows * s.cols * opt.per_value_bytes
        if s.tier == Tier.hbm:
            out[s.rank]["hbm"] += weights + state
        elif s.tier == Tier.host:
            out[s.rank]["host"] += weights + state
        else:  # cached: all rows in host memory, the hot ones mirrored in HBM
            out[s.rank]["host"] += weights + state
            cached = s.cache_rows * s.cols * FLOAT_BYTES if s.cache_rows else weights * s.hit_rate
            out[s.rank]["hbm"] += int(cached)
    return out


def step_cost(
    tables: Sequence[TableStats],
    shards: Sequence[Shard],
    batch_per_rank: Sequence[int],
    devices: Sequence[DeviceCost],
    network: NetworkCost,
    dense_params: int,
    interaction_flops_per_sample: float = 0.0,
) -> StepCost:
    """Stage times of one training step for a placement (see the module docstring)."""
    world = len(batch_per_rank)
    global_batch = sum(batch_per_rank)
    by_name = {t.name: t for t in tables}
    lookup = [0.0] * world
    sent = [0.0] * world  # pooled embedding bytes a rank sends forward
    recv = [0.0] * world
    ids_sent = [0.0] * world
    ids_recv = [0.0] * world
    seq_lookups = [0.0] * world  # cold lookups a rank looks up or pools as sequences
    dp_bytes = 0
    for s in shards:
        t = by_name[s.table]
        dev = devices[s.rank]
        samples = batch_per_rank[s.rank] if s.dp else global_batch
        share = s.rows / t.rows if s.lookup_share is None else s.lookup_share
        looked_up = samples * t.lookups_per_sample * share * s.cols * FLOAT_BYTES
        hit = 1.0 if s.tier == Tier.hbm else (s.hit_rate if s.tier == Tier.cached else 0.0)
        lookup[s.rank] += looked_up * hit / dev.emb_read_bytes_per_s
        lookup[s.rank] += looked_up * (1 - hit) / dev.host_read_bytes_per_s
        if s.dp:
            if s.rank == 0:  # its gradients are all-reduced once, whatever the world size
                dp_bytes += s.rows * s.cols * FLOAT_BYTES
            continue
        if s.sparse_exchange:
            seq_lookups[s.rank] += samples * t.lookups_per_sample * share
            for r in range(world):
                seq_lookups[r] += batch_per_rank[r] * t.lookups_per_sample * share
        for r in range(world):
            if r == s.rank:
                continue
            vec = batch_per_rank[r] * vectors_per_sample(s, t) * s.cols * FLOAT_BYTES
            sent[s.rank] += vec
            recv[r] += vec
            idb = batch_per_rank[r] * (t.lookups_per_sample * share * ID_BYTES + LENGTH_BYTES)
            ids_sent[r] += idb
            ids_recv[s.rank] += idb
    a2a = network.alltoall
    emb = [a2a.time_s(max(sent[r], recv[r])) for r in range(world)]
    ids = [a2a.time_s(max(ids_sent[r], ids_recv[r])) for r in range(world)]
    dense = []
    for b, d in zip(batch_per_rank, devices, strict=True):
        inter_rate = d.interaction_flops_per_s or d.dense_flops_per_s
        mlp_s = 6.0 * dense_params / d.dense_flops_per_s
        dense.append(b * (mlp_s + interaction_flops_per_sample / inter_rate))
    grad_bytes = dense_params * FLOAT_BYTES + dp_bytes
    allreduce = 0.0
    if world > 1:  # ring all-reduce: 2(W-1) latency hops, 2(W-1)/W of the bytes each way
        link = network.allreduce
        ring_bytes = 2 * (world - 1) / world * grad_bytes
        allreduce = 2 * (world - 1) * link.latency_s + ring_bytes / link.bytes_per_s
    return StepCost(
        lookup_fwd_s=lookup,
        lookup_bwd_s=[x * d.emb_bwd_factor for x, d in zip(lookup, devices, strict=True)],
        ids_a2a_s=ids,
        emb_a2a_fwd_s=emb,
        emb_a2a_bwd_s=list(emb),
        dense_s=dense,
        allreduce_s=allreduce,
        overhead_s=max(d.step_overhead_s for d in devices),
        input_s=max(
            b * (d.input_s_per_sample + d.sample_overhead_s)
            for b, d in zip(batch_per_rank, devices, strict=True)
        ),
        a2a_bytes=[2 * sent[r] + ids_sent[r] for r in range(world)],
        sequence_s=[
            n * d.sequence_s_per_lookup + (d.sequence_s_fixed if n else 0.0)
            for n, d in zip(seq_lookups, devices, strict=True)
        ],
    )


def dot_interaction_flops(features: int, dim: int) -> float:
    """Forward + backward FLOPs per sample of DLRM's pairwise dot interaction of `features`
    vectors (the tables plus the dense arch output): a features x features Gram matrix."""
    return 6.0 * features * features * dim


# GPU constants where no calibration exists. Sources: TorchRec's planner defaults
# (torchrec.distributed.planner.constants: BWD_COMPUTE_MULTIPLIER = 2; it assumes kernels
# reach about half of HBM bandwidth), and a dense MFU of 0.35 (typical of DLRM MLPs in
# MLPerf submissions). These are assumptions until calibrated on such a GPU.
GPU_EMB_EFFICIENCY = 0.5
GPU_BWD_FACTOR = 2.0
GPU_DENSE_MFU = 0.35
A100_DENSE_FLOPS_PER_S = 312e12
GPU_STEP_OVERHEAD_S = 1e-3


def datasheet_device_cost(device: RankDevice) -> DeviceCost:
    return DeviceCost(
        emb_read_bytes_per_s=device.hbm_gbps * 1e9 * GPU_EMB_EFFICIENCY,
        host_read_bytes_per_s=device.host_to_device_gbps * 1e9,
        emb_bwd_factor=GPU_BWD_FACTOR,
        dense_flops_per_s=device.speed * A100_DENSE_FLOPS_PER_S * GPU_DENSE_MFU,
        step_overhead_s=GPU_STEP_OVERHEAD_S,
    )


def spec_network_cost(gbps: float, latency_us: float) -> NetworkCost:
    link = LinkCost(latency_s=latency_us * 1e-6, bytes_per_s=gbps * 1e9 / 8)
    return NetworkCost(alltoall=link, allreduce=link)
