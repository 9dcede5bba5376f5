"""Cost-model constants: calibrated for local CPU ranks; for GPUs measured where a probe ran
on that kind, else datasheet-derived.

`python -m benchmarks.calibrate` measures this machine and writes `calibration/local_cpu.json`
beside this file; the cost model loads it for every `cpu` rank (scaled by the rank's
`speed` relative to the catalog's `cpu` speed, so a rank sharing a core is slower).
`python -m benchmarks.gpu_probe` on a GPU writes `<kind>.json`; copied into
`calibration/gpu/`, its measured constants replace the datasheet assumptions for that kind
(scaled by a cluster config's own `hbm_gbyte_s` / `speed` for the device, if it sets them).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from sharding.constants import DEVICE_CATALOG
from sharding.cost_model import datasheet_device_cost, spec_network_cost
from sharding.errors import UserError
from sharding.subsets import parse as subset_parts
from sharding.types import ClusterSpec, DeviceCost, LinkCost, NetworkCost, RankDevice

DEFAULT_PATH = Path(__file__).parent / "calibration" / "local_cpu.json"
GPU_DIR = Path(__file__).parent / "calibration" / "gpu"  # <kind>.json from benchmarks.gpu_probe


@dataclass
class Calibration:
    device: DeviceCost  # one local CPU rank with one core, its peers running beside it
    # loopback, veth_1gbit, and per emulated cluster (its name) the links between its ranks
    links: dict[str, NetworkCost] = field(default_factory=dict)
    measured: dict = field(default_factory=dict)  # raw measurements and where they came from
    # emulated CPU ranks: one rank at that share of a core in that emulated cluster
    # (`share_key`), measured in its cgroup with the cluster's other ranks running beside it
    shares: dict[str, DeviceCost] = field(default_factory=dict)


def share_key(share: float, cluster: str = "") -> str:
    """`<cluster>/<share>`: a share's speed depends on what the rest of its cluster asks of
    the host's cores (docs/clusters.md, "Calibration and validation"), so each emulated
    cluster keeps its own. A bare `<share>` is a file written before that, its shares pooled
    over the clusters it measured."""
    return f"{cluster}/{share:g}" if cluster else f"{share:g}"


class CalibrationError(UserError, LookupError):
    """No calibration for these CPU ranks or this link: the message names the calibration to run."""


def save_calibration(cal: Calibration, path: Path = DEFAULT_PATH) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=2) + "\n")


def load_calibration(path: Path = DEFAULT_PATH) -> Calibration:
    if not path.exists():
        raise CalibrationError(
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
        shares={k: DeviceCost(**v) for k, v in raw.get("shares", {}).items()},
    )


@functools.cache
def _probe_file(path: Path, mtime_ns: int) -> dict:
    return json.loads(path.read_text())


def measured_gpu(kind: str) -> dict | None:
    """The probe's constants for a GPU kind (`GPU_DIR/<kind>.json`), or None."""
    path = GPU_DIR / f"{kind}.json"
    return _probe_file(path, path.stat().st_mtime_ns) if path.exists() else None


def gpu_device_cost(r: RankDevice, precision: str = "fp32") -> DeviceCost:
    """The datasheet model's constants, dense at `precision`, with every field the probe
    measured for this kind replaced by its measurement (dense: the probe's at that
    precision), scaled by the device's bandwidth and speed against the catalog's (a config
    that slows a device slows its measured rates alike)."""
    sheet = replace(datasheet_device_cost(r, precision), host_s_per_sample=host_assembly_s())
    probe = measured_gpu(r.kind)
    if probe is None:
        return sheet
    kind = DEVICE_CATALOG.get(r.kind)  # None: a device described by its figures
    mem, compute = (r.hbm_gbyte_s / kind.hbm_gbyte_s, r.speed / kind.speed) if kind else (1.0, 1.0)
    scale = {
        "emb_read_bytes_per_s": mem,
        "dense_flops_per_s": compute,
        "sequence_s_per_lookup": 1 / mem,
        "sequence_s_per_byte": 1 / mem,
    }
    measured = dict(probe["device"])
    dense = probe.get("dense_flops_per_s_by_precision", {})
    if precision in dense:
        measured["dense_flops_per_s"] = dense[precision]
    else:  # measured at another precision only: the datasheet's at this one
        measured.pop("dense_flops_per_s", None)
    return replace(sheet, **{k: v * scale.get(k, 1.0) for k, v in measured.items()})


@functools.cache
def host_assembly_s() -> float:
    """Seconds of host work per sample to assemble a GPU rank's batch: the batch assembly
    measured on this machine's CPU (`input_s_per_sample` of the shipped calibration, one
    core), as the trainer builds each rank's batches in one prefetch thread; 0 without a
    calibration."""
    if not DEFAULT_PATH.exists():
        return 0.0
    return float(json.loads(DEFAULT_PATH.read_text())["device"]["input_s_per_sample"])


def constants_source(kind: str) -> str:
    """Where a device kind's cost-model constants come from, in a few words."""
    if kind == "cpu":
        return f"calibrated on this machine ({DEFAULT_PATH.name})"
    probe = measured_gpu(kind)
    if probe is None:
        return "datasheet with assumed efficiencies (not measured)"
    m = probe["measured"]
    return (
        f"measured by benchmarks.gpu_probe on {m['device_name']}, {m['date'][:10]} "
        f"(calibration/gpu/{kind}.json; {', '.join(m['assumed'])} assumed)"
    )


# where each DeviceCost field of a GPU comes from without a probe (the datasheet model,
# sharding.constants.datasheet_rates)
_GPU_FIELDS = {
    "emb_read_bytes_per_s": "derived: HBM GB/s (datasheet, or the cluster's hbm_gbyte_s) x "
    "assumed embedding efficiency (GPU_EMB_EFFICIENCY)",
    "host_read_bytes_per_s": "cluster config: host_to_device_gbyte_s",
    "emb_bwd_factor": "assumed (GPU_BWD_FACTOR)",
    "dense_flops_per_s": "derived: dense TFLOP/s at the run's precision (datasheet, or the "
    "cluster's dense_tflops) x assumed MFU (GPU_DENSE_MFU)",
    "step_overhead_s": "assumed (GPU_STEP_OVERHEAD_S)",
    "input_s_per_sample": "assumed 0: batches built ahead on a worker thread",
    "interaction_flops_per_s": "assumed: the dense rate",
    "sample_overhead_s": "assumed 0",
    "host_s_per_sample": "calibrated on this machine's CPU (local_cpu.json input_s_per_sample: "
    "batch assembly at one core, the trainer's one prefetch thread a rank)",
    "sequence_s_per_lookup": "derived: HBM GB/s x assumed bytes a lookup "
    "(GPU_SEQUENCE_INDEX_BYTES)",
    "sequence_s_fixed": "assumed (GPU_SEQUENCE_FIXED_S)",
    "sequence_s_per_byte": "derived: HBM GB/s x assumed passes (GPU_SEQUENCE_PASSES)",
    "split_s_per_table": "assumed 0 (not measured on GPUs)",
    "split_s_per_lookup": "assumed 0 (not measured on GPUs)",
    "core_speed": "not used for GPUs",
}


def constants_provenance(kind: str) -> dict:
    """Where each cost-model constant of a device kind comes from: `source` (in a few
    words, `constants_source`) and per `DeviceCost` field one of measured (the GPU probe),
    calibrated (CPU ranks: this machine), derived (a datasheet or cluster figure times an
    assumed efficiency), cluster config, or assumed, naming the figure and constant."""
    if kind == "cpu":
        fields = {f: f"calibrated ({DEFAULT_PATH.name})" for f in _GPU_FIELDS}
        return {"source": constants_source(kind), "fields": fields}
    fields = dict(_GPU_FIELDS)
    probe = measured_gpu(kind)
    if probe is not None:
        m = probe["measured"]
        by = f"measured by benchmarks.gpu_probe on {m['device_name']}, {m['date'][:10]}"
        for f in probe["device"]:
            if f not in m.get("assumed", []):
                fields[f] = by
        if probe.get("dense_flops_per_s_by_precision"):
            done = ", ".join(sorted(probe["dense_flops_per_s_by_precision"]))
            fields["dense_flops_per_s"] = f"{by} ({done}; other precisions: the datasheet's)"
    return {"source": constants_source(kind), "fields": fields}


def device_costs(
    ranks: list[RankDevice], cal: Calibration | None, precision: str = "fp32", cluster: str = ""
) -> list[DeviceCost]:
    """Each rank's constants, its dense part at `precision` (`trainer.precision`). CPU ranks
    have the calibration's, measured at fp32: tf32 is fp32 on a CPU, and bf16 autocast on CPU
    ranks is priced at the fp32 rate, not measured. An emulated rank (a share of a core) has
    its share's as measured in `cluster`, the emulated cluster it belongs to."""
    out = []
    for r in ranks:
        if r.kind != "cpu":
            out.append(gpu_device_cost(r, precision))
            continue
        if cal is None:
            raise CalibrationError("CPU ranks need a calibration (python -m benchmarks.calibrate)")
        if r.share is not None:
            key, legacy = share_key(r.share, cluster), share_key(r.share)
            whole = _whole_cluster(cluster)
            if key not in cal.shares and whole and share_key(r.share, whole) in cal.shares:
                key = share_key(r.share, whole)  # a part of it, not measured on its own
            if key not in cal.shares and legacy not in cal.shares:
                raise CalibrationError(
                    f"rank {r.rank} is an emulated CPU rank at share {legacy} of the cluster "
                    f"'{cluster}', and the calibration has no share measured there (has: "
                    f"{sorted(cal.shares) or 'none'}); run `python -m benchmarks.calibrate "
                    f"measure=emulated emulated=[{cluster or '<the cluster>'}]` as root"
                )
            out.append(cal.shares.get(key) or cal.shares[legacy])
            continue
        scale = r.speed / DEVICE_CATALOG["cpu"].speed
        out.append(at_speed(cal.device, scale))
    return out


# a CPU rank's rates, and the CPU work only training runs measure (the calibration fits them)
RATE_FIELDS = (
    "emb_read_bytes_per_s",
    "host_read_bytes_per_s",
    "dense_flops_per_s",
    "interaction_flops_per_s",
)
OVERHEAD_FIELDS = (
    "step_overhead_s",
    "sample_overhead_s",
    "sequence_s_per_lookup",
    "sequence_s_fixed",
    "sequence_s_per_byte",
    "split_s_per_table",
    "split_s_per_lookup",
    "micro_batch_overhead_s",
)


# split tables' CPU work: what the split calibration fits (benchmarks.calibrate.measure_split)
SPLIT_WORK_FIELDS = (
    "sequence_s_per_lookup",
    "sequence_s_fixed",
    "sequence_s_per_byte",
    "split_s_per_table",
    "split_s_per_lookup",
)


def without_split_work(cal: Calibration) -> Calibration:
    """`cal` with split tables' CPU work free (one core's): what plans split tables where
    they would not pay, for runs that need them (the split calibration, tests)."""
    return replace(cal, device=replace(cal.device, **dict.fromkeys(SPLIT_WORK_FIELDS, 0.0)))


def at_speed(d: DeviceCost, scale: float) -> DeviceCost:
    """One-core constants `d` on a core `scale` times as fast: its rates times `scale`, its
    CPU times (batch assembly and the overheads) over it; every other field, the backward
    factor included, as it is."""
    times = ("input_s_per_sample", *OVERHEAD_FIELDS)
    return replace(
        d,
        core_speed=d.core_speed * scale,
        **{k: getattr(d, k) * scale for k in RATE_FIELDS},
        **{k: getattr(d, k) / scale for k in times},
    )


def _whole_cluster(name: str) -> str | None:
    """The whole cluster's name for a subset's (`sharding.subsets`), else None."""
    found = subset_parts(name)
    return found[0] if found else None


def calibrated_link(spec: ClusterSpec, link: str | None) -> str:
    """The calibrated link a CPU cluster's ranks use: `link` if named, else an emulated
    cluster's own (measured across its nodes), else loopback."""
    return link or (spec.name if spec.emulation.enabled else "loopback")


def network_cost(
    spec: ClusterSpec, ranks: list[RankDevice], cal: Calibration | None, link: str | None
) -> NetworkCost:
    """Calibrated link for local CPU clusters (`link`: loopback, veth_1gbit, ...; an emulated
    cluster's own by default, measured across its nodes); else from
    the spec. All-to-all: each device sends its own data over its share of the network:
    NVLink (`intra_node_gbit_s`, the slowest node group's) to ranks of its node, its NIC
    share across nodes. All-reduce
    across nodes: NCCL's rings enter and leave each node once per channel, one channel per
    device and NIC, so a node's devices together carry the ring at (devices per node) x
    their NIC share, capped by the intra-node link (NVIDIA/nccl#687, #569: multi-node
    all-reduce speeds up with more NICs in use)."""
    if all(r.kind == "cpu" for r in ranks) and cal is not None:
        name = calibrated_link(spec, link)
        whole = _whole_cluster(name)
        if name not in cal.links and whole:  # a part not measured on its own
            name = whole if len({r.node for r in ranks}) > 1 else "loopback"
        if name not in cal.links and spec.emulation.enabled and name == spec.name:
            raise CalibrationError(
                f"no calibration for the emulated cluster '{name}' (calibrated: "
                f"{sorted(cal.links)}); run `python -m benchmarks.calibrate measure=emulated "
                f"emulated=[{name}]` as root"
            )
        if name not in cal.links:
            raise CalibrationError(
                f"no calibration for link '{name}'; calibrated: {sorted(cal.links)}. Run "
                f"`python -m benchmarks.calibrate` (as root for veth links and emulated clusters)"
            )
        return cal.links[name]
    net = spec.network
    tree = net.allreduce == "nccl"
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r.node] = per_node.get(r.node, 0) + 1
    # node groups with their own link (NVLink nodes beside PCIe ones): a step waits for the
    # slowest node's exchange, so the slowest intra-node link prices every node's
    intra_gbit_s = min(g.intra_node_gbit_s or net.intra_node_gbit_s for g in spec.nodes)
    if len(per_node) == 1:
        return replace(spec_network_cost(intra_gbit_s, net.latency_us), tree_allreduce=tree)
    a2a = spec_network_cost(net.inter_node_gbit_s, net.latency_us).alltoall
    intra = spec_network_cost(intra_gbit_s, net.latency_us).alltoall
    ring_gbps = min(intra_gbit_s, net.inter_node_gbit_s * min(per_node.values()))
    ring = spec_network_cost(ring_gbps, net.latency_us).allreduce
    return NetworkCost(a2a, ring, intra, tree_allreduce=tree)
