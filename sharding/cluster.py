"""Resolve a ClusterSpec into one RankDevice per rank, validating it on the way."""

from __future__ import annotations

import math

from sharding.constants import A100_DENSE_FLOPS_PER_S, DEVICE_CATALOG, GIB, DeviceKind
from sharding.errors import UserError
from sharding.types import ClusterSpec, DeviceGroup, RankDevice

# what a device the catalog lacks must give (dense_tflops, or speed in its place)
FIGURES = ("hbm_gib", "hbm_gbyte_s", "dense_tflops")


class ClusterConfigError(UserError, ValueError):
    """A cluster layout that cannot describe real hardware."""


def _positive(value: float, what: str, cluster: str) -> None:
    if not value > 0:
        raise ClusterConfigError(
            f"cluster '{cluster}': {what} must be > 0, got {value}. Fix it in "
            f"conf/cluster/{cluster}.yaml or the override that set it."
        )


def resolve_cluster(spec: ClusterSpec) -> list[RankDevice]:
    """Expand node and device groups into ranks (node-major order, as torchrun numbers them),
    each value checked first."""
    _check_network(spec)
    for g, group in enumerate(spec.nodes):
        where = f"nodes[{g}]"
        _positive(group.count, f"{where}.count", spec.name)
        _positive(group.host_memory_gib, f"{where}.host_memory_gib", spec.name)
        _positive(group.host_to_device_gbyte_s, f"{where}.host_to_device_gbyte_s", spec.name)
        if not group.devices:
            raise ClusterConfigError(f"cluster '{spec.name}': {where} has no devices")
        for d, dev in enumerate(group.devices):
            _check_device(spec, dev, f"{where}.devices[{d}]")
    if spec.emulation.enabled:
        cfs_period_us(spec)
    ranks: list[RankDevice] = []
    node = 0
    for group in spec.nodes:
        per_node = sum(d.count for d in group.devices)
        for _ in range(group.count):
            devices = [dev for dev in group.devices for _ in range(dev.count)]
            for local, dev in enumerate(devices):
                # a kind the catalog lacks has all its figures given (_check_device)
                kind = DEVICE_CATALOG.get(dev.kind) or DeviceKind(0.0, 0.0, 0.0, "its figures")
                ranks.append(
                    RankDevice(
                        rank=len(ranks),
                        node=node,
                        local_rank=local,
                        kind=dev.kind,
                        hbm_bytes=int((dev.hbm_gib or kind.hbm_gib) * GIB),
                        hbm_gbyte_s=dev.hbm_gbyte_s or kind.hbm_gbyte_s,
                        speed=device_speed(dev, kind),
                        host_bytes=int(group.host_memory_gib * GIB / per_node),
                        host_to_device_gbyte_s=group.host_to_device_gbyte_s,
                        cores=tuple(dev.cores) if dev.cores is not None else None,
                        share=dev.share,
                    )
                )
            node += 1
    return ranks


def device_speed(dev: DeviceGroup, kind: DeviceKind) -> float:
    """Dense speed relative to an A100's bf16: `speed`, else `dense_tflops` / 312, else the
    catalog's (times the rank's core share, emulated CPU ranks)."""
    if dev.speed is not None:
        return dev.speed
    if dev.dense_tflops is not None:
        return dev.dense_tflops * 1e12 / A100_DENSE_FLOPS_PER_S
    return kind.speed * (dev.share or 1.0)


def _check_network(spec: ClusterSpec) -> None:
    if not spec.nodes:
        raise ClusterConfigError(f"cluster '{spec.name}' has no nodes")
    net = spec.network
    gpus = any(d.kind != "cpu" for g in spec.nodes for d in g.devices)
    nodes = sum(g.count for g in spec.nodes)
    needed = {
        "intra_node_gbit_s": gpus and any(g.intra_node_gbit_s is None for g in spec.nodes),
        "inter_node_gbit_s": (gpus and nodes > 1) or spec.emulation.enabled,
    }
    for key, required in needed.items():
        value = getattr(net, key)
        if value is None and required:
            what = (
                "NVLink or PCIe between the devices of a node; or per node group, "
                "nodes[..].intra_node_gbit_s"
                if key.startswith("intra")
                else "each device's share of its node's NIC"
            )
            raise ClusterConfigError(
                f"cluster '{spec.name}': network.{key} is required (Gbit/s, bits, per device "
                f"one way: {what}); a cluster is never planned on made-up links. Give it in "
                f"conf/cluster/{spec.name}.yaml"
            )
        if value is not None:
            _positive(value, f"network.{key}", spec.name)
    for g, group in enumerate(spec.nodes):
        if group.intra_node_gbit_s is not None:
            _positive(group.intra_node_gbit_s, f"nodes[{g}].intra_node_gbit_s", spec.name)
    if not spec.network.latency_us >= 0:
        raise ClusterConfigError(
            f"cluster '{spec.name}': network.latency_us must be >= 0, got "
            f"{spec.network.latency_us}. Fix it in conf/cluster/{spec.name}.yaml or the "
            f"override that set it."
        )
    if spec.network.allreduce not in ("ring", "nccl"):
        raise ClusterConfigError(
            f"cluster '{spec.name}': network.allreduce must be ring or nccl, got "
            f"'{spec.network.allreduce}'"
        )


MIN_CFS_QUOTA_US = 1000  # the kernel refuses a shorter cpu.cfs_quota_us / cpu.max quota


def cfs_period_us(spec: ClusterSpec) -> int:
    """The CFS period of an emulated cluster's rank quotas: `emulation.cfs_period_us`, or
    with 0 the shortest whole number of milliseconds at which every rank's quota (its share
    of the period) is at least the kernel's 1 ms minimum. Short periods make a share a
    slower core: a rank that waits on the network loses the rest of that period's quota
    only, so with long periods it computes at a whole core's speed after a wait. A period
    too short for a share's quota is refused (the kernel would raise the quota)."""
    shares = [d.share for g in spec.nodes for d in g.devices if d.share is not None]
    period = spec.emulation.cfs_period_us
    if not shares:  # no quota: the period is never used
        return period or 100_000
    if period == 0:
        return shortest_cfs_period_us(min(shares))
    if period * min(shares) < MIN_CFS_QUOTA_US - 1e-6:
        raise ClusterConfigError(
            f"cluster '{spec.name}': emulation.cfs_period_us={period} gives the share "
            f"{min(shares)} a quota of {period * min(shares):.0f} us, under the kernel's "
            f"{MIN_CFS_QUOTA_US} us minimum; use at least "
            f"{math.ceil(MIN_CFS_QUOTA_US / min(shares))}, or 0 (the shortest that fits)"
        )
    return period


def shortest_cfs_period_us(share: float) -> int:
    """The shortest whole number of milliseconds whose `share` is the kernel's minimum
    quota or more (4 ms at 0.25): the default period of an emulated rank at that share."""
    return 1000 * math.ceil(MIN_CFS_QUOTA_US / share / 1000 - 1e-9)


def _check_device(spec: ClusterSpec, dev: DeviceGroup, where: str) -> None:
    """One device group's kind, counts and figures; its share and cores where they apply."""
    figures = [
        n
        for n in FIGURES
        if getattr(dev, n) is None and not (n == "dense_tflops" and dev.speed is not None)
    ]
    if dev.kind not in DEVICE_CATALOG and (figures or dev.kind == ""):
        raise ClusterConfigError(
            f"cluster '{spec.name}': {where}.kind '{dev.kind}' is not in the catalog "
            f"({', '.join(sorted(DEVICE_CATALOG))}); describe such a GPU by its figures: "
            f"{where}.hbm_gib (memory, GiB), hbm_gbyte_s (memory bandwidth, GB/s) and "
            f"dense_tflops (dense bf16 TFLOP/s, fp32 where it has no bf16 tensor cores); "
            f"missing: {', '.join(figures)}"
        )
    _positive(dev.count, f"{where}.count", spec.name)
    for name in (*FIGURES, "speed"):
        value = getattr(dev, name)
        if value is not None:
            _positive(value, f"{where}.{name}", spec.name)
    if dev.share is not None:
        if dev.kind != "cpu" or not spec.emulation.enabled:
            raise ClusterConfigError(
                f"cluster '{spec.name}': {where}.share limits an emulated CPU rank; it "
                f"needs kind cpu (is {dev.kind}) and emulation.enabled=true"
            )
        if not 0 < dev.share <= 1:
            raise ClusterConfigError(
                f"cluster '{spec.name}': {where}.share is a fraction of one core in "
                f"(0, 1], got {dev.share}"
            )
    elif spec.emulation.enabled and dev.kind != "cpu":
        raise ClusterConfigError(
            f"cluster '{spec.name}': an emulated cluster runs CPU ranks; {where}.kind is {dev.kind}"
        )
    if dev.cores is not None:
        if dev.kind != "cpu":
            raise ClusterConfigError(
                f"cluster '{spec.name}': {where}.cores pins CPU ranks; kind is {dev.kind}"
            )
        if not dev.cores or min(dev.cores) < 0:
            raise ClusterConfigError(
                f"cluster '{spec.name}': {where}.cores must list core numbers >= 0"
            )


def compute_device_type(ranks: list[RankDevice]) -> str:
    """'cpu' for a cluster of local CPU ranks, 'cuda' for GPUs; a mix is an error."""
    kinds = {"cpu" if r.kind == "cpu" else "cuda" for r in ranks}
    if len(kinds) != 1:
        raise ClusterConfigError(
            "a cluster mixes 'cpu' ranks with GPUs; TorchRec runs one device type"
        )
    return kinds.pop()


def local_world_size(ranks: list[RankDevice]) -> int:
    """Ranks on the largest node (TorchRec's Topology takes one number)."""
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r.node] = per_node.get(r.node, 0) + 1
    return max(per_node.values())
