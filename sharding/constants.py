"""Hardware constants: the catalog of device kinds a cluster config can name.

Units are in the names. Sources: vendor datasheets (dense bf16/fp16 tensor-core TFLOP/s
without sparsity, HBM size and bandwidth of the SXM/PCIe part named). `speed` is dense
tensor-core TFLOP/s relative to an A100's bf16 (312 TFLOP/s); `DENSE_TFLOPS` gives each
precision's rate, which the cost model prices. Every field can be overridden per device in
a cluster config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceKind:
    hbm_gib: float  # memory of one device, GiB (for `cpu`: the rank's share of host RAM)
    hbm_gbyte_s: float  # memory bandwidth, GB/s
    speed: float  # dense compute relative to an A100
    source: str


# fmt: off
# ruff: noqa: E501 - one device a line reads best as a table
DEVICE_CATALOG: dict[str, DeviceKind] = {
    "h200_141g": DeviceKind(141.0, 4800.0, 989 / 312, "NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16"),
    "h100_80g": DeviceKind(80.0, 3350.0, 989 / 312, "NVIDIA H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16"),
    "a100_80g": DeviceKind(80.0, 2039.0, 1.0, "NVIDIA A100 SXM datasheet: 80 GB HBM2e, 2.039 TB/s, 312 TFLOP/s bf16"),
    "a100_40g": DeviceKind(40.0, 1555.0, 1.0, "NVIDIA A100 datasheet: 40 GB HBM2, 1.555 TB/s, 312 TFLOP/s bf16"),
    "v100_32g": DeviceKind(32.0, 900.0, 125 / 312, "NVIDIA V100 SXM2 datasheet: 32 GB HBM2, 900 GB/s, 125 TFLOP/s fp16"),
    "v100_16g": DeviceKind(16.0, 900.0, 125 / 312, "NVIDIA V100 SXM2 datasheet: 16 GB HBM2, 900 GB/s, 125 TFLOP/s fp16"),
    "l4_24g": DeviceKind(24.0, 300.0, 121 / 312, "NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOP/s fp16"),
    "t4_16g": DeviceKind(16.0, 320.0, 65 / 312, "NVIDIA T4 datasheet: 16 GB GDDR6, 320 GB/s, 65 TFLOP/s fp16"),
    # A local gloo rank on this project's 2-core test machine. Its memory is a budget set
    # small on purpose so placement limits bind; speed is a placeholder until calibrated.
    "cpu": DeviceKind(1.0, 10.0, 0.01, "local CPU rank: budget, not a datasheet number"),
}
# fmt: on

# Dense TFLOP/s by the dense part's precision (`trainer.precision`): datasheet figures, dense
# (without sparsity), of the parts named above. `speed` is the tensor-core column; a kind
# without TF32 tensor cores (V100, T4) runs tf32 as fp32, and one without bf16 ones runs
# bf16 in emulation (torch allows it on sm70/75), priced at its fp32 rate, which is
# optimistic. CPU ranks are calibrated (`benchmarks.calibrate`), not listed here.
PRECISIONS = ("fp32", "tf32", "bf16")
# fmt: off
DENSE_TFLOPS: dict[str, dict[str, float]] = {
    "h200_141g": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.0},
    "h100_80g": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.0},
    "a100_80g": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
    "a100_40g": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
    "v100_32g": {"fp32": 15.7},
    "v100_16g": {"fp32": 15.7},
    "l4_24g": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0},
    "t4_16g": {"fp32": 8.1},
}
# fmt: on

GIB = 1024**3

# GPU constants where no calibration exists. Sources: TorchRec's planner defaults
# (torchrec.distributed.planner.constants: BWD_COMPUTE_MULTIPLIER = 2; it assumes kernels
# reach about half of HBM bandwidth), and a dense MFU of 0.35 (typical of DLRM MLPs in
# MLPerf submissions). These are assumptions until calibrated on such a GPU.
GPU_EMB_EFFICIENCY = 0.5
GPU_BWD_FACTOR = 2.0
GPU_DENSE_MFU = 0.35
A100_DENSE_FLOPS_PER_S = 312e12
GPU_STEP_OVERHEAD_S = 1e-3
# The cold-only (sequence) exchange's own work on a GPU, derived, not measured: per cold
# lookup its vector is written once more than a pooled lookup's (the per-id output), read
# and written by the exchange's permute, read again by the pooling after it, and the same
# four passes for its gradient in backward: 8 passes over dim x 4 bytes, plus about 32
# bytes of id, offset and permute indices, all at GPU_EMB_EFFICIENCY of HBM bandwidth; and
# per step about 20 more kernel launches and a second variable-length exchange of sizes,
# ~10 us each. An estimate where `benchmarks.gpu_probe` has not measured it.
GPU_SEQUENCE_PASSES = 8
GPU_SEQUENCE_INDEX_BYTES = 32
GPU_SEQUENCE_FIXED_S = 20 * 10e-6


def precision_factor(kind: str, precision: str) -> float:
    """A kind's dense rate at `precision` relative to its `speed` (tensor-core) figure: 1 for
    bf16 where it has bf16 tensor cores, 67 / 989 for fp32 on an H100."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
    if kind not in DENSE_TFLOPS:  # described by its figures: its speed is all there is
        return 1.0
    rates = DENSE_TFLOPS[kind]
    rate = rates.get(precision) or rates["fp32"]
    return rate / (DEVICE_CATALOG[kind].speed * A100_DENSE_FLOPS_PER_S / 1e12)


def datasheet_rates(
    hbm_gbyte_s: float, speed: float, host_to_device_gbyte_s: float
) -> dict[str, float]:
    """`sharding.types.DeviceCost` fields of a GPU from its datasheet figures and the
    assumptions above (what `benchmarks.gpu_probe` measures instead, where it has run);
    `speed` is the dense speed at the run's precision, relative to an A100's bf16 peak."""
    hbm_bytes_per_s = hbm_gbyte_s * 1e9 * GPU_EMB_EFFICIENCY
    return {
        "emb_read_bytes_per_s": hbm_bytes_per_s,
        "host_read_bytes_per_s": host_to_device_gbyte_s * 1e9,
        "emb_bwd_factor": GPU_BWD_FACTOR,
        "dense_flops_per_s": speed * A100_DENSE_FLOPS_PER_S * GPU_DENSE_MFU,
        "step_overhead_s": GPU_STEP_OVERHEAD_S,
        "input_s_per_sample": 0.0,
        "interaction_flops_per_s": 0.0,
        "sample_overhead_s": 0.0,
        "sequence_s_per_lookup": GPU_SEQUENCE_INDEX_BYTES / hbm_bytes_per_s,
        "sequence_s_fixed": GPU_SEQUENCE_FIXED_S,
        "sequence_s_per_byte": GPU_SEQUENCE_PASSES / hbm_bytes_per_s,
    }


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[^0-9a-z]+", name.lower()) if t]


def gpu_kind(name: str, memory_gib: float) -> str | None:
    """The catalog kind of a GPU by its name and memory: the kind whose family is a whole
    word of the name ("NVIDIA H100 80GB HBM3": h100; "NVIDIA L40S" is no L4), nearest in
    memory; None for a GPU the catalog lacks."""
    words = set(_tokens(name))
    family = [k for k in DEVICE_CATALOG if k != "cpu" and k.split("_")[0] in words]
    return min(family, key=lambda k: abs(DEVICE_CATALOG[k].hbm_gib - memory_gib), default=None)
