"""The sharding package's data types, in one module its role modules import (as TorchRec's
planner keeps its `types.py`): the cluster description and planner config (also the Hydra
schemas for `conf/cluster/` and `conf/planner/`, registered by `recsys.config`; this package
never imports Hydra), the cost model's inputs and outputs (tables, shards, device and link
costs, a step's stage times), and what every planner takes and returns (`PlanInputs`,
`Plan`). The formulas that use them live in cost_model.py, plan_eval.py and bound.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from sharding.errors import UserError


@dataclass
class DeviceGroup:
    """`count` devices of one kind on a node; unset fields come from the catalog. `kind` is
    required (a cluster file without it is refused, not planned as CPU ranks). Each field
    carries its unit in its name: GiB, GB/s (bytes), TFLOP/s."""

    kind: str
    count: int = 1
    hbm_gib: float | None = None  # memory of one device
    hbm_gbyte_s: float | None = None  # its memory bandwidth
    dense_tflops: float | None = None  # dense tensor-core TFLOP/s, bf16 (fp32 if it has none)
    speed: float | None = None  # instead of dense_tflops: relative to an A100's bf16 (312)
    # local CPU ranks only: the cores these ranks are pinned to (taskset), e.g. [0]
    cores: list[int] | None = None
    # emulated clusters only: the fraction of one core each of these ranks may use (a CFS
    # quota in the rank's own cpu cgroup), in (0, 1]; None: no quota
    share: float | None = None


@dataclass
class NodeGroup:
    """`count` identical nodes."""

    count: int = 1
    host_memory_gib: float = 16.0
    host_to_device_gbyte_s: float = 12.0  # GB/s (bytes), PCIe or equivalent, per device
    devices: list[DeviceGroup] = field(default_factory=lambda: [DeviceGroup("cpu")])
    # these nodes' own link between their devices (NVLink, or PCIe), Gbit/s per device one
    # way; None: network.intra_node_gbit_s
    intra_node_gbit_s: float | None = None


@dataclass
class NetworkSpec:
    """Per-device link bandwidth, Gbit/s (bits) one way (NVLink / NIC share), and one-way
    latency. Required for GPU clusters (and inter_node_gbit_s for emulated ones): a
    cluster file without them is refused, not planned on made-up links."""

    intra_node_gbit_s: float | None = None  # between devices of one node (NVLink, PCIe)
    inter_node_gbit_s: float | None = None  # each device's share of its node's NIC
    latency_us: float = 10.0
    # ring: the all-reduce is a ring, 2(W-1) latency hops (what gloo does, and what the
    # presets' published plans assumed); nccl: NCCL's choice, a ring or a double binary
    # tree (2 log2 W hops) whichever is faster, as it is at hundreds of GPUs
    allreduce: str = "ring"


@dataclass
class EmulationSpec:
    """Run a layout of CPU ranks on this one machine as a mixed, multi-node cluster (root):
    each node in its own network namespace, joined to the others through a bridge by a veth
    pair shaped by tbf at `network.inter_node_gbit_s` (both directions); each rank in its own
    cpu cgroup with a CFS quota of its device entry's `share`. See recsys/emulation.py."""

    enabled: bool = False
    # tbf burst of each node's link: small enough that chunked traffic gets no credit from
    # idle gaps. Measured at 200 Mbit/s through the switch (tests/ranks/test_emulation.py), 5 ms
    # gaps: 24kb let 16 KB chunks through at 5x the rate and 64 KB ones at 1.35x; 8kb gave
    # 0.93x-0.97x for 64 KB to 256 KB chunks (16 KB chunks, half of which fit the bucket:
    # 0.97x in one run, 1.14x in another)
    burst: str = "8kb"
    # CFS period of the ranks' quotas; 0: the shortest one at which every rank's quota is
    # the kernel's 1 ms minimum or more (`sharding.cluster.cfs_period_us`; 4 ms at a 0.25
    # share). A rank that waits on the network leaves its quota unused only for the rest of
    # the period it waits in: with 100 ms periods a 0.25 share computed at nearly a whole
    # core's speed after each wait (docs/clusters.md, "How faithful")
    cfs_period_us: int = 0


@dataclass
class ClusterSpec:
    """A cluster layout: nodes, their devices, host memory and the network between them."""

    name: str = "local_cpu2"
    nodes: list[NodeGroup] = field(default_factory=lambda: [NodeGroup()])
    network: NetworkSpec = field(default_factory=NetworkSpec)
    emulation: EmulationSpec = field(default_factory=EmulationSpec)
    # train and plan on these ranks of the layout alone (its numbering), the rest left out
    # (sharding.subsets); None: every rank
    only_ranks: list[int] | None = None


@dataclass(frozen=True)
class RankDevice:
    """One rank of a resolved cluster: its device with every number filled in."""

    rank: int
    node: int
    local_rank: int
    kind: str
    hbm_bytes: int
    hbm_gbyte_s: float
    speed: float
    host_bytes: int  # this rank's share of its node's host memory
    host_to_device_gbyte_s: float = 12.0  # GB/s, PCIe or equivalent
    cores: tuple[int, ...] | None = None  # pinned CPU cores (local CPU ranks)
    share: float | None = None  # emulated CPU rank: its fraction of one core


class PlannerName(str, Enum):
    torchrec = "torchrec"  # TorchRec's EmbeddingShardingPlanner, fairly configured
    hybrid = "hybrid"  # ours: frequency- and speed-aware (sharding.planners)
    greedy_size = "greedy_size"  # largest table to the rank with most free memory
    round_robin = "round_robin"  # table i to rank i mod world


@dataclass
class PlannerConfig:
    """Which planner places the embedding tables, and its knobs."""

    name: PlannerName = PlannerName.torchrec
    # Share of each device's memory kept free for the allocator and what the accounting
    # leaves out (sharding.memory counts tables, buffers, dense state and activations);
    # every planner is told the same room, TorchRec's as its storage reservation.
    storage_reservation: float = 0.15
    # hybrid plans: the hot rows to replicate are the most frequent ids in this many
    # training batches of every rank, counted when training starts
    hot_id_batches: int = 50
    # true: the cold part of a split table is a sequence EmbeddingCollection whose exchange
    # carries only its own lookups; false: TorchRec's pooled exchange, one vector per
    # sample, empty bag or not (then only whole tables are worth replicating)
    cold_only_exchange: bool = True
    # local CPU clusters: the calibrated link between ranks the plan assumes (loopback,
    # veth_1gbit; see sharding/calibration/local_cpu.json); GPU clusters use their spec
    link: str | None = None
    # torchrec: the narrowest column-wise piece it may cut: hybrid's narrowest (4), the
    # same freedom (TorchRec's own default is 128, which never cuts a 128-wide table)
    torchrec_min_partition: int = 4
    # torchrec: stop proposing after this many seconds and keep the best plan so far
    # (TorchRec's own timeout; None: search until its proposers are done)
    torchrec_timeout_s: float | None = None
    # torchrec: may it replicate whole tables (data_parallel)? pipeline=semi_sync turns it
    # off: TorchRec's SemiSync cannot train data-parallel tables (docs/pipelines.md)
    torchrec_data_parallel: bool = True
    # torchrec: the sharding types it may choose (None: every type it supports here);
    # [table_row_wise] is the baseline EMBark and MLPerf's GPU runs compare against
    torchrec_sharding_types: list[str] | None = None
    # CPU ranks: a calibration file to plan with (`python -m benchmarks.calibrate`'s
    # local_cpu.json of some day); None: the saved one, sharding/calibration/local_cpu.json
    calibration: str | None = None
    # our planners: also plan 2D groups (the tables sharded within groups of whole nodes,
    # the groups replicated; sharding.two_d) and keep the faster; the plan says which
    two_d: bool = False
    # hybrid: also plan each part of the cluster (whole nodes, the fastest device kinds;
    # sharding.subsets) at the same global batch and keep the fastest, leaving the other
    # devices out; the plan says which it weighed and why it left any out
    leave_out: bool = True


# --- the cost model's and the planners' data: what a planner takes and returns ---

FLOAT_BYTES = 4
ALL_RANKS = -1  # the rank of a data-parallel shard: a copy on every rank
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


@dataclass(frozen=True)
class TableStats:
    name: str
    rows: int
    dim: int
    lookups_per_sample: float = 1.0
    # bytes of one stored value: 4 (fp32), 2 (fp16 tables). Lookups return fp32, so what is
    # exchanged is 4 bytes a value either way; memory, lookup reads and a replicated copy's
    # gradient take these
    weight_bytes: int = FLOAT_BYTES


@dataclass(frozen=True)
class Shard:
    """Part of a table on one rank: `rows` x `cols`. A data-parallel part (dp=True) stands
    for a copy on every rank; its `rank` is ALL_RANKS."""

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
    # True: one of a table-row-wise group on its node (TorchRec's TWRW): its partial sums
    # are reduce-scattered within the node before one vector per sample crosses nodes
    node_reduce: bool = False


@dataclass(frozen=True)
class DeviceCost:
    emb_read_bytes_per_s: float
    host_read_bytes_per_s: float
    emb_bwd_factor: float
    dense_flops_per_s: float
    step_overhead_s: float
    input_s_per_sample: float = 0.0  # batch assembly on the training thread (0: runs ahead)
    # host CPU work per sample of the rank's batch that runs on cores of its own (GPU ranks:
    # batch assembly in the prefetch thread): under a pipelined schedule a floor on the step
    # (it runs ahead), in the plain loop part of it
    host_s_per_sample: float = 0.0
    interaction_flops_per_s: float = 0.0  # DLRM's batched dot products; 0: dense_flops_per_s
    sample_overhead_s: float = 0.0  # framework work per sample (id routing, permutes, loss)
    # CPU work per cold lookup exchanged as a sequence (a split table's cold part): the
    # embedding collection's per-id output, the variable-length exchange's bookkeeping and
    # the pooling after it; counted on the rank that looks it up and on the one that pools
    sequence_s_per_lookup: float = 0.0
    sequence_s_fixed: float = 0.0  # per step, on a rank with any sequence lookups
    # and per byte of each such lookup's vector (GPUs: per-id outputs and their gradients
    # written and read again in device memory)
    sequence_s_per_byte: float = 0.0
    # CPU work of a table split into hot and cold parts (either exchange), on every rank: a
    # step's per table (its ids remapped into two features, their keys in the exchange's
    # bookkeeping, the parts summed) and per lookup of the rank's own samples into it
    split_s_per_table: float = 0.0
    split_s_per_lookup: float = 0.0
    # the nested pipeline: each micro-batch's fixed work beyond one per step (its dense
    # forward and backward's launches, the chunk's bookkeeping), measured by calibration
    micro_batch_overhead_s: float = 0.0
    # CPU ranks: this rank's speed against one whole core of the calibration machine (an
    # emulated rank's share, measured), which CPU work measured at one core divides by
    core_speed: float = 1.0


@dataclass(frozen=True)
class LinkCost:
    latency_s: float
    bytes_per_s: float
    # CPU seconds (one core) a rank spends per byte it sends or receives over this link:
    # gloo's TCP work on CPU ranks, measured; 0 where the host's CPU does not move the bytes
    cpu_s_per_byte: float = 0.0

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class NetworkCost:
    """`alltoall`: the link between nodes (on a one-node cluster, the only link);
    `intra`: between ranks of one node, when it differs (NVLink); `allreduce`: the ring's."""

    alltoall: LinkCost
    allreduce: LinkCost
    intra: LinkCost | None = None
    tree_allreduce: bool = False  # a double binary tree where it beats the ring (NCCL's)
    # the dense reduction by node, then among the nodes' first ranks
    # (`trainer.dense_allreduce=hierarchical`; `cost_model.hierarchical_allreduce_s`)
    hierarchical_allreduce: bool = False

    @property
    def intra_alltoall(self) -> LinkCost:
        return self.intra or self.alltoall


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
    input_s: float = 0.0  # batch assembly and per-sample framework work, slowest rank
    micro_batch_s: float = 0.0  # each further micro-batch's fixed work (nested), slowest rank
    emb_latency_s: float = 0.0  # the embedding exchange's latency, paid again by each chunk
    # per rank: split tables' CPU work (the remap, the sequence exchange's)
    split_s: list[float] = field(default_factory=list)
    a2a_bytes: list[float] = field(default_factory=list)  # per rank, fwd + bwd, sent
    # per rank, for the step simulator's resources (empty: not split): each exchange's part
    # across nodes (the rank's NIC share) and within its node (NVLink / loopback), each with
    # its latency (the exchange's time above is their larger, with one latency), and the
    # batch's copy to the device over the host-device link (GPU ranks; 0 on CPU ranks)
    ids_a2a_parts_s: dict[str, list[float]] = field(default_factory=dict)
    emb_a2a_parts_s: dict[str, list[float]] = field(default_factory=dict)
    input_copy_s: list[float] = field(default_factory=list)
    host_input_s: list[float] = field(default_factory=list)  # per rank: its host work
    allreduce_link: str = "fabric"  # the all-reduce's queue: "nic" when it crosses nodes
    allreduce_bytes: float = 0.0  # what it reduces: dense gradients and replicated rows'
    # per rank, the compute time the network's CPU work takes from it (`LinkCost.cpu_s_per_byte`
    # / `DeviceCost.core_speed`): "ids", "emb" (one way), "allreduce"; empty: none
    comm_cpu_s: dict[str, list[float]] = field(default_factory=dict)
    # on emulated CPU ranks (a share of a core; empty elsewhere), per rank: its CPU work in
    # a step outside the network's (stages, overheads), and each micro-batch's past the first
    work_s: list[float] = field(default_factory=list)
    micro_work_s: list[float] = field(default_factory=list)
    # per rank: its fixed overhead plus its per-sample work (empty: `overhead_s` + `input_s`
    # on every rank)
    rank_fixed_s: list[float] = field(default_factory=list)

    def fixed_s(self, schedule: Schedule = Schedule.plain, micro_batches: int = 1) -> float:
        """The fixed overheads and per-sample work as the schedule runs them. Outside nested
        micro-batches each rank runs its own in one stretch between the all-reduce and the
        next batch's ids, so the step waits for the slowest rank's sum: a fast rank's larger
        batch overlaps a slow rank's larger fixed overhead (the sum of the two maxima
        overpriced speed-aware batch splits on mixed clusters: docs/clusters.md). Under
        nested micro-batches the per-sample work runs with the micro-batches and the fixed
        overhead under the next forward chunk: each at its own slowest rank."""
        nested = schedule == Schedule.nested and micro_batches > 1
        if nested or not self.rank_fixed_s:
            return self.overhead_s + self.input_s
        return max(self.rank_fixed_s)

    def cpu_floor_s(self, schedule: Schedule, micro_batches: int = 1) -> float:
        """The least the step can take on ranks that each hold a share of a core (a CFS
        quota): the busiest rank's whole CPU work, its own and its network's (ids, the
        embedding exchange both ways, the all-reduce), at its share's speed. The stages'
        critical path leaves a rank's gloo work inside the waits it runs in; a rank whose
        waits that work fills has no idle time left, and this binds."""
        if not self.work_s:
            return 0.0
        n = max(1, micro_batches) if schedule == Schedule.nested else 1
        world = len(self.work_s)
        net = [self.comm_cpu_s.get(k, [0.0] * world) for k in ("ids", "emb", "allreduce")]
        per_rank = zip(self.work_s, self.micro_work_s, *net, strict=True)
        return max(w + (n - 1) * m + i + 2 * e + a for w, m, i, e, a in per_rank)

    def hidden_cpu_s(self, schedule: Schedule, micro_batches: int = 1) -> float:
        """The network CPU work a schedule runs under dense compute, at the slowest rank:
        the next batch's ids (SparseDist, nested) and (n-1)/n of the embedding exchange
        both ways (nested)."""
        if schedule == Schedule.plain or not self.comm_cpu_s:
            return 0.0
        n = max(1, micro_batches) if schedule == Schedule.nested else 1
        ids, emb = self.comm_cpu_s["ids"], self.comm_cpu_s["emb"]
        return max(i + 2 * e * (n - 1) / n for i, e in zip(ids, emb, strict=True))

    def backward_tail_s(self, bwd_s: float) -> float:
        """From the gradient exchange's end (it took `bwd_s` past the slowest dense work) to
        the fixed overheads, outside nested micro-batches: each rank's lookup backward (the
        fused update) runs while the dense all-reduce, whose buckets start in the dense
        backward (`pipelines.dense_reduce`), crosses the link behind the gradients; on CPU
        ranks the all-reduce's own CPU work, run as the gradients cross, holds the update
        back by what it outlasts them. The overheads wait for both."""
        cpu = self.comm_cpu_s.get("allreduce") or [0.0] * len(self.lookup_bwd_s)
        update = max(b + max(0.0, c - bwd_s) for b, c in zip(self.lookup_bwd_s, cpu, strict=True))
        return max(self.allreduce_s, update)

    def chunk_s(self, exchange_s: float, n: int) -> float:
        """One of n chunks of an exchange that takes `exchange_s` whole: its share of the
        bytes and the latency again."""
        latency = min(self.emb_latency_s, exchange_s)
        return (exchange_s - latency) / n + latency

    def feed_s(self) -> tuple[float, float]:
        """Feeding the batch: the slowest rank's host work plus copy (what the plain loop
        waits for), and the longer of the slowest host work and the slowest copy (what a
        pipelined schedule, which runs both ahead on their own resources, is bounded by)."""
        host = self.host_input_s or [0.0] * len(self.dense_s)
        copy = self.input_copy_s or [0.0] * len(self.dense_s)
        serial = max(h + c for h, c in zip(host, copy, strict=True))
        return serial, max(max(host), max(copy))

    def step_s(self, schedule: Schedule = Schedule.plain, micro_batches: int = 1) -> float:
        serial, ahead = self.feed_s()
        if schedule == Schedule.plain:
            return self.device_step_s(schedule, micro_batches) + serial
        return max(self.device_step_s(schedule, micro_batches), ahead)

    def device_step_s(self, schedule: Schedule = Schedule.plain, micro_batches: int = 1) -> float:
        """The step once its batch is on the device (`step_s` without feeding it): its
        stages' critical path, at least the busiest rank's CPU work (`cpu_floor_s`)."""
        return max(
            self.critical_path_s(schedule, micro_batches), self.cpu_floor_s(schedule, micro_batches)
        )

    def critical_path_s(self, schedule: Schedule = Schedule.plain, micro_batches: int = 1) -> float:
        """The stages of one step as the schedule overlaps them, each at its slowest rank."""
        lookup = max(self.lookup_fwd_s) + max(self.lookup_bwd_s)
        ids, dense = max(self.ids_a2a_s), max(self.dense_s)
        seq = max(self.split_s, default=0.0)
        # what hides under compute lengthens it by its CPU work (CPU ranks)
        cpu = self.hidden_cpu_s(schedule, micro_batches)
        n = max(1, micro_batches)
        if schedule == Schedule.nested and n > 1:
            # pipelines.nested's order, two resources (the rank's compute, the link): the
            # last gradient chunk ends the micro-batches with nothing under it; then the
            # update and the next lookups run while the all-reduce is on the link; the
            # next batch's first chunk (sent after its lookups) arrives under the optimizer
            # step and the fixed overheads; the other chunks both ways and the next ids
            # cross under the micro-batches' dense and per-sample work. Each chunk pays the
            # exchange's latency, each micro-batch past the first its fixed work.
            fwd, bwd = max(self.emb_a2a_fwd_s), max(self.emb_a2a_bwd_s)
            chunk_fwd, chunk_bwd = self.chunk_s(fwd, n), self.chunk_s(bwd, n)
            work = dense + self.input_s + cpu + (n - 1) * self.micro_batch_s
            return (
                chunk_bwd
                + max(lookup, self.allreduce_s)
                + max(self.overhead_s, chunk_fwd)
                + max(work, (chunk_fwd + chunk_bwd) * (n - 1) + ids)
                + seq
            )
        # each rank's part of the embedding exchange starts when its own work before it ends
        # (its lookups and split tables' work; its dense work for the gradients)
        split = self.split_s or [0.0] * len(self.dense_s)
        before = [f + s for f, s in zip(self.lookup_fwd_s, split, strict=True)]
        fwd = exchange_past_s(before, self.emb_a2a_fwd_s)
        bwd = exchange_past_s(self.dense_s, self.emb_a2a_bwd_s)
        fixed = (
            max(self.lookup_fwd_s)
            + dense
            + self.backward_tail_s(bwd)
            + self.fixed_s(schedule)
            + seq
        )
        if schedule == Schedule.plain:
            return fixed + ids + fwd + bwd
        # SparseDist, and nested in one micro-batch: the embedding exchange stays exposed,
        # the next batch's ids hide under the dense work
        return fixed + fwd + bwd + max(0.0, ids - dense, cpu)


def exchange_past_s(before: Sequence[float], exchange: Sequence[float]) -> float:
    """How long an all-to-all outlasts the slowest rank's work before it (per rank: that
    work, and the rank's part of the exchange, the longer of its sending and receiving).
    Each rank's part starts when its own work ends: a fast rank's sends cross under a slow
    rank's compute (the link takes them, and the peers' kernels buffer them, before the
    peers call the collective), and the exchange ends when the last rank's part has. With
    equal work before it: the slowest rank's part."""
    return max(b + x for b, x in zip(before, exchange, strict=True)) - max(before)


class PlanDoesNotFitError(UserError, RuntimeError):
    """No placement of the tables fits the cluster's memory."""


Coverage = Callable[[int], float]  # hottest-k rows -> share of the table's lookups


@dataclass(frozen=True)
class PowerLawCoverage:
    """Share of lookups on the hottest k rows of a power law (the parametric profile); a
    class, not a closure, so that planner inputs pickle (the ranks receive them)."""

    rows: int
    exponent: float

    def __call__(self, k: int) -> float:
        if abs(self.exponent - 1.0) < 1e-9:
            return math.log1p(min(k, self.rows)) / math.log1p(self.rows)
        e = 1.0 - self.exponent
        return ((min(k, self.rows) + 1.0) ** e - 1.0) / ((self.rows + 1.0) ** e - 1.0)


@dataclass
class PlanInputs:
    tables: list[TableStats]
    coverage: dict[str, Coverage]  # per table: from a profile, or a parametric power law
    ranks: list[RankDevice]
    devices: list[DeviceCost]
    network: NetworkCost
    global_batch: int
    dense_params: int
    interaction_flops_per_sample: float = 0.0
    schedule: Schedule = Schedule.sparse_dist
    micro_batches: int = 1  # the nested schedule's N
    cpu: bool = False  # CPU ranks: table-wise, column-wise and data-parallel, one tier
    reserve: float = 0.15  # of each device's memory kept free (allocator; sharding.memory)
    optimizer: OptimizerState = field(default_factory=OptimizerState)
    cluster: str = ""
    # True: split tables' cold parts exchange only their own lookups (sequence embeddings);
    # False: TorchRec's pooled exchange, one vector per sample
    cold_only_exchange: bool = True
    precision: str = "fp32"  # the dense part's (`trainer.precision`), which `devices` price
    # the dense part's activations saved for backward, bytes per sample (measured on the
    # model: recsys.models.cost_inputs; 0: not counted), and its dense input features
    activation_bytes_per_sample: float = 0.0
    dense_features: int = 13

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def weight_bytes(self) -> int:
        """Bytes of one stored value: the tables' (one precision a model; the widest if not).
        Kept for the tables list it was taken from (the placer asks per piece it sizes):
        `tables` is replaced (`replace(inputs, tables=...)`), never changed item by item."""
        tables, kept = self.tables, self.__dict__.get("_weight_bytes")
        if kept is None or kept[0] is not tables or kept[1] != len(tables):
            kept = (tables, len(tables), max((t.weight_bytes for t in tables), default=FLOAT_BYTES))
            self.__dict__["_weight_bytes"] = kept
        return kept[2]

    def row_bytes(self, cols: int) -> int:
        per_value = self.weight_bytes + self.optimizer.per_value_bytes
        return cols * per_value + self.optimizer.per_row_bytes

    def hbm_budget(self) -> list[float]:
        """Bytes each rank may fill: device memory (a CPU rank's budget) less the reserve."""
        return [r.hbm_bytes * (1 - self.reserve) for r in self.ranks]

    def host_budget(self) -> list[float]:
        return [0.0 if self.cpu else r.host_bytes * (1 - self.reserve) for r in self.ranks]


@dataclass
class TablePlan:
    name: str
    rows: int
    dim: int
    sharding_type: str  # table_wise | column_wise | row_wise | data_parallel
    ranks: list[int]
    tier: Tier
    hot_rows: int  # rows served from fast memory: all of an HBM table, a cache's rows
    replicated_rows: int  # hottest rows replicated on every rank (data parallel)
    shards: list[Shard]
    cold_parts: int = 1  # > 1: the cold rows in that many row parts, one shard each


@dataclass
class Plan:
    planner: str
    cluster: str
    tables: list[TablePlan]
    batch_per_rank: list[int]
    feasible: bool = True
    est_step_ms: float = 0.0
    lower_bound_ms: float = 0.0
    planning_s: float = 0.0
    devices: list[dict] = field(default_factory=list)
    a2a_bytes_per_step: float = 0.0
    torchrec_text: str | None = None  # TorchRec's own plan text, for plans TorchRec made
    # the train pipeline's schedule both est_step_ms and lower_bound_ms assume
    schedule: str = Schedule.sparse_dist.value
    micro_batches: int = 1
    precision: str = "fp32"  # the dense part's, which est_step_ms assumes
    step_parts_ms: dict[str, float] = field(default_factory=dict)  # they add up to est_step_ms
    # 2D groups: this plan is one group's, of this many ranks, replicated over the cluster
    # (sharding.two_d); 0: the plan spans every rank
    sharding_group_size: int = 0
    # the dense reduction est_step_ms prices: "flat" (one all-reduce over every rank) or
    # "hierarchical" (within each node, then across nodes)
    dense_allreduce: str = "flat"
    # a plan for part of a cluster (sharding.subsets): the whole cluster's ranks it leaves
    # out (its own ranks are the others, in order), and every part the planner weighed
    left_out: list[int] = field(default_factory=list)
    weighed: list[dict] = field(default_factory=list)

    def shards(self) -> list[Shard]:
        return [s for t in self.tables for s in t.shards]
