"""Shared dataclasses of the sharding package: the cluster description and planner config.

These double as the Hydra structured-config schemas for `conf/cluster/` and
`conf/planner/` (registered by `recsys.config`); this package itself never imports Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass
class DeviceGroup:
    """`count` devices of one kind on a node; unset fields come from the catalog."""

    kind: str = "cpu"
    count: int = 1
    hbm_gb: float | None = None
    hbm_gbps: float | None = None
    speed: float | None = None
    # local CPU ranks only: the cores these ranks are pinned to (taskset), e.g. [0]
    cores: list[int] | None = None
    # emulated clusters only: the fraction of one core each of these ranks may use (a CFS
    # quota in the rank's own cpu cgroup), in (0, 1]; None: no quota
    share: float | None = None


@dataclass
class NodeGroup:
    """`count` identical nodes."""

    count: int = 1
    host_memory_gb: float = 16.0
    host_to_device_gbps: float = 12.0
    devices: list[DeviceGroup] = field(default_factory=lambda: [DeviceGroup()])


@dataclass
class NetworkSpec:
    """Per-device link bandwidth, Gbit/s one way (NVLink / NIC share), and one-way latency."""

    intra_node_gbps: float = 100.0
    inter_node_gbps: float = 25.0
    latency_us: float = 10.0
    # ring: the all-reduce is a ring, 2(W-1) latency hops (what gloo does, and what the
    # presets' published plans assumed); nccl: NCCL's choice, a ring or a double binary
    # tree (2 log2 W hops) whichever is faster, as it is at hundreds of GPUs
    allreduce: str = "ring"


@dataclass
class EmulationSpec:
    """Run a layout of CPU ranks on this one machine as a mixed, multi-node cluster (root):
    each node in its own network namespace, joined to the others through a bridge by a veth
    pair shaped by tbf at `network.inter_node_gbps` (both directions); each rank in its own
    cpu cgroup with a CFS quota of its device entry's `share`. See recsys/emulation.py."""

    enabled: bool = False
    # tbf burst of each node's link: small enough that chunked traffic gets no credit from
    # idle gaps. Measured at 200 Mbit/s through the switch (tests/test_emulation.py), 5 ms
    # gaps: 24kb let 16 KB chunks through at 5x the rate and 64 KB ones at 1.35x; 8kb gave
    # 0.93x-0.97x for 64 KB to 256 KB chunks (16 KB chunks, half of which fit the bucket:
    # 0.97x in one run, 1.14x in another)
    burst: str = "8kb"
    cfs_period_us: int = 100_000


@dataclass
class ClusterSpec:
    """A cluster layout: nodes, their devices, host memory and the network between them."""

    name: str = "local_cpu2"
    nodes: list[NodeGroup] = field(default_factory=lambda: [NodeGroup()])
    network: NetworkSpec = field(default_factory=NetworkSpec)
    emulation: EmulationSpec = field(default_factory=EmulationSpec)


@dataclass(frozen=True)
class RankDevice:
    """One rank of a resolved cluster: its device with every number filled in."""

    rank: int
    node: int
    local_rank: int
    kind: str
    hbm_bytes: int
    hbm_gbps: float
    speed: float
    host_bytes: int  # this rank's share of its node's host memory
    host_to_device_gbps: float = 12.0  # GB/s, PCIe or equivalent
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
    # Share of each device's memory kept free for activations, buffers and the allocator
    # (TorchRec's HeuristicalStorageReservation percentage).
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
    # torchrec: the narrowest column-wise piece it may cut (TorchRec's own default is 128,
    # which never cuts a 128-wide table)
    torchrec_min_partition: int = 32
    # torchrec: stop proposing after this many seconds and keep the best plan so far
    # (TorchRec's own timeout; None: search until its proposers are done)
    torchrec_timeout_s: float | None = None
    # torchrec: may it replicate whole tables (data_parallel)? pipeline=semi_sync turns it
    # off: TorchRec's SemiSync cannot train data-parallel tables (docs/pipelines.md)
    torchrec_data_parallel: bool = True
