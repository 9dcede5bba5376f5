"""Resolve a ClusterSpec into one RankDevice per rank, validating it on the way."""

from __future__ import annotations

from sharding.constants import DEVICE_CATALOG, GIB, DeviceKind
from sharding.errors import UserError
from sharding.types import ClusterSpec, DeviceGroup, RankDevice

FIGURES = ("hbm_gb", "hbm_gbps", "speed")  # what a device the catalog lacks must give


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
        _positive(group.host_memory_gb, f"{where}.host_memory_gb", spec.name)
        _positive(group.host_to_device_gbps, f"{where}.host_to_device_gbps", spec.name)
        if not group.devices:
            raise ClusterConfigError(f"cluster '{spec.name}': {where} has no devices")
        for d, dev in enumerate(group.devices):
            _check_device(spec, dev, f"{where}.devices[{d}]")
    ranks: list[RankDevice] = []
    node = 0
    for group in spec.nodes:
        per_node = sum(d.count for d in group.devices)
        for _ in range(group.count):
            devices = [dev for dev in group.devices for _ in range(dev.count)]
            for local, dev in enumerate(devices):
                # a kind the catalog lacks has all its figures given (_check_device)
                kind = DEVICE_CATALOG.get(dev.kind) or DeviceKind(0.0, 0.0, 0.0, "its figures")
                ranks.append(RankDevice(
                    rank=len(ranks), node=node, local_rank=local, kind=dev.kind,
                    hbm_bytes=int((dev.hbm_gb or kind.hbm_gb) * GIB),
                    hbm_gbps=dev.hbm_gbps or kind.hbm_gbps,
                    speed=dev.speed or kind.speed * (dev.share or 1.0),
                    host_bytes=int(group.host_memory_gb * GIB / per_node),
                    host_to_device_gbps=group.host_to_device_gbps,
                    cores=tuple(dev.cores) if dev.cores is not None else None,
                    share=dev.share,
                ))  # fmt: skip
            node += 1
    return ranks


def _check_network(spec: ClusterSpec) -> None:
    if not spec.nodes:
        raise ClusterConfigError(f"cluster '{spec.name}' has no nodes")
    _positive(spec.network.intra_node_gbps, "network.intra_node_gbps", spec.name)
    _positive(spec.network.inter_node_gbps, "network.inter_node_gbps", spec.name)
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
    if spec.emulation.enabled and not spec.emulation.cfs_period_us >= 1000:
        raise ClusterConfigError(
            f"cluster '{spec.name}': emulation.cfs_period_us must be >= 1000 (the kernel's "
            f"minimum), got {spec.emulation.cfs_period_us}"
        )


def _check_device(spec: ClusterSpec, dev: DeviceGroup, where: str) -> None:
    """One device group's kind, counts and figures; its share and cores where they apply."""
    figures = [n for n in FIGURES if getattr(dev, n) is None]
    if dev.kind not in DEVICE_CATALOG and (figures or dev.kind == ""):
        raise ClusterConfigError(
            f"cluster '{spec.name}': {where}.kind '{dev.kind}' is not in the catalog "
            f"({', '.join(sorted(DEVICE_CATALOG))}); describe such a GPU by its figures: "
            f"{where}.hbm_gb (GiB), hbm_gbps (GB/s of memory bandwidth) and speed (dense "
            f"bf16 TFLOP/s / 312, an A100's); missing: {', '.join(figures)}"
        )
    _positive(dev.count, f"{where}.count", spec.name)
    for name in FIGURES:
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
