"""`python -m sharding.describe output=<dir>/cluster/<name>.yaml [ranks=N] [probe=<file>]`:
this machine as a cluster file, from what it can see and measure.

CPU ranks (no GPU, or `gpus=false`): one rank per usable core (`ranks=` for another count),
each pinned to its core when there are as many cores as ranks, and the host's memory; their
links are the calibrated ones (`benchmarks.calibrate`), so no network figures. GPUs: each
visible GPU by its catalog kind (its name and memory, `sharding.constants.gpu_kind`), or
where the catalog lacks it by its figures, which come from the GPU probe's output (`probe=`:
the `<kind>.json` that `python -m benchmarks.gpu_probe` writes; memory bandwidth and dense
TFLOP/s back from the achieved rates it measured, the link between the node's GPUs from its
NCCL all-to-all). A figure nothing measured is written as `???`, which every command
refuses naming the key until it is filled in: a description is never guessed. The file is
the presets' layout, for `--config-dir <dir> cluster=<name>`.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from recsys.app.entry import hydra_command
from sharding.constants import GIB, GPU_DENSE_MFU, GPU_EMB_EFFICIENCY, gpu_kind
from sharding.errors import UserError


class DescribeError(UserError, ValueError):
    """This machine cannot be described as asked."""


@dataclass
class DescribeConfig:
    output: str = MISSING  # the file to write: <dir>/cluster/<name>.yaml
    name: str | None = None  # the cluster's name; default: the file's stem
    ranks: int | None = None  # CPU ranks; default: one per usable core
    gpus: bool = True  # false: describe the CPU ranks even where GPUs are visible
    probe: str | None = None  # the GPU probe's <kind>.json, for a GPU the catalog lacks
    overwrite: bool = False


def host_memory_gib() -> float:
    """MemTotal of /proc/meminfo, GiB (one decimal, rounded down)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(int(line.split()[1]) * 1024 / GIB * 10) / 10
    raise DescribeError("cannot read MemTotal from /proc/meminfo")


def _cpu_devices(ranks: int | None) -> tuple[list[dict], str]:
    cores = sorted(os.sched_getaffinity(0))
    count = ranks or len(cores)
    if count < 1:
        raise DescribeError(f"ranks={ranks}: give at least 1")
    device: dict = {"kind": "cpu", "count": count}
    pinned = count == len(cores)
    note = (
        f"{len(cores)} usable cores: one rank each, pinned"
        if pinned
        else f"{count} ranks sharing {len(cores)} usable cores (unpinned)"
    )
    if pinned:  # one device group per core, each pinned
        return [{"kind": "cpu", "count": 1, "cores": [c]} for c in cores], note
    return [device], note


def _probe_figures(probe: str | None) -> dict:
    """Datasheet-equivalent figures back from the probe's achieved rates."""
    if probe is None:
        return {}
    consts = json.loads(Path(probe).read_text())
    device = consts.get("device", {})
    out = {}
    if device.get("emb_read_bytes_per_s"):
        out["hbm_gbyte_s"] = round(device["emb_read_bytes_per_s"] / GPU_EMB_EFFICIENCY / 1e9, 1)
    bf16 = (consts.get("dense_flops_per_s_by_precision") or {}).get("bf16")
    if bf16:
        out["dense_tflops"] = round(bf16 / GPU_DENSE_MFU / 1e12, 1)
    a2a = ((consts.get("links") or {}).get("intra_node") or {}).get("alltoall")
    if a2a:
        out["intra_node_gbit_s"] = round(a2a["bytes_per_s"] * 8 / 1e9, 1)
    return out


def _gpu_devices(probe: str | None) -> tuple[list[dict], dict, str]:
    import torch

    figures = _probe_figures(probe)
    groups: list[dict] = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        memory = props.total_memory / GIB
        kind = gpu_kind(props.name, memory)
        entry: dict = {"kind": kind, "count": 1}
        if kind is None:  # the catalog lacks it: its figures, measured or to be filled in
            entry = {
                "kind": re.sub(r"[^a-z0-9]+", "_", props.name.lower()).strip("_"),
                "count": 1,
                "hbm_gib": int(memory * 10) / 10,
                "hbm_gbyte_s": figures.get("hbm_gbyte_s", MISSING),
                "dense_tflops": figures.get("dense_tflops", MISSING),
            }
        if groups and {k: v for k, v in groups[-1].items() if k != "count"} == {
            k: v for k, v in entry.items() if k != "count"
        }:
            groups[-1]["count"] += 1
        else:
            groups.append(entry)
    count = sum(g["count"] for g in groups)
    network = {"intra_node_gbit_s": figures.get("intra_node_gbit_s", MISSING)} if count > 1 else {}
    return groups, network, f"{count} GPU(s): {', '.join(g['kind'] for g in groups)}"


def describe(cfg: DescribeConfig) -> dict:
    """The cluster description of this machine (module docstring), as a dict."""
    import torch

    gpus = cfg.gpus and torch.cuda.is_available() and torch.cuda.device_count() > 0
    if gpus:
        devices, network, note = _gpu_devices(cfg.probe)
    else:
        devices, note = _cpu_devices(cfg.ranks)
        network = {}
    name = cfg.name or Path(cfg.output).stem
    node: dict = {"count": 1, "host_memory_gib": host_memory_gib(), "devices": devices}
    spec = {"name": name, "nodes": [node]}
    if network:
        spec["network"] = network
    return {"spec": spec, "note": note}


def write_description(cfg: DescribeConfig) -> Path:
    out = Path(cfg.output)
    if out.suffix != ".yaml":
        raise DescribeError(f"output={out}: name a .yaml file, <dir>/cluster/<name>.yaml")
    if out.exists() and not cfg.overwrite:
        raise DescribeError(f"'{out}' exists; choose a new file or pass overwrite=true")
    found = describe(cfg)
    spec, missing = found["spec"], _missing(found["spec"])
    header = [
        f"# {spec['name']}: written by `python -m sharding.describe` on "
        f"{socket.gethostname()}: {found['note']}."
    ]
    if missing:
        header.append(
            f"# Fill in each ??? (nothing measured it): {', '.join(missing)}; "
            f"docs/clusters.md says what each is."
        )
    if spec["nodes"][0]["devices"][0]["kind"] == "cpu":
        header.append(
            "# CPU ranks plan on the calibrated links (benchmarks.calibrate): no network figures."
        )
    body = OmegaConf.to_yaml(OmegaConf.create({"defaults": ["base_cluster", "_self_"], **spec}))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text("\n".join(header) + "\n" + body)
    tmp.replace(out)
    return out


def _missing(spec: dict, where: str = "") -> list[str]:
    found = []
    items = spec.items() if isinstance(spec, dict) else enumerate(spec)
    for key, value in items:
        path = f"{where}.{key}" if isinstance(spec, dict) else f"{where}[{key}]"
        if value == MISSING:
            found.append(path.lstrip("."))
        elif isinstance(value, dict | list):
            found += _missing(value, path)
    return found


ConfigStore.instance().store(name="base_describe", node=DescribeConfig)


@hydra_command("describe")
def main(cfg: DescribeConfig, run_dir: Path) -> None:
    out = write_description(cfg)
    name = cfg.name or out.stem
    print(f"{out}\nuse it with: --config-dir {out.parent.parent} cluster={name}")
