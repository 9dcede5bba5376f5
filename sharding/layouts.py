"""Cluster layouts generated from a seed, for planner contests on layouts nobody tuned for.

`random_layout(seed)` draws what a new user might bring: 1 to `max_ranks` GPUs (log-uniform),
1 to 6 device kinds from the catalog, each kind on its own nodes with their own node count
and devices per node (so node groups are unequal), inter-node links from 10 to 400 Gbit/s
per device (log-uniform), NVLink-class or PCIe-class links within a node, HBM ample (the
datasheet's) or short (a fraction of it: devices shared or a smaller SKU), host memory tight
or ample, and the all-reduce a ring or NCCL's choice.
"""

from __future__ import annotations

import numpy as np

from sharding.constants import DEVICE_CATALOG
from sharding.types import ClusterSpec, DeviceGroup, NetworkSpec, NodeGroup

GPU_KINDS = sorted(k for k in DEVICE_CATALOG if k != "cpu")


def random_layout(seed: int, max_ranks: int = 512) -> ClusterSpec:
    rng = np.random.default_rng(seed)
    target = int(round(np.exp(rng.uniform(0, np.log(max_ranks)))))
    n_kinds = int(rng.integers(1, min(6, len(GPU_KINDS), target) + 1))
    kinds = rng.choice(GPU_KINDS, n_kinds, replace=False)
    short_hbm = bool(rng.random() < 0.5)
    tight_host = bool(rng.random() < 0.5)
    nodes, left = [], target
    for i, kind in enumerate(kinds):
        share = left if i == n_kinds - 1 else max(1, int(round(left * rng.uniform(0.2, 0.8))))
        share = min(share, left - (n_kinds - 1 - i))  # every later kind keeps a device
        per_node = int(min(share, rng.choice([1, 2, 4, 8])))
        count = max(1, share // per_node)
        left -= count * per_node
        hbm = DEVICE_CATALOG[kind].hbm_gib * (rng.uniform(0.1, 0.4) if short_hbm else 1.0)
        nodes.append(
            NodeGroup(
                count=count,
                host_memory_gib=float(
                    rng.uniform(16, 64) if tight_host else rng.uniform(512, 2048)
                ),
                devices=[DeviceGroup(str(kind), per_node, hbm_gib=float(hbm))],
                intra_node_gbit_s=float(
                    rng.choice([200.0, 900.0, 2400.0]) if per_node > 1 else 200.0
                ),
            )
        )
    inter = float(np.exp(rng.uniform(np.log(10), np.log(400))))
    network = NetworkSpec(
        intra_node_gbit_s=900.0,
        inter_node_gbit_s=inter,
        allreduce=str(rng.choice(["ring", "nccl"])),
    )
    return ClusterSpec(name=f"layout_{seed}", nodes=nodes, network=network)


def describe(spec: ClusterSpec) -> str:
    """One line: the layout's node groups and links."""
    groups = ", ".join(f"{n.count}x{n.devices[0].count} {n.devices[0].kind}" for n in spec.nodes)
    return f"{groups}; {spec.network.inter_node_gbit_s:.0f} Gbit/s between nodes"
