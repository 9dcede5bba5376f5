"""Cluster layouts resolve to ranks; invalid ones fail clearly, naming the field."""

from __future__ import annotations

import pytest

from sharding.cluster import ClusterConfigError, compute_device_type, resolve_cluster
from sharding.constants import GIB
from sharding.types import ClusterSpec, DeviceGroup, NetworkSpec, NodeGroup


# the links every GPU layout here is planned on (a cluster must give its own)
def net() -> NetworkSpec:
    return NetworkSpec(intra_node_gbit_s=100.0, inter_node_gbit_s=25.0)


def hetero() -> ClusterSpec:
    return ClusterSpec(
        network=net(),
        name="mixed",
        nodes=[
            NodeGroup(count=1, host_memory_gib=64, devices=[DeviceGroup("a100_80g", 2)]),
            NodeGroup(
                count=2,
                host_memory_gib=32,
                devices=[DeviceGroup("v100_16g", 1), DeviceGroup("t4_16g", 1, hbm_gib=8)],
            ),
        ],
    )


def test_resolve_expands_groups_in_node_major_order() -> None:
    ranks = resolve_cluster(hetero())
    assert [r.kind for r in ranks] == ["a100_80g", "a100_80g", "v100_16g", "t4_16g"] * 1 + [
        "v100_16g",
        "t4_16g",
    ]
    assert [r.node for r in ranks] == [0, 0, 1, 1, 2, 2]
    assert [r.local_rank for r in ranks] == [0, 1, 0, 1, 0, 1]
    assert ranks[0].hbm_bytes == 80 * GIB
    assert ranks[3].hbm_bytes == 8 * GIB  # per-device override beats the catalog
    assert ranks[2].host_bytes == 16 * GIB  # 32 GiB host memory shared by 2 devices
    assert compute_device_type(ranks) == "cuda"


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (
            lambda c: setattr(c.nodes[0].devices[0], "kind", "tpu_v9"),
            "kind 'tpu_v9' is not in the catalog .* missing: hbm_gib, hbm_gbyte_s, dense_tflops",
        ),
        (lambda c: setattr(c.nodes[0].devices[0], "count", 0), "devices[0].count must be > 0"),
        (lambda c: setattr(c.nodes[1], "host_memory_gib", -1.0), "nodes[1].host_memory_gib"),
        (lambda c: setattr(c.nodes[1].devices[1], "hbm_gib", 0.0), "devices[1].hbm_gib"),
        (lambda c: setattr(c.network, "inter_node_gbit_s", 0.0), "inter_node_gbit_s"),
        (lambda c: setattr(c.network, "latency_us", -100000.0), "latency_us must be >= 0"),
        (lambda c: setattr(c, "nodes", []), "has no nodes"),
    ],
)
def test_invalid_layouts_fail_naming_the_field(mutate, needle: str) -> None:
    spec = hetero()
    mutate(spec)
    with pytest.raises(ClusterConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        resolve_cluster(spec)


def test_a_gpu_the_catalog_lacks_is_described_by_its_figures(typed_cfg) -> None:
    """An A10G (24 GB, 600 GB/s, 125 dense TFLOP/s) is no catalog kind: given its figures it
    resolves, plans and is priced from them; without them it is refused naming what is
    missing."""
    from recsys.app.planning import make_plan, plan_inputs

    a10g = [
        "cluster=1x8_a100_80g",
        "cluster.nodes.0.devices.0.kind=a10g_24g",
        "cluster.nodes.0.devices.0.count=2",
        "cluster.nodes.0.devices.0.hbm_gib=24",
        "cluster.nodes.0.devices.0.hbm_gbyte_s=600",
    ]
    with pytest.raises(ClusterConfigError, match="missing: dense_tflops"):
        resolve_cluster(typed_cfg(a10g).cluster)
    cfg = typed_cfg(a10g + ["cluster.nodes.0.devices.0.dense_tflops=125", "model=dcnv2_small"])
    ranks = resolve_cluster(cfg.cluster)
    assert [r.kind for r in ranks] == ["a10g_24g"] * 2 and ranks[0].hbm_bytes == 24 * GIB
    assert ranks[0].speed == pytest.approx(125 / 312)
    assert compute_device_type(ranks) == "cuda"
    inputs = plan_inputs(cfg, None, None)
    assert inputs.devices[0].emb_read_bytes_per_s == pytest.approx(600e9 * 0.5)
    assert inputs.devices[0].dense_flops_per_s == pytest.approx(125e12 * 0.35)
    assert make_plan(cfg, inputs).feasible
    # speed, relative to an A100, stands in for dense_tflops
    speed = typed_cfg(a10g + ["cluster.nodes.0.devices.0.speed=0.4"])
    assert resolve_cluster(speed.cluster)[0].speed == 0.4


def test_units_are_in_the_names_and_old_names_are_refused(typed_cfg) -> None:
    """GiB, GB/s (bytes) and Gbit/s (bits) are in every figure's name; a file with the
    former `*_gbps` names (Gbit/s for links, GB/s for memory) fails naming the key."""
    from hydra.errors import ConfigCompositionException

    cfg = typed_cfg(["cluster=hetero_3node"])
    assert cfg.cluster.network.intra_node_gbit_s == 300
    assert cfg.cluster.nodes[0].host_to_device_gbyte_s == 25
    for old in [
        "cluster.network.intra_node_gbps=300",
        "cluster.nodes.0.host_to_device_gbps=25",
        "cluster.nodes.0.devices.0.hbm_gbps=600",
    ]:
        with pytest.raises(ConfigCompositionException, match=old.split("=")[0].split(".")[-1]):
            typed_cfg(["cluster=hetero_3node", old])


def test_a_gpu_cluster_must_give_its_links() -> None:
    """No made-up network: a GPU layout without its links is refused naming the key; one
    node needs no inter-node link; a node group may bring its own (PCIe beside NVLink), and
    the slowest prices the exchange."""
    from sharding.calibration import network_cost

    def spec(**net) -> ClusterSpec:
        nodes = [NodeGroup(count=2, devices=[DeviceGroup("a100_80g", 2)])]
        return ClusterSpec(name="mine", network=NetworkSpec(**net), nodes=nodes)

    with pytest.raises(ClusterConfigError, match=r"network.intra_node_gbit_s is required"):
        resolve_cluster(spec(inter_node_gbit_s=25))
    with pytest.raises(ClusterConfigError, match=r"network.inter_node_gbit_s is required"):
        resolve_cluster(spec(intra_node_gbit_s=300))
    one = spec(intra_node_gbit_s=300)
    one.nodes[0].count = 1
    assert len(resolve_cluster(one)) == 2
    mixed = spec(intra_node_gbit_s=2400, inter_node_gbit_s=200)
    pcie = NodeGroup(devices=[DeviceGroup("a100_80g", 2)], intra_node_gbit_s=64)
    mixed.nodes = [NodeGroup(devices=[DeviceGroup("a100_80g", 2)]), pcie]
    fast = spec(intra_node_gbit_s=2400, inter_node_gbit_s=200)
    slow, quick = (network_cost(s, resolve_cluster(s), None, None) for s in (mixed, fast))
    assert slow.intra_alltoall.bytes_per_s == pytest.approx(64e9 / 8)
    assert quick.intra_alltoall.bytes_per_s == pytest.approx(2400e9 / 8)
    # CPU ranks plan on calibrated links: no network needed
    assert resolve_cluster(ClusterSpec(nodes=[NodeGroup(devices=[DeviceGroup("cpu", 2)])]))


def test_presets_have_the_documented_shapes(typed_cfg) -> None:
    sizes = {
        "local_cpu2": 2,
        "local_cpu3_skewed": 3,
        "1x1_a100_80g": 1,
        "1x8_a100_80g": 8,
        "1x8_h100": 8,
        "2x8_h100": 16,
        "hetero_3node": 24,
        "hetero_64": 64,
    }
    for name, world in sizes.items():
        ranks = resolve_cluster(typed_cfg([f"cluster={name}"]).cluster)
        assert len(ranks) == world, name
    hetero = resolve_cluster(typed_cfg(["cluster=hetero_64"]).cluster)
    assert len({r.kind for r in hetero}) >= 4 and len({r.node for r in hetero}) == 8
    skewed = resolve_cluster(typed_cfg(["cluster=local_cpu3_skewed"]).cluster)
    assert [r.cores for r in skewed] == [(0,), (0,), (1,)]
    pinned = resolve_cluster(typed_cfg(["cluster=local_cpu2_pinned"]).cluster)
    assert [r.cores for r in pinned] == [(0,), (1,)]
    assert skewed[2].speed == 2 * skewed[0].speed


def test_core_pinning_is_only_for_cpu_ranks() -> None:
    gpu = ClusterSpec(
        network=net(), nodes=[NodeGroup(devices=[DeviceGroup("t4_16g", 1, cores=[0])])]
    )
    with pytest.raises(ClusterConfigError, match="pins CPU ranks"):
        resolve_cluster(gpu)
    empty = ClusterSpec(network=net(), nodes=[NodeGroup(devices=[DeviceGroup("cpu", 1, cores=[])])])
    with pytest.raises(ClusterConfigError, match="core numbers"):
        resolve_cluster(empty)


def test_mixing_cpu_and_gpu_ranks_is_rejected() -> None:
    spec = ClusterSpec(
        network=net(), nodes=[NodeGroup(devices=[DeviceGroup("cpu", 1), DeviceGroup("t4_16g", 1)])]
    )
    with pytest.raises(ClusterConfigError, match="mixes"):
        compute_device_type(resolve_cluster(spec))
