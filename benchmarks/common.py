"""What every benchmark saves beside its numbers: versions, machine, resolved config."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    import fbgemm_gpu
    import numpy
    import torch
    import torchrec

    return {
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "unknown"),
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "unknown"),
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def save(
    result: dict, table: str, name: str, dirs: list[Path], json_name: str | None = None
) -> list[Path]:
    """Write `<json_name or name>.json` and `<name>.md` into each directory."""
    written = []
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result, indent=2, default=_plain)
        (d / f"{json_name or name}.json").write_text(text + "\n")
        (d / f"{name}.md").write_text(table + "\n")
        written.append(d / f"{name}.md")
    return written


def _plain(value: Any) -> Any:
    """numpy scalars as plain numbers for JSON."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def start(cfg: Any) -> Any:
    """A benchmark app's typed config, with the libraries' routine warnings filtered."""
    from omegaconf import OmegaConf

    from recsys.train import quiet_library_noise

    quiet_library_noise()
    return OmegaConf.to_object(cfg)


def finish(
    result: dict, table: str, name: str, results_dir: str, json_name: str | None = None
) -> None:
    """Print the table; save it and the JSON under `results_dir` and the Hydra run dir."""
    from hydra.core.hydra_config import HydraConfig

    print(table)
    dirs = [Path(results_dir), Path(HydraConfig.get().runtime.output_dir)]
    print("saved:", ", ".join(map(str, save(result, table, name, dirs, json_name))))


def planner_overrides(label: str) -> list[str]:
    """`hybrid+pooled` -> hybrid with TorchRec's pooled exchange for split tables' cold
    parts; any other label is a planner name."""
    name, _, variant = label.partition("+")
    if variant not in ("", "pooled"):
        raise ValueError(f"unknown planner variant '{label}'; use <planner> or hybrid+pooled")
    return [f"planner={name}"] + (["planner.cold_only_exchange=false"] if variant else [])
