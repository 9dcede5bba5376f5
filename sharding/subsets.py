"""Parts of a cluster: what a plan that leaves devices out trains on.

A subset keeps some of a cluster's ranks and everything about them (device, node, host
memory per device, the network); it is named `<cluster>@ranks_<r>_<r>...` after the ranks it
keeps, numbered as in the whole cluster. The candidates a planner weighs (`candidates`): each
set of whole nodes (every proper subset up to `MAX_NODE_SETS` of them; beyond that, the
fastest nodes first) and the devices of the fastest kinds (a kind: its device, its speed and,
emulated, its share of a core), each a proper, non-empty part of the cluster.

An emulated subset is priced with its own calibration where one was measured
(`python -m benchmarks.calibrate measure=emulated "emulated=['<subset name>']"`), else with
the whole cluster's: each rank's rates at its share as measured in the whole cluster, and
the link across its nodes, or loopback's for a subset on one node (`sharding.calibration`).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

from sharding.cluster import ClusterConfigError, resolve_cluster
from sharding.types import ClusterSpec, DeviceGroup, NodeGroup, RankDevice

SEP = "@ranks_"
MAX_NODE_SETS = 4  # up to this many nodes, every proper set of them is a candidate


def subset_name(cluster: str, keep: list[int]) -> str:
    return f"{cluster}{SEP}{'_'.join(map(str, keep))}"


def parse(name: str) -> tuple[str, list[int]] | None:
    """(the whole cluster's name, the ranks kept) of a subset's name; None for a cluster."""
    base, sep, ranks = name.partition(SEP)
    if not sep:
        return None
    return base, [int(r) for r in ranks.split("_")]


def part(spec: ClusterSpec) -> ClusterSpec:
    """`spec` on its `only_ranks` (the subset), or as it is without them."""
    if spec.only_ranks is None:
        return spec
    return subset(replace(spec, only_ranks=None), spec.only_ranks)


def subset(spec: ClusterSpec, keep: list[int]) -> ClusterSpec:
    """The part of `spec` with the ranks `keep` (in the whole cluster's numbering): their
    nodes with those devices alone, each node's host memory as much per device as before."""
    ranks = resolve_cluster(spec)
    wanted = sorted(set(keep))
    if not wanted or wanted[-1] >= len(ranks) or wanted[0] < 0:
        raise ClusterConfigError(
            f"cluster.only_ranks={keep}: cluster '{spec.name}' has ranks 0-{len(ranks) - 1}; "
            f"name some of them"
        )
    devices = _devices_by_rank(spec)
    nodes = []
    for node in sorted({ranks[r].node for r in wanted}):
        group, per_node = _group_of(spec, node)
        kept = [devices[r] for r in wanted if ranks[r].node == node]
        nodes.append(
            replace(
                group,
                count=1,
                host_memory_gib=group.host_memory_gib * len(kept) / per_node,
                devices=_merged(kept),
            )
        )
    whole = parse(spec.name)  # a part of a part: named in the whole cluster's numbering
    name = subset_name(whole[0], [whole[1][r] for r in wanted]) if whole else None
    return replace(
        copy.deepcopy(spec),
        name=name or subset_name(spec.name, wanted),
        nodes=copy.deepcopy(nodes),
    )


def candidates(spec: ClusterSpec) -> list[tuple[list[int], str]]:
    """The parts of `spec` worth weighing, each (ranks kept, what it is): sets of whole
    nodes, and the devices of the fastest kinds; no duplicates, never the whole cluster."""
    ranks = resolve_cluster(spec)
    world = len(ranks)
    found: dict[tuple[int, ...], str] = {}
    nodes = sorted({r.node for r in ranks})
    speed = {n: sum(r.speed for r in ranks if r.node == n) for n in nodes}
    if len(nodes) <= MAX_NODE_SETS:
        node_sets = [
            list(c) for k in range(1, len(nodes)) for c in itertools.combinations(nodes, k)
        ]
    else:  # the fastest nodes first: 1, 2, ... of them
        fastest = sorted(nodes, key=lambda n: -speed[n])
        node_sets = [sorted(fastest[:k]) for k in range(1, len(nodes))]
    for chosen in node_sets:
        keep = tuple(r.rank for r in ranks if r.node in chosen)
        found.setdefault(keep, f"node{'s' if len(chosen) > 1 else ''} {_listed(chosen)}")
    kinds = sorted({_kind(r) for r in ranks}, key=lambda k: -k[2])
    for k in range(1, len(kinds)):
        top = set(kinds[:k])
        keep = tuple(r.rank for r in ranks if _kind(r) in top)
        found.setdefault(
            keep,
            f"the fastest device kind{'s' if k > 1 else ''}: "
            + ", ".join(_kind_text(x) for x in kinds[:k]),
        )
    out, seen = [], set()
    for keep, what in found.items():
        # parts alike (the same devices on alike nodes: either node of 2x8_h100) are one
        alike = tuple(
            sorted(tuple(_kind(r) for r in ranks if r.node == n and r.rank in keep) for n in nodes)
        )
        if 0 < len(keep) < world and alike not in seen:
            seen.add(alike)
            out.append((list(keep), what))
    return out


def _kind(r: RankDevice) -> tuple[str, float | None, float]:
    return (r.kind, r.share, r.speed)


def _kind_text(kind: tuple[str, float | None, float]) -> str:
    name, share, _ = kind
    return f"{name} at share {share:g}" if share is not None else name


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values))


def _devices_by_rank(spec: ClusterSpec) -> list[DeviceGroup]:
    """Each rank's device group (one device each), in rank order."""
    out = []
    for group in spec.nodes:
        for _ in range(group.count):
            out += [replace(dev, count=1) for dev in group.devices for _ in range(dev.count)]
    return out


def _group_of(spec: ClusterSpec, node: int) -> tuple[NodeGroup, int]:
    """The node group of node `node` and its devices per node."""
    seen = 0
    for group in spec.nodes:
        if node < seen + group.count:
            return group, sum(d.count for d in group.devices)
        seen += group.count
    raise IndexError(node)


def _merged(devices: list[DeviceGroup]) -> list[DeviceGroup]:
    """Neighbouring equal devices as one group with their count."""
    out: list[DeviceGroup] = []
    for dev in devices:
        if out and replace(out[-1], count=1) == dev:
            out[-1] = replace(out[-1], count=out[-1].count + 1)
        else:
            out.append(dev)
    return out
