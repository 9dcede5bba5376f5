"""The cost model's arithmetic on hand-computed cases, and its calibrated constants."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from benchmarks.calibrate import _fit_comm, fit_line
from recsys.app.plan import plan_table
from recsys.app.planning import make_plan, plan_inputs, plan_json
from sharding.calibration import (
    DEFAULT_PATH,
    Calibration,
    CalibrationError,
    device_costs,
    host_assembly_s,
    load_calibration,
    network_cost,
)
from sharding.cluster import resolve_cluster
from sharding.constants import GPU_DENSE_MFU
from sharding.cost_model import (
    allreduce_s,
    datasheet_device_cost,
    dot_interaction_flops,
    memory_bytes,
    step_cost,
    step_parts_s,
)
from sharding.distinct import DedupVolume, with_dedup
from sharding.plan_shards import shards_from_layout
from sharding.simulate import simulate
from sharding.types import (
    ALL_RANKS,
    ClusterSpec,
    DeviceCost,
    DeviceGroup,
    LinkCost,
    NetworkCost,
    NetworkSpec,
    NodeGroup,
    OptimizerState,
    Schedule,
    Shard,
    TableStats,
    Tier,
)

# round numbers so every expected value below is done by hand
DEV = DeviceCost(
    emb_read_bytes_per_s=1e9,
    host_read_bytes_per_s=1e8,
    emb_bwd_factor=2.0,
    dense_flops_per_s=1e9,
    step_overhead_s=0.001,
)


# the links a GPU layout here is planned on (a cluster must give its own)
GPU_NET = NetworkSpec(intra_node_gbit_s=100.0, inter_node_gbit_s=25.0)
NET = NetworkCost(alltoall=LinkCost(1e-4, 1e8), allreduce=LinkCost(1e-5, 1e9))


TABLES = [
    TableStats("a", rows=1000, dim=10),
    TableStats("b", rows=500, dim=10, lookups_per_sample=2),
]


def test_two_table_wise_tables_on_two_ranks() -> None:
    shards = [Shard("a", 0, 1000, 10), Shard("b", 1, 500, 10)]
    cost = step_cost(TABLES, shards, [100, 100], [DEV, DEV], NET, dense_params=1000)
    # a on rank 0 serves all 200 samples x 1 lookup x 10 floats x 4 B = 8000 B at 1 GB/s
    assert cost.lookup_fwd_s == pytest.approx([8e-6, 16e-6])  # b: 2 lookups per sample
    assert cost.lookup_bwd_s == pytest.approx([16e-6, 32e-6])
    # each rank sends 100 pooled vectors of 40 B to the other: 4000 B -> 1e-4 + 4e-5
    assert cost.emb_a2a_fwd_s == pytest.approx([1.4e-4, 1.4e-4])
    # ids: rank 1 sends rank 0 100 x (1 x 8 + 4) B for a; rank 0 sends 100 x (2 x 8 + 4) for b
    assert cost.ids_a2a_s == pytest.approx([1e-4 + 2000 / 1e8, 1e-4 + 2000 / 1e8])
    assert cost.dense_s == pytest.approx([6 * 1000 * 100 / 1e9] * 2)
    # ring all-reduce on 2 ranks: 2 latencies + 2(W-1)/W x 4000 B at 1 GB/s
    assert cost.allreduce_s == pytest.approx(2e-5 + 4000 / 1e9)
    plain = cost.step_s(Schedule.plain)
    # lookups forward, ids, both exchanges, dense, the overhead; the all-reduce (2.4e-5)
    # crosses under the lookups' backward (3.2e-5), queued behind the gradients
    expected = 16e-6 + 1.2e-4 + 2 * 1.4e-4 + 6e-4 + max(32e-6, 2e-5 + 4e-6) + 1e-3
    assert plain == pytest.approx(expected)
    longer = replace(cost, allreduce_s=1e-4)  # one that outlasts it shows the difference
    assert longer.step_s(Schedule.plain) == pytest.approx(expected - 32e-6 + 1e-4)
    # SparseDist hides the id exchange under the dense compute (6e-4 > 1.2e-4)
    assert cost.step_s(Schedule.sparse_dist) == pytest.approx(expected - 1.2e-4)
    # nested with 4 micro-batches: each chunk a quarter of the 4e-5 of bytes and the 1e-4
    # latency again (1.1e-4); the last gradient chunk exposed; the all-reduce under the
    # update and the next lookups (48e-6); the first forward chunk under the 1 ms of
    # overheads; the six other chunks and the ids (7.8e-4) outlast the dense work (6e-4)
    nested = cost.step_s(Schedule.nested, micro_batches=4)
    assert cost.chunk_s(1.4e-4, 4) == pytest.approx(1.1e-4)
    assert nested == pytest.approx(1.1e-4 + 48e-6 + 1e-3 + 6 * 1.1e-4 + 1.2e-4)


def test_the_networks_cpu_work_lengthens_only_the_compute_it_hides_under() -> None:
    """gloo's TCP work takes a CPU rank's core: per byte sent or received, over the rank's
    core speed. An exchange that runs alone (the plain loop) hides it in its own time; one
    hidden under the dense work lengthens that work."""
    link = LinkCost(1e-4, 1e8, cpu_s_per_byte=1e-8)
    net = NetworkCost(alltoall=link, allreduce=LinkCost(1e-5, 1e9, cpu_s_per_byte=1e-8))
    half = DeviceCost(**{**DEV.__dict__, "core_speed": 0.5})  # rank 1: half a core
    shards = [Shard("a", 0, 1000, 10), Shard("b", 1, 500, 10)]
    cost = step_cost(TABLES, shards, [100, 100], [DEV, half], net, dense_params=1000)
    free = step_cost(TABLES, shards, [100, 100], [DEV, half], NET, dense_params=1000)
    # each rank sends and receives 4000 B of vectors a way, 2000 + 1200 B of ids, and the
    # ring all-reduce 2 x 4000 B: at 1e-8 s a byte, twice as long on half a core, but never
    # longer than the exchange itself takes (1.4e-4 a way; the all-reduce 2.4e-5)
    assert cost.comm_cpu_s["emb"] == pytest.approx([8e-5, 1.4e-4])
    assert cost.comm_cpu_s["ids"] == pytest.approx([3.2e-5, 6.4e-5])
    assert cost.comm_cpu_s["allreduce"] == pytest.approx([2.4e-5, 2.4e-5])
    assert free.comm_cpu_s == {}  # links without a CPU cost (GPUs) charge none
    plain = free.step_s(Schedule.plain)
    assert cost.step_s(Schedule.plain) == pytest.approx(plain)
    # SparseDist: the next batch's ids (1.2e-4 on the wire) hide under 6e-4 of dense work,
    # which their CPU work on the slower rank lengthens; the step is at least that rank's
    # whole CPU work (2.016e-3, which binds here)
    sparse = plain - 1.2e-4 + 6.4e-5
    assert cost.critical_path_s(Schedule.sparse_dist) == pytest.approx(sparse)
    floor = cost.cpu_floor_s(Schedule.sparse_dist)
    assert floor > sparse and cost.step_s(Schedule.sparse_dist) == pytest.approx(floor)
    # nested4: also 3/4 of the embedding exchange both ways hides, with its CPU work: the
    # dense work and that CPU work (8.74e-4) now outlast the six chunks and the ids (7.8e-4)
    hidden_cpu = 6.4e-5 + 2 * 1.4e-4 * 3 / 4
    assert cost.step_s(Schedule.nested, 4) == pytest.approx(
        free.step_s(Schedule.nested, 4) - 7.8e-4 + 6e-4 + hidden_cpu
    )


def test_sequence_exchange_costs_cpu_per_cold_lookup() -> None:
    """A cold part exchanged as sequences: its owner looks up every sample's cold ids, every
    rank pools its own; the calibrated CPU time per lookup adds to the step."""
    seq_dev = DeviceCost(**{**DEV.__dict__, "sequence_s_per_lookup": 1e-6})
    shards = [
        Shard("a", 0, 900, 10, lookup_share=0.25, sparse_exchange=True),
        Shard("b", 1, 500, 10),
    ]
    cost = step_cost(TABLES, shards, [100, 100], [seq_dev, seq_dev], NET, dense_params=1000)
    # owner (rank 0): 200 samples x 1 lookup x 0.25 = 50, plus its own 25 to pool; rank 1: 25
    assert cost.split_s == pytest.approx([75e-6, 25e-6])
    free = step_cost(TABLES, shards, [100, 100], [DEV, DEV], NET, dense_params=1000)
    assert cost.step_s(Schedule.plain) == pytest.approx(free.step_s(Schedule.plain) + 75e-6)


def test_a_quota_bound_rank_is_never_quicker_than_its_whole_cpu_work() -> None:
    """On ranks at a share of a core the step is at least the busiest rank's whole CPU
    work: its stages, overheads, micro-batches and its network's CPU work. The stages'
    critical path leaves that network work inside the waits it runs in; where the rank has
    no idle time to spare, the floor binds."""
    link = LinkCost(1e-4, 1e8, cpu_s_per_byte=1e-8)
    net = NetworkCost(alltoall=link, allreduce=LinkCost(1e-5, 1e9, cpu_s_per_byte=1e-8))
    half = DeviceCost(**{**DEV.__dict__, "core_speed": 0.5, "micro_batch_overhead_s": 1e-4})
    shards = [Shard("a", 0, 1000, 10), Shard("b", 1, 500, 10)]
    whole = step_cost(TABLES, shards, [100, 100], [DEV, DEV], net, dense_params=1000)
    assert whole.work_s == [] and whole.cpu_floor_s(Schedule.plain) == 0.0
    cost = step_cost(TABLES, shards, [100, 100], [DEV, half], net, dense_params=1000)
    # lookups both ways, dense 6e-4, overhead 1e-3; rank 1 looks up twice rank 0's bytes
    assert cost.work_s == pytest.approx([8e-6 + 16e-6 + 1.6e-3, 16e-6 + 32e-6 + 1.6e-3])
    assert cost.micro_work_s == [0.0, 1e-4]
    # rank 1's network CPU work: ids 6.4e-5, the embedding exchange 1.4e-4 each way, the
    # all-reduce 2.4e-5 (test_the_networks_cpu_work_lengthens_only_the_compute_it_hides_under)
    network = 6.4e-5 + 2 * 1.4e-4 + 2.4e-5
    floor = 16e-6 + 32e-6 + 1.6e-3 + network
    assert cost.cpu_floor_s(Schedule.plain) == pytest.approx(floor)
    assert cost.cpu_floor_s(Schedule.nested, 4) == pytest.approx(floor + 3 * 1e-4)
    # here the stages' path is longer: the floor does not bind
    assert cost.step_s(Schedule.plain) == pytest.approx(cost.critical_path_s(Schedule.plain))
    # a rank with more work of its own than the path leaves room for: it binds
    bound = replace(cost, work_s=[cost.work_s[0], 3e-3])
    assert bound.step_s(Schedule.plain) == pytest.approx(3e-3 + network)
    parts = step_parts_s(bound, Schedule.plain)
    assert parts["quota-bound CPU"] == pytest.approx(
        3e-3 + network - bound.critical_path_s(Schedule.plain)
    )
    assert sum(parts.values()) == pytest.approx(bound.step_s(Schedule.plain))
    # the network's CPU work is read when priced: dedup's smaller exchange lowers the floor
    fewer = with_dedup(bound, DedupVolume(ids=[1.0, 1.0], vectors=[0.5, 0.5], source="test"))
    assert fewer.cpu_floor_s(Schedule.plain) == pytest.approx(3e-3 + network - 1.4e-4)


def test_each_rank_runs_its_own_fixed_and_per_sample_work_in_one_stretch() -> None:
    """A fast rank's larger batch overlaps a slow rank's larger fixed overhead: outside
    nested micro-batches the step waits for the slowest rank's overhead plus per-sample
    work, not for the largest overhead plus the largest per-sample work; the simulator
    runs the same per-rank stretch."""
    slow = DeviceCost(**{**DEV.__dict__, "step_overhead_s": 0.004})
    fast = DeviceCost(**{**DEV.__dict__, "sample_overhead_s": 1e-5})
    shards = [Shard("a", 0, 1000, 10), Shard("b", 1, 500, 10)]
    cost = step_cost(TABLES, shards, [300, 100], [fast, slow], NET, dense_params=1000)
    # rank 0: 1 ms + 300 x 10 us = 4 ms; rank 1: 4 ms + 100 x 0 = 4 ms
    assert cost.rank_fixed_s == pytest.approx([0.004, 0.004])
    assert (cost.overhead_s, cost.input_s) == pytest.approx((0.004, 0.003))
    for schedule in (Schedule.plain, Schedule.sparse_dist):
        assert cost.fixed_s(schedule) == pytest.approx(0.004)
        assert step_parts_s(cost, schedule)["overhead + input"] == pytest.approx(0.004)
        both = replace(cost, rank_fixed_s=[])  # each maximum on its own: 3 ms more
        assert cost.step_s(schedule) == pytest.approx(both.step_s(schedule) - 0.003)
        assert simulate(cost, schedule).step_s == pytest.approx(cost.step_s(schedule))
    # nested micro-batches: the per-sample work runs with them, each part at its slowest
    assert cost.fixed_s(Schedule.nested, 4) == pytest.approx(0.007)


def test_column_wise_row_wise_and_data_parallel_shards() -> None:
    shards = [
        Shard("a", 0, 1000, 5),
        Shard("a", 1, 1000, 5),  # column-wise halves
        Shard("b", 0, 250, 10),
        Shard("b", 1, 250, 10),
    ]  # row-wise halves
    cost = step_cost(TABLES, shards, [100, 100], [DEV, DEV], NET, dense_params=0)
    # a: 200 samples x 5 cols x 4 B; b: 200 x 2 lookups x half the rows x 10 x 4 B
    assert cost.lookup_fwd_s == pytest.approx([(4000 + 8000) / 1e9] * 2)
    dp = [Shard("b", ALL_RANKS, 500, 10, dp=True)]
    dp_cost = step_cost(TABLES, dp, [100, 100], [DEV, DEV], NET, dense_params=0)
    assert dp_cost.emb_a2a_fwd_s == [0.0, 0.0]  # replicated: nothing to exchange
    assert dp_cost.lookup_fwd_s == pytest.approx([100 * 2 * 10 * 4 / 1e9] * 2)  # local batch
    assert dp_cost.allreduce_s == pytest.approx(2e-5 + 500 * 10 * 4 / 1e9)  # its gradients


def test_cached_and_host_tiers_read_misses_at_host_bandwidth() -> None:
    cached = [Shard("a", 0, 1000, 10, Tier.cached, hit_rate=0.9)]
    cost = step_cost(TABLES[:1], cached, [100], [DEV], NET, dense_params=0)
    assert cost.lookup_fwd_s == pytest.approx([4000 * 0.9 / 1e9 + 4000 * 0.1 / 1e8])
    host = step_cost(TABLES[:1], [Shard("a", 0, 1000, 10, Tier.host)], [100], [DEV], NET, 0)
    assert host.lookup_fwd_s == pytest.approx([4000 / 1e8])
    assert host.allreduce_s == 0.0  # one rank: nothing to reduce


def test_memory_by_tier_counts_optimizer_state() -> None:
    shards = [
        Shard("a", 0, 1000, 10),
        Shard("b", 1, 500, 10, Tier.host),
        Shard("b", 0, 500, 10, Tier.cached, hit_rate=0.5),
    ]
    mem = memory_bytes(shards, world=2, opt=OptimizerState(per_row_bytes=4))
    assert mem[0]["hbm"] == 1000 * 10 * 4 + 1000 * 4 + 500 * 10 * 4 // 2
    assert mem[0]["host"] == 500 * 10 * 4 + 500 * 4
    assert mem[1] == {"hbm": 0, "host": 500 * 10 * 4 + 500 * 4}
    adam = memory_bytes(shards[:1], 2, OptimizerState(per_row_bytes=0, per_value_bytes=8))
    assert adam[0]["hbm"] == 1000 * 10 * 4 * 3


def test_dot_interaction_flops() -> None:
    assert dot_interaction_flops(27, 16) == 6 * 27 * 27 * 16
    with_inter = step_cost(TABLES[:1], [], [10], [DEV], NET, 0, interaction_flops_per_sample=1e6)
    assert with_inter.dense_s == pytest.approx([10 * 1e6 / 1e9])
    slow_inter = DeviceCost(**{**DEV.__dict__, "interaction_flops_per_s": 2.5e8})
    both = step_cost(TABLES[:1], [], [10], [slow_inter], NET, 100, interaction_flops_per_sample=1e6)
    assert both.dense_s == pytest.approx([10 * (600 / 1e9 + 1e6 / 2.5e8)])


def test_plan_layout_becomes_shards() -> None:
    layout = [
        {
            "table": "a",
            "sharding_type": "column_wise",
            "compute_kernel": "fused",
            "shards": [{"rank": 0, "rows": 1000, "cols": 5}, {"rank": 1, "rows": 1000, "cols": 5}],
        },
        {"table": "b", "sharding_type": "data_parallel", "compute_kernel": "dense", "shards": []},
    ]
    shards = shards_from_layout(layout, TABLES, world=2)
    assert [(s.table, s.rank, s.cols, s.dp) for s in shards] == [
        ("a", 0, 5, False),
        ("a", 1, 5, False),
        ("b", ALL_RANKS, 10, True),
    ]


def test_fits_recover_known_lines() -> None:
    xs = [1e3, 1e4, 1e5, 1e6]
    assert fit_line(xs, [2e-4 + x / 5e8 for x in xs]) == pytest.approx((2e-4, 1 / 5e8))
    sizes = [16_384, 1_048_576, 8_388_608]
    raw = {
        "sizes_bytes": sizes,
        "alltoall_s": [1e-4 + s / 2 / 1e9 for s in sizes],
        "allreduce_s": [2 * 5e-5 + s / 2e9 for s in sizes],
        # CPU: a fixed part, then 3e-10 s per byte sent (s/2) or received (s/2)
        "alltoall_cpu_s": [2e-5 + s * 3e-10 for s in sizes],
    }
    fit = _fit_comm(raw)
    assert fit["alltoall"]["cpu_s_per_byte"] == pytest.approx(3e-10)
    assert fit["allreduce"]["cpu_s_per_byte"] == pytest.approx(3e-10)
    assert fit["alltoall"]["latency_s"] == pytest.approx(1e-4)
    assert fit["alltoall"]["bytes_per_s"] == pytest.approx(1e9)
    assert fit["allreduce"]["latency_s"] == pytest.approx(5e-5)
    assert fit["allreduce"]["bytes_per_s"] == pytest.approx(2e9)
    # four ranks, two a node: each sends half its bytes across, the link's bandwidth per
    # rank as the cost model prices a rank's share of its node's link; the CPU per byte on
    # everything it sends and receives
    raw4 = {
        **raw,
        "alltoall_s": [1e-4 + s / 2 / 1e9 for s in sizes],
        "alltoall_cpu_s": [2e-5 + s * 3e-10 * 3 / 4 for s in sizes],
    }
    fit4 = _fit_comm(raw4, 4, [0, 0, 1, 1])
    assert fit4["alltoall"]["bytes_per_s"] == pytest.approx(1e9)
    assert fit4["alltoall"]["cpu_s_per_byte"] == pytest.approx(3e-10 / 2)
    assert _fit_comm(raw4, 4)["alltoall"]["bytes_per_s"] == pytest.approx(1.5e9)


def test_a_one_rank_layout_calibrates_its_link_as_its_fixed_time() -> None:
    """One rank (a one-node, one-device layout): nothing crosses, so there is no bandwidth
    to fit (the fit died in numpy's SVD); the collectives cost their measured fixed time."""
    import json

    sizes = [16_384, 1_048_576, 8_388_608]
    raw = {
        "sizes_bytes": sizes,
        "alltoall_s": [3e-4, 2e-4, 2.5e-4],
        "allreduce_s": [1e-4, 1.5e-4, 1.2e-4],
        "alltoall_cpu_s": [1e-5] * 3,
    }
    fit = _fit_comm(raw, 1, [0])
    assert fit["alltoall"]["latency_s"] == pytest.approx(2.5e-4)
    assert fit["allreduce"]["latency_s"] == pytest.approx(1.2e-4)
    assert fit["alltoall"]["cpu_s_per_byte"] == 0.0
    json.dumps(fit, allow_nan=False)  # a calibration file holds it as it is


def test_calibration_file_loads_and_scales_by_rank_speed() -> None:
    cal = load_calibration()
    assert cal.device.emb_read_bytes_per_s > 0 and cal.device.dense_flops_per_s > 0
    assert "loopback" in cal.links
    pinned = [DeviceGroup("cpu", 1, speed=0.005, cores=[0]), DeviceGroup("cpu", 1, cores=[1])]
    skewed = ClusterSpec(network=GPU_NET, nodes=[NodeGroup(devices=pinned)])
    slow, fast = device_costs(resolve_cluster(skewed), cal)
    assert slow.dense_flops_per_s == pytest.approx(fast.dense_flops_per_s / 2)
    assert slow.step_overhead_s == pytest.approx(2 * fast.step_overhead_s)
    # every CPU time the calibration measured moves with the speed, none is dropped
    assert fast.micro_batch_overhead_s == cal.device.micro_batch_overhead_s > 0
    assert slow.micro_batch_overhead_s == pytest.approx(2 * fast.micro_batch_overhead_s)
    assert slow.emb_bwd_factor == fast.emb_bwd_factor == cal.device.emb_bwd_factor
    assert network_cost(skewed, resolve_cluster(skewed), cal, None) is cal.links["loopback"]
    with pytest.raises(CalibrationError, match="calibrated"):
        network_cost(skewed, resolve_cluster(skewed), cal, "carrier_pigeon")
    raw = json.loads(Path(DEFAULT_PATH).read_text())
    import torchrec  # made by benchmarks.calibrate, on the stack installed (benchmarks.remeasure)

    assert raw["measured"]["environment"]["torchrec"] == torchrec.__version__


def test_gpu_devices_use_datasheet_numbers(typed_cfg) -> None:
    cfg = typed_cfg(["cluster=hetero_3node"])
    ranks = resolve_cluster(cfg.cluster)
    costs = device_costs(ranks, None)  # GPU clusters need no calibration
    h100, t4 = costs[0], costs[-1]
    assert h100.emb_read_bytes_per_s == pytest.approx(3350e9 * 0.5)
    # fp32 by default (trainer.precision): the datasheets' fp32 rates at the assumed MFU
    assert h100.dense_flops_per_s == pytest.approx(67e12 * GPU_DENSE_MFU)
    assert t4.dense_flops_per_s == pytest.approx(8.1e12 * GPU_DENSE_MFU)
    # the host's batch assembly: this machine's measured figure (sharding/calibration)
    assert h100.host_s_per_sample == t4.host_s_per_sample == host_assembly_s() > 0
    assert replace(datasheet_device_cost(ranks[0]), host_s_per_sample=host_assembly_s()) == h100
    net = network_cost(cfg.cluster, ranks, None, None)
    assert net.alltoall.bytes_per_s == pytest.approx(25e9 / 8)  # 3 nodes: inter-node link
    # the ring all-reduce uses all 8 NICs of a node, capped by the 300 Gbit/s NVLink share
    assert net.allreduce.bytes_per_s == pytest.approx(200e9 / 8)
    one_node = network_cost(cfg.cluster, [r for r in ranks if r.node == 0], None, None)
    assert one_node.allreduce.bytes_per_s == pytest.approx(300e9 / 8)


def test_nccl_all_reduce_takes_a_tree_where_the_ring_is_latency_bound(typed_cfg) -> None:
    from dataclasses import replace

    from sharding.cluster import ClusterConfigError

    cfg = typed_cfg(["cluster=2x8_h100"])
    ring_net = network_cost(cfg.cluster, resolve_cluster(cfg.cluster), None, None)
    assert not ring_net.tree_allreduce  # the presets' default: a ring
    nccl = replace(cfg.cluster, network=replace(cfg.cluster.network, allreduce="nccl"))
    tree_net = network_cost(nccl, resolve_cluster(nccl), None, None)
    assert tree_net.tree_allreduce and tree_net.allreduce == ring_net.allreduce
    world, grad_bytes = 1536, 4e6
    shards = [Shard("t", 0, 10, 4)]
    tables = [TableStats("t", 10, 4, 1.0)]
    devices = device_costs(resolve_cluster(cfg.cluster), None)[:1] * world

    def allreduce(net: NetworkCost) -> float:
        return step_cost(tables, shards, [1] * world, devices, net, int(grad_bytes / 4)).allreduce_s

    link = ring_net.allreduce
    hops, share = 2 * (world - 1), 2 * (world - 1) / world
    ring = hops * link.latency_s + share * grad_bytes / link.bytes_per_s
    tree = 2 * 11 * link.latency_s + 2 * grad_bytes / link.bytes_per_s  # log2(1536) -> 11
    assert allreduce(ring_net) == pytest.approx(ring)
    assert allreduce(tree_net) == pytest.approx(min(ring, tree)) and tree < ring
    bad = replace(cfg.cluster, network=replace(cfg.cluster.network, allreduce="butterfly"))
    with pytest.raises(ClusterConfigError, match="network.allreduce must be ring or nccl"):
        resolve_cluster(bad)


def test_the_hierarchical_reduction_crosses_nodes_once_per_node(typed_cfg) -> None:
    """`trainer.dense_allreduce=hierarchical` on 2 nodes of 8 over a slow link: within each
    node a reduce and a broadcast (3 hops each over NVLink, the bytes once each), across
    nodes a 2-rank ring over one rank's share of the inter-node link; the planner's inputs
    say so. Fewer hops than the flat ring through 16 ranks, but one NIC share where NCCL's
    rings use all of a node's: cheaper for small gradients only."""
    from dataclasses import replace

    from recsys.app.planning import plan_inputs
    from sharding.bound import lower_bound_ms

    cfg = typed_cfg(["cluster=2x8_h100", "cluster.network.inter_node_gbit_s=10"])
    flat = plan_inputs(cfg, None, None)
    hier = plan_inputs(
        typed_cfg(
            [
                "cluster=2x8_h100",
                "cluster.network.inter_node_gbit_s=10",
                "trainer.dense_allreduce=hierarchical",
            ]
        ),
        None,
        None,
    )
    assert hier.network.hierarchical_allreduce and not flat.network.hierarchical_allreduce
    assert replace(hier.network, hierarchical_allreduce=False) == flat.network
    net, intra, inter = hier.network, hier.network.intra_alltoall, hier.network.alltoall
    for grad_bytes, cheaper in ((64e3, True), (64e6, False)):
        within = 2 * (3 * intra.latency_s + grad_bytes / intra.bytes_per_s)
        across = 2 * inter.latency_s + grad_bytes / inter.bytes_per_s  # a ring of two
        by_node = allreduce_s(grad_bytes, 16, net, [8, 8])
        assert by_node == pytest.approx(within + across)
        assert (by_node < allreduce_s(grad_bytes, 16, flat.network)) == cheaper, grad_bytes
        assert allreduce_s(grad_bytes, 16, net, [16]) == allreduce_s(grad_bytes, 16, flat.network)
    # the bound prices the same reduction
    dense = hier.dense_params * 4
    difference = allreduce_s(dense, 16, net, [8, 8]) - allreduce_s(dense, 16, flat.network)
    assert lower_bound_ms(hier) - lower_bound_ms(flat) == pytest.approx(1000 * difference)


def test_predict_matches_the_cost_model_for_a_local_run(typed_cfg) -> None:
    from recsys.app.predict import predict

    cfg = typed_cfg(["trainer.batch_size=1024"])
    plain = predict(cfg)
    cfg.pipeline.name = type(cfg.pipeline.name)("sparse_dist")
    sparse = predict(cfg, plain["layout"])
    assert sparse["step_ms"] <= plain["step_ms"]
    assert plain["link"] == "loopback" and plain["step_ms"] > 0


def test_predict_prices_a_gpu_plan_as_the_planner_does(typed_cfg) -> None:
    """`recsys.predict` and `sharding.plan`'s evaluation give the same step (feeding the
    batch included) and the same memory per rank for one plan."""
    from recsys.app.planning import make_plan, plan_inputs
    from recsys.app.predict import predict
    from sharding.emit import to_torchrec_plan
    from sharding.plan_shards import plan_layout

    cfg = typed_cfg(
        [
            "cluster=2x8_h100",
            "model=dcnv2_small",
            "planner=greedy_size",
            "trainer.batch_size=4096",
            "pipeline=sparse_dist",
        ]
    )
    plan = make_plan(cfg, plan_inputs(cfg, None, None))
    features = {t.name: t.name[len("t_") :] for t in plan.tables}
    result = predict(cfg, plan_layout(to_torchrec_plan(plan, features, "cuda")))
    assert result["step_ms"] == pytest.approx(plan.est_step_ms)
    assert result["stages_ms"]["feeding_the_batch"] > 0  # 4,096 samples: the host's floor
    assert [m["hbm"] for m in result["memory_bytes"]] == pytest.approx(
        [d["hbm_used_bytes"] for d in plan.devices]
    )


# 4 ranks on 2 nodes; within a node 1 GB/s, across nodes 100 MB/s with a longer latency
NODES = [0, 0, 1, 1]


TWO_LINKS = NetworkCost(
    alltoall=LinkCost(1e-4, 1e8), allreduce=LinkCost(1e-5, 1e9), intra=LinkCost(1e-5, 1e9)
)


def test_exchange_within_a_node_uses_the_intra_node_link() -> None:
    shards = [Shard("a", 0, 1000, 10)]  # table-wise on rank 0: 40 B a sample to the others
    cost = step_cost(TABLES[:1], shards, [100] * 4, [DEV] * 4, TWO_LINKS, 0, nodes=NODES)
    # rank 0 sends 100 x 40 B to its node mate (intra) and 200 x 40 B across (inter); the
    # links run at once, so the slower one sets its time, after the inter-node latency
    assert cost.emb_a2a_fwd_s[0] == pytest.approx(1e-4 + 8000 / 1e8)
    assert cost.emb_a2a_fwd_s[1] == pytest.approx(1e-5 + 4000 / 1e9)  # receives within
    assert cost.emb_a2a_fwd_s[2] == pytest.approx(1e-4 + 4000 / 1e8)  # receives across


def test_table_row_wise_reduces_within_its_node_before_crossing() -> None:
    rows = [Shard("b", 0, 250, 10, node_reduce=True), Shard("b", 1, 250, 10, node_reduce=True)]
    twrw = step_cost(TABLES[1:], rows, [100] * 4, [DEV] * 4, TWO_LINKS, 0, nodes=NODES)
    plain = [Shard("b", 0, 250, 10), Shard("b", 1, 250, 10)]  # row-wise: no node reduce
    rw = step_cost(TABLES[1:], plain, [100] * 4, [DEV] * 4, TWO_LINKS, 0, nodes=NODES)
    # TWRW member: reduce-scatter of 400 samples' partial sums with its mate (half of them,
    # 8000 B, within the node), then half of node 1's 200 samples across: 4000 B
    assert twrw.emb_a2a_fwd_s[0] == pytest.approx(1e-4 + 4000 / 1e8)
    assert twrw.emb_a2a_fwd_s[2] == pytest.approx(1e-4 + 100 * 40 / 1e8)  # one vector each
    # row-wise: each shard sends its partial sum for every sample of node 1: 8000 B across
    assert rw.emb_a2a_fwd_s[0] == pytest.approx(1e-4 + 8000 / 1e8)
    assert rw.emb_a2a_fwd_s[2] == pytest.approx(1e-4 + 2 * 100 * 40 / 1e8)
    assert twrw.lookup_fwd_s == pytest.approx(rw.lookup_fwd_s)  # the same rows looked up


def test_split_tables_cost_every_rank_per_table_and_per_lookup_of_its_own_samples() -> None:
    """A table with a hot part replicated (rows below the table's) is split: every rank
    remaps its own samples' ids, whichever exchange its cold part uses; a table replicated
    whole is not split and costs nothing of the kind."""
    dev = DeviceCost(**{**DEV.__dict__, "split_s_per_table": 1e-4, "split_s_per_lookup": 1e-6})
    shards = [
        Shard("a", ALL_RANKS, 64, 10, dp=True, lookup_share=0.6),
        Shard("a", 0, 936, 10, lookup_share=0.4),
        Shard("b", ALL_RANKS, 500, 10, dp=True),
    ]
    cost = step_cost(TABLES, shards, [100, 300], [dev, dev], NET, dense_params=1000)
    # one split table, one lookup a sample: 1e-4 + 100 x 1e-6 on rank 0, + 300 x 1e-6 on 1
    assert cost.split_s == pytest.approx([2e-4, 4e-4])
    free = step_cost(TABLES, shards, [100, 300], [DEV, DEV], NET, dense_params=1000)
    assert free.split_s == [0.0, 0.0]
    assert cost.step_s(Schedule.plain) == pytest.approx(free.step_s(Schedule.plain) + 4e-4)


def test_the_split_fit_keeps_no_intercept_a_negative_slope_bent() -> None:
    """`fit_nonneg`: exact on data it can fit; a slope that fits negative is dropped and
    the rest fitted again (least squares' intercept, clipped slope kept at 0, had priced
    15 ms a step of sequence work that the runs did not show)."""
    from benchmarks.calibrate import fit_nonneg

    tables, lookups = [20.0, 20.0, 12.0], [7000.0, 19000.0, 19000.0]
    y = [2e-4 * t + 5e-7 * n for t, n in zip(tables, lookups, strict=True)]
    assert fit_nonneg([tables, lookups], y) == pytest.approx([2e-4, 5e-7])
    # session 20's sequence runs: +0.98 ms at 7146 lookups, -22.2 ms at 18659
    assert fit_nonneg([[1.0, 1.0], [7146.0, 18659.0]], [0.98e-3, -22.2e-3]) == [0.0, 0.0]
    # falling points above 0: their mean, no slope
    assert fit_nonneg([[1.0, 1.0], [1.0, 3.0]], [4.0, 2.0]) == pytest.approx([3.0, 0.0])


def test_gpu_sequence_exchange_costs_device_memory_passes_per_cold_lookup() -> None:
    from sharding.constants import GPU_EMB_EFFICIENCY, GPU_SEQUENCE_PASSES

    h100 = resolve_cluster(
        ClusterSpec(network=GPU_NET, nodes=[NodeGroup(devices=[DeviceGroup("h100_80g")])])
    )
    cost = datasheet_device_cost(h100[0])
    per_byte = GPU_SEQUENCE_PASSES / (3350e9 * GPU_EMB_EFFICIENCY)
    assert cost.sequence_s_per_byte == pytest.approx(per_byte) and cost.sequence_s_fixed > 0
    shards = [Shard("a", 0, 900, 10, lookup_share=0.5, sparse_exchange=True)]
    seq = step_cost(TABLES[:1], shards, [100, 100], [cost, cost], NET, 0)
    # rank 0 looks up 200 x 0.5 cold ids and pools its own 50; 40 B vectors each
    expect = 150 * (cost.sequence_s_per_lookup + 40 * per_byte) + cost.sequence_s_fixed
    assert seq.split_s[0] == pytest.approx(expect)


def test_the_sequence_calibration_forces_its_split_whatever_loopback_prefers(typed_cfg) -> None:
    """`benchmarks.calibrate` measures the sequence exchange on split tables; told the saved
    constants, the planner keeps tables whole over loopback, so the calibration plans its
    runs across the slowest measured link with free sequence costs (each batch it uses)."""
    from benchmarks.calibrate import CalibrateConfig
    from recsys.app.planning import has_split_tables, plan_with_splits
    from sharding.calibration import load_calibration

    cal = load_calibration()
    link = min(cal.links, key=lambda k: cal.links[k].alltoall.bytes_per_s)
    for batch in CalibrateConfig().split_batches:
        cfg = typed_cfg(["planner=hybrid", f"trainer.batch_size={batch}"])
        assert has_split_tables(plan_with_splits(cfg, cal, link)), batch


def test_the_split_calibration_prices_its_pooled_run_pooled(typed_cfg) -> None:
    """`measure_split` trains one plan with its cold parts as sequences and then pooled;
    the pooled run is priced as it trains (`pooled_exchange`: every cold part's exchange
    pooled, a vector a sample), not as the sequence plan, and the plan itself is kept."""
    from benchmarks.calibrate import pooled_exchange
    from recsys.app.planning import plan_inputs, plan_with_splits
    from sharding.calibration import load_calibration
    from sharding.plan_eval import evaluate

    cal = load_calibration()
    link = min(cal.links, key=lambda k: cal.links[k].alltoall.bytes_per_s)
    cfg = typed_cfg(["planner=hybrid", "trainer.batch_size=2048"])
    plan = plan_with_splits(cfg, cal, link)
    pooled = pooled_exchange(plan)
    assert any(s.sparse_exchange for t in plan.tables for s in t.shards)
    assert not any(s.sparse_exchange for t in pooled.tables for s in t.shards)
    inputs = plan_inputs(cfg, None, "loopback", cal)
    sequence_bytes = evaluate(copy.deepcopy(plan), inputs).a2a_bytes_per_step
    assert evaluate(pooled, inputs).a2a_bytes_per_step > 1.5 * sequence_bytes


def test_each_exchange_is_split_by_link_for_the_simulator() -> None:
    """Two ranks on one node exchange over the fabric; on two nodes over their NIC shares,
    each part with its link's latency; the exchange's time is the slower part's."""
    shards = [Shard("a", 0, 1000, 10), Shard("b", 1, 500, 10)]
    net = NetworkCost(
        alltoall=LinkCost(1e-4, 1e8), allreduce=LinkCost(1e-5, 1e9), intra=LinkCost(1e-5, 1e9)
    )
    one = step_cost(TABLES, shards, [100, 100], [DEV, DEV], net, 1000, nodes=[0, 0])
    two = step_cost(TABLES, shards, [100, 100], [DEV, DEV], net, 1000, nodes=[0, 1])
    assert one.emb_a2a_parts_s["nic"] == [0.0, 0.0]
    assert one.emb_a2a_parts_s["fabric"] == pytest.approx([1e-5 + 4000 / 1e9] * 2)
    assert two.emb_a2a_parts_s["fabric"] == [0.0, 0.0]
    assert two.emb_a2a_parts_s["nic"] == pytest.approx([1e-4 + 4000 / 1e8] * 2)
    for cost in (one, two):
        for whole, parts in (
            (cost.emb_a2a_fwd_s, cost.emb_a2a_parts_s),
            (cost.ids_a2a_s, cost.ids_a2a_parts_s),
        ):
            assert whole == pytest.approx(np.maximum(parts["nic"], parts["fabric"]))
    assert (one.allreduce_link, two.allreduce_link) == ("fabric", "nic")


@pytest.mark.parametrize(
    "precision, h100_tflops, v100_tflops",
    [("fp32", 67.0, 15.7), ("tf32", 494.5, 15.7), ("bf16", 989.0, 15.7)],
)
def test_the_dense_part_is_priced_at_the_runs_precision(
    typed_cfg, precision, h100_tflops, v100_tflops
) -> None:
    """`trainer.precision` reaches the planner's device constants: an H100's dense rate at
    each datasheet figure; a V100, without TF32 or bf16 tensor cores, at its fp32 rate."""
    cfg = typed_cfg(["cluster=hetero_3node", f"trainer.precision={precision}"])
    inputs = plan_inputs(cfg, None, None)
    kinds = [r.kind for r in inputs.ranks]
    h100, v100 = (inputs.devices[kinds.index(k)] for k in ("h100_80g", "v100_16g"))
    assert h100.dense_flops_per_s == pytest.approx(h100_tflops * 1e12 * GPU_DENSE_MFU)
    assert v100.dense_flops_per_s == pytest.approx(v100_tflops * 1e12 * GPU_DENSE_MFU)
    assert inputs.precision == precision
    # the rest of the device is the same whatever the precision
    fp32 = replace(
        datasheet_device_cost(inputs.ranks[0], "fp32"), host_s_per_sample=host_assembly_s()
    )
    assert replace(h100, dense_flops_per_s=fp32.dense_flops_per_s) == fp32


def test_a_plan_says_the_precision_it_priced(typed_cfg) -> None:
    plans = {}
    for precision in ("fp32", "bf16"):
        cfg = typed_cfg(
            [
                "cluster=2x8_h100",
                "model=dcnv2_mlperf",
                "planner=greedy_size",
                f"trainer.precision={precision}",
            ]
        )
        plans[precision] = make_plan(cfg, plan_inputs(cfg, None, None))
    assert plans["fp32"].precision == "fp32" and plans["bf16"].precision == "bf16"
    assert plans["bf16"].est_step_ms < plans["fp32"].est_step_ms  # same placement, faster dense
    assert "(dense in bf16)" in plan_table(plans["bf16"]).splitlines()[0]
    assert plan_json(plans["bf16"])["precision"] == "bf16"


def test_an_unknown_precision_is_refused() -> None:
    from sharding.constants import precision_factor

    with pytest.raises(ValueError, match="fp64"):
        precision_factor("h100_80g", "fp64")


def test_fp16_tables_halve_their_memory_and_reads_not_the_exchange(typed_cfg) -> None:
    """`model.table_dtype=fp16`: a row's weights take 2 bytes a value (its row-wise Adagrad
    state stays one fp32 per row), a lookup reads half the bytes, and the exchanged vectors
    stay fp32 (lookups return fp32)."""
    inputs = {}
    for dtype in ("fp32", "fp16"):
        cfg = typed_cfg(["cluster=2x8_h100", "model=dcnv2_mlperf", f"model.table_dtype={dtype}"])
        inputs[dtype] = plan_inputs(cfg, None, None)
    wide, half = inputs["fp32"], inputs["fp16"]
    assert {t.weight_bytes for t in half.tables} == {2} and half.weight_bytes == 2
    assert wide.row_bytes(128) == 128 * 4 + 4 and half.row_bytes(128) == 128 * 2 + 4
    t = half.tables[0]
    shards = [Shard(t.name, 0, t.rows, t.dim)]
    assert memory_bytes(shards, 2, weight_bytes=2)[0]["hbm"] == t.rows * (t.dim * 2 + 4)
    costs = {}
    for name, i in inputs.items():
        table = i.tables[0]
        costs[name] = step_cost(
            [table],
            [Shard(table.name, 0, table.rows, table.dim)],
            [100, 100],
            i.devices[:2],
            i.network,
            0,
        )
    assert costs["fp16"].lookup_fwd_s[0] == pytest.approx(costs["fp32"].lookup_fwd_s[0] / 2)
    assert costs["fp16"].a2a_bytes == costs["fp32"].a2a_bytes  # fp32 vectors either way
    # a plan of the fp16 tables needs less memory on every rank
    plans = {
        n: make_plan(
            typed_cfg(
                [
                    "cluster=2x8_h100",
                    "model=dcnv2_mlperf",
                    f"model.table_dtype={n}",
                    "planner=greedy_size",
                ]
            ),
            i,
        )
        for n, i in inputs.items()
    }
    used = {
        n: sum(d["hbm_used_bytes"] + d["host_used_bytes"] for d in p.devices)
        for n, p in plans.items()
    }
    assert used["fp16"] < 0.6 * used["fp32"]


def test_auto_keeps_the_dense_reduction_the_cost_model_prices_faster(typed_cfg) -> None:
    """`trainer.dense_allreduce=auto`: our planner plans under the flat and the
    hierarchical reduction and keeps the faster plan, which says which (plan.json); one node
    plans flat only; with TorchRec's planner (its plan made in the ranks) the faster
    reduction of the dense parameters is taken (`hierarchical_pays`: small gradients pay
    for fewer hops across a slow link, large ones for one NIC share)."""
    from dataclasses import replace

    from recsys.app.planning import make_plan, plan_inputs
    from recsys.app.train import _resolve_auto_reduction
    from sharding.cost_model import hierarchical_pays

    two_nodes = ["cluster=2x8_h100", "cluster.network.inter_node_gbit_s=10", "planner=hybrid"]
    cfg = typed_cfg([*two_nodes, "trainer.dense_allreduce=auto"])
    inputs = plan_inputs(cfg, None, None)
    plans = {
        mode: make_plan(
            c := typed_cfg([*two_nodes, f"trainer.dense_allreduce={mode}"]),
            plan_inputs(c, None, None),
        )
        for mode in ("buckets", "hierarchical")
    }
    auto = make_plan(cfg, inputs)
    faster = min(plans, key=lambda m: plans[m].est_step_ms)
    assert auto.est_step_ms == pytest.approx(plans[faster].est_step_ms)
    assert auto.dense_allreduce == ("hierarchical" if faster == "hierarchical" else "flat")
    assert _resolve_auto_reduction(cfg, inputs, auto).trainer.dense_allreduce.value == faster
    one_node = typed_cfg(["cluster=1x8_h100", "planner=hybrid", "trainer.dense_allreduce=auto"])
    assert make_plan(one_node, plan_inputs(one_node, None, None)).dense_allreduce == "flat"
    net = inputs.network
    assert hierarchical_pays(64e3, [8, 8], net) and not hierarchical_pays(64e6, [8, 8], net)
    assert not hierarchical_pays(64e3, [16], net)
    for dense, mode in ((16_000, "hierarchical"), (16_000_000, "buckets")):
        small = replace(inputs, dense_params=dense)
        assert _resolve_auto_reduction(cfg, small, None).trainer.dense_allreduce.value == mode


def test_a_refreshed_calibration_moves_every_cpu_constant_with_the_cores_speed() -> None:
    """`recalibrate=true` (benchmarks.plan_train, benchmarks.pipeline): a compute probe that
    finds the core twice as fast doubles the saved rates, halves the input and overhead
    times, on one core and on every emulated share alike; links and the backward factor stay
    as saved; the ratios are recorded."""
    from dataclasses import asdict

    from benchmarks.calibrate import refreshed
    from sharding.calibration import load_calibration

    cal = load_calibration()
    d = cal.device
    probe = {
        "embedding": {"emb_read_bytes_per_s": 2 * d.emb_read_bytes_per_s, "emb_bwd_factor": 9.0},
        "dense": {
            "dense_flops_per_s": 2 * d.dense_flops_per_s,
            "interaction_flops_per_s": 2 * d.interaction_flops_per_s,
        },
        "input": {"input_s_per_sample": d.input_s_per_sample / 2},
    }
    new = refreshed(cal, probe)
    assert cal.shares, "the saved calibration has emulated shares"
    for old, now in [(d, new.device)] + [(cal.shares[k], new.shares[k]) for k in cal.shares]:
        for rate in ("emb_read_bytes_per_s", "dense_flops_per_s", "interaction_flops_per_s"):
            assert getattr(now, rate) == pytest.approx(2 * getattr(old, rate))
        for time_ in (
            "input_s_per_sample",
            "step_overhead_s",
            "sample_overhead_s",
            "sequence_s_per_lookup",
            "micro_batch_overhead_s",
        ):
            assert getattr(now, time_) == pytest.approx(getattr(old, time_) / 2)
        assert now.emb_bwd_factor == old.emb_bwd_factor
    assert asdict(new)["links"] == asdict(cal)["links"]
    assert new.measured["refreshed"]["vs_saved"]["dense_flops_per_s"] == pytest.approx(2.0)
    assert load_calibration().device == d  # the saved calibration is not touched


def test_the_embedding_backward_is_fitted_per_byte_on_its_own() -> None:
    """`fit_embedding`: the forward and the backward each a line over the probe's shapes. A
    forward with a fixed part (a kernel call's) does not drag the backward's price down, as
    a median of per-shape backward / forward ratios would."""
    from benchmarks.calibrate import fit_embedding

    points = [
        {"bytes": n, "fwd_s": 1e-4 + n / 20e9, "fwd_bwd_s": 1e-4 + n / 20e9 + n * 1e-9}
        for n in (5e5, 2e6, 4e6, 3e7)
    ]
    fit = fit_embedding(points)
    assert fit["emb_read_bytes_per_s"] == pytest.approx(20e9)
    assert fit["emb_bwd_factor"] == pytest.approx(20.0)  # 1 ns / 0.05 ns per byte
    ratios = sorted((p["fwd_bwd_s"] - p["fwd_s"]) / p["fwd_s"] for p in points)
    assert ratios[1] < 15  # what the median of ratios would have priced it at


def test_a_short_calibration_run_is_trained_again_long_enough(monkeypatch, tmp_path) -> None:
    """`_train`: a run whose timed steps last less than `timed_s` is trained again with
    enough steps; a long one is not."""
    from benchmarks import calibrate

    runs = []

    def train_steps(overrides, steps, run_dir, link, step_ms):
        run_dir.mkdir()  # as training does; a run directory is never reused
        runs.append((run_dir.name, steps))
        return {"batch_per_rank": [1000, 1000], "samples_per_s": 2000 / step_ms * 1000}

    cfg = replace(calibrate.CalibrateConfig(), train_steps=80, timed_s=6.0)
    for name, step_ms in (("fast", 20.0), ("slow", 200.0)):
        monkeypatch.setattr(calibrate, "_train_steps", lambda *a, ms=step_ms: train_steps(*a, ms))
        summary = calibrate._train([], cfg, tmp_path / name, None)
        assert calibrate.measured_ms(summary) == pytest.approx(step_ms)
    assert runs == [("fast_short", 80), ("fast", calibrate.WARMUP_STEPS + 300), ("slow_short", 80)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast", "fast_short", "slow"]


def test_validation_also_prices_each_setting_at_the_cores_speed_measured_beside_it(
    monkeypatch, tmp_path
) -> None:
    """`validate`: before each setting the meter (the calibration run at `meter_batch`) is
    trained again; where it now runs at 24 ms against the calibration's 30, the cores are
    1.25x as fast, and the setting is also predicted with every CPU rate 1.25x and every CPU
    time / 1.25, one core and shares alike, links as measured. Each setting is trained
    `validation_repeats` times, every setting once before any twice, and the median of its
    runs is what the prediction is held to, each run kept."""
    from benchmarks import calibrate
    from sharding.calibration import load_calibration

    cal = load_calibration()
    cal.measured = {**cal.measured, "overhead_runs": [{"batch": 1536, "measured_ms": 30.0}]}
    cfg = replace(
        calibrate.CalibrateConfig(),
        meter_batch=1536,
        validation_repeats=1,
        settings=[calibrate.Setting("a", ["trainer.batch_size=1024"])],
    )
    trained, priced = [], []

    def train(overrides, cfg, run_dir, link, step_ms=None):
        trained.append((run_dir.relative_to(tmp_path).as_posix(), step_ms))
        if "validation" in run_dir.parts:  # planned with this run's constants, not the saved
            assert overrides[-1] == f"planner.calibration={run_dir.parents[1]}/local_cpu.json"
        ms = 24.0 if "meter" in run_dir.parts else 50.0 + 20.0 * run_dir.name.endswith("run2")
        return {"batch_per_rank": [1000, 1000], "samples_per_s": 2000 / ms * 1000}

    def predict(overrides, run_dir, link, c):
        priced.append(c)
        return 40.0 * cal.device.dense_flops_per_s / c.device.dense_flops_per_s

    monkeypatch.setattr(calibrate, "_train", train)
    monkeypatch.setattr(calibrate, "predict_ms", predict)
    (v,) = calibrate.validate(cfg, cal, tmp_path, None, None)
    assert trained == [("meter/a", 30.0), ("validation/a", None)]
    assert v["cores_speed"] == pytest.approx(1.25)
    assert v["rel_error"] == pytest.approx(40 / 50 - 1)
    assert v["predicted_beside_ms"] == pytest.approx(32.0)
    fast = priced[1]
    assert fast.links is cal.links
    for old, new in [(cal.device, fast.device)] + [
        (cal.shares[k], fast.shares[k]) for k in cal.shares
    ]:
        assert new.emb_read_bytes_per_s == pytest.approx(1.25 * old.emb_read_bytes_per_s)
        assert new.step_overhead_s == pytest.approx(old.step_overhead_s / 1.25)
        assert new.micro_batch_overhead_s == pytest.approx(old.micro_batch_overhead_s / 1.25)
    # no meter: the calibration's constants alone; two runs of two settings, interleaved
    two = [calibrate.Setting(n, ["trainer.batch_size=1024"]) for n in ("a", "b")]
    cfg = replace(cfg, meter_batch=0, validation_repeats=2, settings=two)
    trained.clear()
    a, b = calibrate.validate(cfg, cal, tmp_path / "off", None, None)
    assert [t for t, _ in trained] == [
        f"off/validation/{n}_run{r}" for r in (1, 2) for n in ("a", "b")
    ]
    assert [ms for _, ms in trained] == [None, None, 50.0, 50.0]  # repeats as long, at once
    assert "cores_speed" not in a and a["measured_runs_ms"] == pytest.approx([50.0, 70.0])
    assert a["measured_ms"] == pytest.approx(60.0) and b["rel_error"] == pytest.approx(40 / 60 - 1)


def test_the_robust_line_holds_one_odd_point() -> None:
    """`fit_line_robust` (Theil-Sen): on a line it is least squares' line; with one of four
    points 8 ms low (a busy host's odd run), it keeps the line, where least squares through
    the three smaller batches (the calibration's runs until 2026-12-07) finds a third of the
    slope (that calibration found none)."""
    from benchmarks.calibrate import fit_line_robust

    xs = [512, 1536, 3072, 6144]
    line = [0.015 + 5e-6 * x for x in xs]
    assert fit_line_robust(xs, line) == pytest.approx((0.015, 5e-6))
    odd = [*line[:2], line[2] - 0.008, line[3]]
    assert fit_line(xs[:3], odd[:3])[1] < 2e-6
    assert fit_line_robust(xs, odd) == pytest.approx((0.015, 5e-6))
    with pytest.raises(ValueError, match="two different x"):
        fit_line_robust([1536, 1536], [0.02, 0.03])  # calibration_runs=[1536] twice
    assert fit_line_robust([1, 2], [-5.0, -6.0]) == (0.0, -1.0)  # the fixed part clipped at 0


def test_the_overhead_runs_train_every_batch_before_any_twice_and_fit_their_medians(
    monkeypatch, tmp_path
) -> None:
    """`measure_overhead`: each of `calibration_runs` trained `calibration_repeats` times,
    interleaved; each batch's median step less its prediction without overheads; the line
    through those residuals (s and s per sample), each run kept."""
    from benchmarks import calibrate

    cfg = replace(
        calibrate.CalibrateConfig(), calibration_runs=[1000, 2000, 4000], calibration_repeats=3
    )
    order, lengths = [], []
    slow = {"b2000_run2": 30.0}  # one odd run at batch 2000: the median holds it

    def train(overrides, cfg, run_dir, link, step_ms=None):
        order.append(run_dir.name)
        batch = int(overrides[0].split("=")[1])
        lengths.append(step_ms)  # a repeat trains as long as the first run needed, at once
        ms = 20.0 + 0.01 * batch + 10.0 + slow.get(run_dir.name, 0.0)  # model + 10 + 5 us
        return {"batch_per_rank": [batch, batch], "samples_per_s": 2 * batch / ms * 1000}

    def predict(overrides, run_dir, link, cal):
        return 20.0 + 0.005 * int(overrides[0].split("=")[1])

    monkeypatch.setattr(calibrate, "_train", train)
    monkeypatch.setattr(calibrate, "predict_ms", predict)
    runs, fixed_s, per_sample_s = calibrate.measure_overhead(cfg, tmp_path, None)
    assert order == [f"b{b}{s}" for s in ("", "_run2", "_run3") for b in (1000, 2000, 4000)]
    assert lengths == [None] * 3 + [pytest.approx(20.0 + 10.0 * b + 10.0) for b in (1, 2, 4)] * 2
    assert fixed_s == pytest.approx(0.010) and per_sample_s == pytest.approx(5e-6)
    assert runs[1]["batch"] == 2000 and runs[1]["measured_ms"] == pytest.approx(50.0)
    assert runs[1]["measured_runs_ms"] == pytest.approx([50.0, 80.0, 50.0])
    assert runs[1]["predicted_without_overhead_ms"] == pytest.approx(30.0)


def test_the_per_micro_batch_work_is_what_more_micro_batches_add_beyond_the_model(
    monkeypatch, tmp_path
) -> None:
    """`benchmarks.calibrate.measure_micro_batch`: nested at N = 1 and 8, each run's measured
    step less its prediction without the per-micro-batch work; the difference over the 7
    micro-batches added. Where the model already explains all of it, none (not negative)."""
    from benchmarks import calibrate

    cfg = calibrate.CalibrateConfig()
    measured, predicted = {1: 30.0, 8: 50.0}, {1: 32.0, 8: 31.0}

    def train(overrides, steps, run_dir, link):
        n = int(overrides[-1].split("=")[1])
        return {"batch_per_rank": [1000, 1000], "samples_per_s": 2000 / measured[n] * 1000}

    def predict(overrides, run_dir, link, cal):
        return predicted[int(overrides[-1].split("=")[1])]

    monkeypatch.setattr(calibrate, "_train", train)
    monkeypatch.setattr(calibrate, "predict_ms", predict)
    micro = calibrate.measure_micro_batch(cfg, tmp_path, None)
    assert micro["per_micro_batch_s"] == pytest.approx((50.0 - 31.0 - (30.0 - 32.0)) / 7 / 1000)
    assert [r["micro_batches"] for r in micro["runs"]] == [1, 8]
    measured[8] = 25.0
    assert calibrate.measure_micro_batch(cfg, tmp_path, None)["per_micro_batch_s"] == 0.0


def test_planner_calibration_plans_with_a_recorded_calibration(typed_cfg) -> None:
    """`planner.calibration=<file>`: CPU ranks planned with that day's constants, not the
    saved ones; a file that is not there is named."""
    from recsys.app.planning import plan_inputs
    from sharding.calibration import CalibrationError, load_calibration

    path = Path(__file__).parents[1] / "data" / "local_cpu_2026-12-02.json"
    recorded, saved = load_calibration(path).device, load_calibration().device
    assert recorded.dense_flops_per_s != saved.dense_flops_per_s
    inputs = plan_inputs(typed_cfg([f"planner.calibration={path}"]), None, None)
    assert inputs.devices[0].dense_flops_per_s == recorded.dense_flops_per_s
    assert (
        plan_inputs(typed_cfg(), None, None).devices[0].dense_flops_per_s == saved.dense_flops_per_s
    )
    with pytest.raises(CalibrationError, match="no calibration at /nowhere/cal.json"):
        plan_inputs(typed_cfg(["planner.calibration=/nowhere/cal.json"]), None, None)


def test_a_calibration_that_validated_nothing_keeps_the_published_results() -> None:
    """`measure=emulated 'settings=[]' save=true` (a user's own cluster measured alone) saves
    the constants; the published results, the validation's table, stay as they were."""
    from benchmarks.calibrate import CalibrateConfig, publishing

    told = CalibrateConfig(save=True, settings=[], measure="emulated")
    assert publishing(told, {"validation": []}).save is False
    validated = {"validation": [{"setting": "dlrm_small b1024 loopback plain"}]}
    assert publishing(told, validated).save is True
    assert publishing(CalibrateConfig(), {"validation": []}).save is False


def test_the_validation_prices_our_plans_from_their_plan_json(monkeypatch, tmp_path) -> None:
    """A validation run planned by hybrid is priced as its plan.json has it (split tables,
    hot rows, its batch split), as `benchmarks.plan_train` prices it; TorchRec's runs from
    the layout their ranks trained."""
    from benchmarks import calibrate
    from recsys.app.train import to_typed
    from sharding.calibration import load_calibration
    from sharding.plan_eval import evaluate
    from tests.conftest import compose_config

    monkeypatch.setattr(calibrate, "_compose", compose_config)
    over = ["debug=tiny", "planner=hybrid", "trainer.batch_size=2048"]
    cfg = to_typed(compose_config(over))
    plan = make_plan(cfg, plan_inputs(cfg, None, None))
    (tmp_path / "plan.json").write_text(json.dumps(plan_json(plan)))
    cal = load_calibration()
    expect = evaluate(plan, plan_inputs(cfg, None, "loopback", cal)).est_step_ms
    assert calibrate.predict_ms(over, tmp_path, "loopback", cal) == pytest.approx(expect)
    # TorchRec's plan.json names its planner: the layout is read (here: none was written)
    (tmp_path / "plan.json").write_text(json.dumps(plan_json(plan) | {"planner": "torchrec"}))
    with pytest.raises(FileNotFoundError, match="plan_layout.json"):
        calibrate.predict_ms(over, tmp_path, "loopback", cal)


def test_the_validation_prices_a_plan_that_left_devices_out_on_its_part(monkeypatch, tmp_path):
    """A generated setting's hybrid plan may leave ranks out: its plan.json names the part,
    which is priced on the part (with the calibration given, where the layout's constants
    are), not refused against the whole cluster."""
    from benchmarks import calibrate
    from recsys.app.train import to_typed
    from sharding.calibration import load_calibration
    from tests.conftest import compose_config

    monkeypatch.setattr(calibrate, "_compose", compose_config)
    over = ["cluster=emu_mixed4", "planner=hybrid", "trainer.batch_size=2048"]
    cfg = to_typed(compose_config(over))
    plan = make_plan(cfg, plan_inputs(cfg, None, None))
    assert plan.left_out == [2, 3] and plan.cluster == "emu_mixed4@ranks_0_1"
    (tmp_path / "plan.json").write_text(json.dumps(plan_json(plan)))
    cal = load_calibration()
    got = calibrate.predict_ms(over, tmp_path, "emu_mixed4", cal)
    assert got == pytest.approx(plan.est_step_ms)


def test_each_emulated_cluster_prices_its_shares_as_measured_there(monkeypatch, tmp_path) -> None:
    """A share's speed depends on what the rest of its cluster asks of the host's cores, so
    the calibration keeps each emulated cluster's shares apart (`<cluster>/<share>`): the
    same share measured at two speeds in two clusters is priced at each one's own, and a
    cluster measured alone (a user's layout) leaves the others' constants as they were. A
    file written before (bare `<share>` keys) still prices; a cluster with neither is
    refused, naming the calibration to run."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from conftest import cluster_of, compose_config

    from benchmarks import calibrate
    from recsys import emulation

    core = load_calibration().device
    fast = {"emu_mixed3": 2.0, "emu_mixed4": 1.0}  # the 0.25 share measured twice as fast

    @contextmanager
    def emulated(spec):
        ranks = resolve_cluster(spec)
        yield SimpleNamespace(name=spec.name, ranks=ranks)

    def run_ranks(emu, fn, args, timeout_s):
        if fn is calibrate.probe:
            sizes = [16_384, 1_048_576]
            return [
                {
                    "sizes_bytes": sizes,
                    "alltoall_s": [1e-3 + s / 1e7 for s in sizes],
                    "alltoall_cpu_s": [s * 1e-9 for s in sizes],
                    "allreduce_s": [2e-3 + s / 1e7 for s in sizes],
                }
            ] * len(emu.ranks)
        x = [r.share * fast[emu.name] for r in emu.ranks]
        return [
            {
                "embedding": {
                    "emb_read_bytes_per_s": core.emb_read_bytes_per_s * s,
                    "emb_bwd_factor": core.emb_bwd_factor,
                },
                "dense": {
                    "dense_flops_per_s": core.dense_flops_per_s * s,
                    "interaction_flops_per_s": core.interaction_flops_per_s * s,
                },
                "input": {"input_s_per_sample": core.input_s_per_sample / s},
            }
            for s in x
        ]

    def train(overrides, cfg, run_dir, link):
        # each rank's CPU a step at a 0.25 share: 1 + n x (2/3 ms at batch 1280, 4/3 at 2560)
        name = next(o.split("=")[1] for o in overrides if o.startswith("cluster="))
        n = int(next(o.split("=")[1] for o in overrides if o.startswith("pipeline.micro_batches")))
        batch = int(next(o.split("=")[1] for o in overrides if o.startswith("trainer.batch_size")))
        ranks = resolve_cluster(cluster_of(name))
        shares = [r.share for r in ranks]
        # the runs plan on the cluster's shares and link just measured, which no calibration
        # had before (a user's own layout): `device_costs` raises on a share it lacks
        path = next(o.split("=", 1)[1] for o in overrides if o.startswith("planner.calibration="))
        ahead = load_calibration(Path(path))
        assert len(device_costs(ranks, ahead, cluster=name)) == len(ranks) and name in ahead.links
        return {
            "batch_per_rank": [batch] * len(shares),
            "samples_per_s": 1e4,
            "cpu_ms_per_step_by_rank": [s * 4 * (1 + n * batch / 1920) for s in shares],
        }

    monkeypatch.setattr(emulation, "emulated", emulated)
    monkeypatch.setattr(emulation, "run_ranks", run_ranks)
    monkeypatch.setattr(calibrate, "raise_on_failure", lambda job, what: job)
    monkeypatch.setattr(calibrate, "_compose", compose_config)
    monkeypatch.setattr(calibrate, "_train", train)
    cfg = calibrate.CalibrateConfig(emulated=["emu_mixed4", "emu_mixed3"])
    shares = calibrate.measure_emulated(cfg, Calibration(device=core), tmp_path)["shares"]
    assert sorted(shares) == [
        "emu_mixed3/0.25",
        "emu_mixed3/0.8",
        "emu_mixed4/0.25",
        "emu_mixed4/0.6",
    ]
    m3, m4 = shares["emu_mixed3/0.25"], shares["emu_mixed4/0.25"]
    assert m3.dense_flops_per_s == pytest.approx(2 * m4.dense_flops_per_s)
    assert m3.step_overhead_s == pytest.approx(m4.step_overhead_s / 2)
    # each micro-batch past the first: the rank's CPU for it, at its share's quota (4 ms: the
    # mean of 2.67 and 5.33 over the two batches), measured on the cluster, not the one-core
    # fit scaled by the share's speed
    assert {k: v.micro_batch_overhead_s for k, v in shares.items()} == pytest.approx(
        dict.fromkeys(shares, 4e-3)
    )

    ranks = {n: resolve_cluster(cluster_of(n)) for n in fast}
    cal = Calibration(device=core, shares=shares)
    assert device_costs(ranks["emu_mixed3"], cal, cluster="emu_mixed3")[1] == m3
    assert device_costs(ranks["emu_mixed4"], cal, cluster="emu_mixed4")[2] == m4
    # a user's own cluster measured alone adds its keys; the presets' stay
    alone = calibrate.measure_emulated(
        replace(cfg, emulated=["emu_mixed3"]), Calibration(device=core), tmp_path
    )
    alone = alone["shares"]
    assert set(alone) == {"emu_mixed3/0.25", "emu_mixed3/0.8"}
    legacy = Calibration(device=core, shares={"0.25": m4, "0.6": shares["emu_mixed4/0.6"]})
    assert device_costs(ranks["emu_mixed4"], legacy, cluster="emu_mixed4")[3] == m4
    with pytest.raises(CalibrationError, match=r"emulated=\[emu_mixed3\]"):
        device_costs(ranks["emu_mixed3"], legacy, cluster="emu_mixed3")


def test_generated_validation_settings_are_drawn_from_their_seed(typed_cfg):
    """`benchmarks.calibrate`'s score: settings drawn at run time, each on its own emulated
    layout (1-3 nodes, at most 4 ranks, shares within `max_cores`), the same for a seed and
    different across seeds; each composes into a valid config."""
    from benchmarks.calibrate import generated_settings

    one, again, other = (generated_settings(s, 6) for s in (7, 7, 8))
    assert [g.overrides for g in one] == [g.overrides for g in again]
    assert [g.overrides for g in one] != [g.overrides for g in other]
    names = set()
    for g in one + other:
        cfg = typed_cfg(g.overrides)
        ranks = resolve_cluster(cfg.cluster)
        assert cfg.cluster.emulation.enabled and g.link == "emulated"
        assert 1 <= len(ranks) <= 4 and len({r.node for r in ranks}) <= 3
        assert sum(r.share for r in ranks) <= 1.8 + 0.02 and min(r.share for r in ranks) > 0.1
        assert cfg.trainer.batch_size in (1024, 2048) and g.name.startswith(cfg.cluster.name)
        names.add(cfg.cluster.name)
    assert len(names) == 12
