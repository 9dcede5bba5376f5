"""Cost-model constants: calibrated for local CPU ranks, datasheet-derived for GPUs.

`python -m benchmarks.calibrate` measures this machine and writes `calibration/local_cpu.json`
beside this file; the cost model loads it for every `cpu` rank (scaled by the rank's
`speed` relative to the catalog's `cpu` speed, so a rank sharing a core is slower).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sharding.constants import DEVICE_CATALOG
from sharding.cost_model import (
    DeviceCost,
    LinkCost,
    NetworkCost,
    datasheet_device_cost,
    spec_network_cost,
)
from sharding.types import ClusterSpec, RankDevice

DEFAULT_PATH = Path(__file__).parent / "calibration" / "local_cpu.json"


@dataclass
class Calibration:
    device: DeviceCost  # one local CPU rank with one core, its peers running beside it
    links: dict[str, NetworkCost] = field(default_factory=dict)  # e.g. loopback, veth_1gbit
    measured: dict = field(default_factory=dict)  # raw measurements and where they came from


def save_calibration(cal: Calibration, path: Path = DEFAULT_PATH) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=2) + "\n")


def load_calibration(path: Path = DEFAULT_PATH) -> Calibration:
    if not path.exists():
        raise FileNotFoundError(
            f"no calibration at {path}: run `python -m benchmarks.calibrate` on this machine"
        )
    raw = json.loads(path.read_text())
    links = {
        name: NetworkCost(LinkCost(**v["alltoall"]), LinkCost(**v["allreduce"]))
        for name, v in raw["links"].items()
    }
    return Calibration(
        device=DeviceCost(**raw["device"]),
        links=links,
        measured=raw.get("measured", {}),
    )


def device_costs(ranks: list[RankDevice], cal: Calibration | None) -> list[DeviceCost]:
    out = []
    for r in ranks:
        if r.kind != "cpu":
            out.append(datasheet_device_cost(r))
            continue
        if cal is None:
            raise FileNotFoundError("CPU ranks need a calibration (python -m benchmarks.calibrate)")
        scale = r.speed / DEVICE_CATALOG["cpu"].speed
        d = cal.device
        out.append(
            DeviceCost(
                emb_read_bytes_per_s=d.emb_read_bytes_per_s * scale,
                host_read_bytes_per_s=d.host_read_bytes_per_s * scale,
                emb_bwd_factor=d.emb_bwd_factor,
                dense_flops_per_s=d.dense_flops_per_s * scale,
                step_overhead_s=d.step_overhead_s / scale,
                input_s_per_sample=d.input_s_per_sample / scale,
                interaction_flops_per_s=d.interaction_flops_per_s * scale,
                sample_overhead_s=d.sample_overhead_s / scale,
                sequence_s_per_lookup=d.sequence_s_per_lookup / scale,
                sequence_s_fixed=d.sequence_s_fixed / scale,
            )
        )
    return out


def network_cost(
    spec: ClusterSpec, ranks: list[RankDevice], cal: Calibration | None, link: str | None
) -> NetworkCost:
    """Calibrated link for local CPU clusters (`link`: loopback, veth_1gbit, ...); else the
    slowest network the cluster spans, from its spec."""
    if all(r.kind == "cpu" for r in ranks) and cal is not None:
        name = link or "loopback"
        if name not in cal.links:
            raise KeyError(f"no calibration for link '{name}'; calibrated: {sorted(cal.links)}")
        return cal.links[name]
    multi_node = len({r.node for r in ranks}) > 1
    gbps = spec.network.inter_node_gbps if multi_node else spec.network.intra_node_gbps
    return spec_network_cost(gbps, spec.network.latency_us)
