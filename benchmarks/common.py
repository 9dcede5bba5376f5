"""What every benchmark saves beside its numbers: versions, machine, resolved config."""

from __future__ import annotations

import functools
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks import fingerprint
from recsys.console import command

REPO = Path(__file__).resolve().parents[1]


@dataclass
class BenchTrainer:
    """`trainer.max_steps=N` on a training benchmark's command line: shorter runs."""

    max_steps: int | None = None


# a nested label's options: the lookahead, key-centric clustering, dedup both ways or
# forward only (`pipeline.dedup_grads=false`)
NESTED_OPTIONS = ("lookahead", "cluster", "dedup", "dedup_fwd")


@dataclass(frozen=True)
class PipelineLabel:
    """A benchmark's pipeline label parsed: a pipeline's name, or `nested<N>` and options
    (`nested4+lookahead+cluster+dedup_fwd`)."""

    name: str  # "nested" for nested<N>
    micro_batches: int = 1
    options: frozenset[str] = frozenset()

    @property
    def dedup(self) -> bool:
        return bool({"dedup", "dedup_fwd"} & self.options)

    @property
    def dedup_grads(self) -> bool:
        return "dedup_fwd" not in self.options


def parse_label(label: str, allowed: tuple[str, ...] = NESTED_OPTIONS) -> PipelineLabel:
    """`label` parsed; only nested<N> takes options, those in `allowed`, one dedup at most."""
    name, *options = label.split("+")
    n = name[len("nested") :] if name.startswith("nested") else None
    wrong = set(options) - set(allowed) or {"dedup", "dedup_fwd"} <= set(options)
    if (n is None and options) or (n is not None and (not n.isdigit() or wrong)):
        forms = "".join(f"[+{o}]" for o in allowed if o != "dedup_fwd")
        raise ValueError(
            f"'{label}': only nested<N> takes options: nested<N>{forms} "
            f"(+dedup_fwd for +dedup: unique rows forward only, gradients "
            f"pooled), e.g. nested4+dedup"
        )
    if n is None:
        return PipelineLabel(name)
    return PipelineLabel("nested", int(n), frozenset(options))


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
    """Write `<json_name or name>.json`, `<name>.md` and the record of the code they measured
    (`benchmarks.fingerprint`, `code.json`) into each directory."""
    written = []
    code = json.dumps(fingerprint.record(name, taken=_CODE_AT_START.get("taken")), indent=1)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result, indent=2, default=_plain)
        (d / f"{json_name or name}.json").write_text(text + "\n")
        (d / f"{name}.md").write_text(table + "\n")
        (d / fingerprint.RECORD).write_text(code + "\n")
        written.append(d / f"{name}.md")
    return written


def _plain(value: Any) -> Any:
    """numpy scalars as plain numbers for JSON."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def benchmark_command(main: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A benchmark's Hydra main (under `@hydra.main`) as a command's body: a user's error is
    one line and exit 1, Ctrl-C or SIGTERM one line and exit 130 / 143, not a traceback
    (`recsys.console.command`)."""

    @functools.wraps(main)
    def body(cfg: Any) -> Any:
        with command(
            lambda: "the benchmark stopped; what it saved so far is in its run directory (outputs/)"
        ):
            return main(cfg)

    return body


# the code as it was when the benchmark started (`start`): what its results record
_CODE_AT_START: dict[str, dict] = {}


def start(cfg: Any) -> Any:
    """A benchmark app's typed config, with the libraries' routine warnings filtered; the
    code it runs is noted for its results' record (`benchmarks.fingerprint`)."""
    from omegaconf import OmegaConf

    from recsys.app.train import quiet_library_noise

    _CODE_AT_START["taken"] = fingerprint.snapshot()
    quiet_library_noise()
    return OmegaConf.to_object(cfg)


def results_dir_for(name: str, cluster: Any) -> str:
    """A benchmark's published results directory: benchmarks/results/<name>, or
    <name>_<preset> with `cluster=<preset>`, so a run on an emulated cluster never replaces
    the default link's results."""
    return str(REPO / "benchmarks" / "results" / (f"{name}_{cluster.name}" if cluster else name))


def output_dirs(cfg: Any) -> list[Path]:
    """Where a benchmark writes: its Hydra run directory, and the committed
    `cfg.results_dir` (benchmarks/results/<name>) only when `cfg.save` asks for it, so a
    user's run never silently replaces the published results."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    return [run_dir] + ([Path(cfg.results_dir)] if cfg.save else [])


def finish(
    result: dict,
    table: str,
    name: str,
    cfg: Any,
    json_name: str | None = None,
    picture: tuple[Callable[[dict, Path], None], str] | None = None,
) -> None:
    """Print the table; save it, the JSON and `picture` (a `benchmarks.plots` function and
    the file it draws) into `output_dirs(cfg)`."""
    print(table)
    written = save(result, table, name, output_dirs(cfg), json_name)
    if picture is not None:
        draw, file = picture
        try:  # the numbers are saved already; a picture that fails must not lose them
            for d in output_dirs(cfg):
                draw(json.loads(json.dumps(result, default=_plain)), d / file)
                written.append(d / file)
        except Exception as e:  # noqa: BLE001
            print(f"picture {file} not drawn: {type(e).__name__}: {e}")
    print("saved:", ", ".join(map(str, written)))
    if not cfg.save:
        print(f"(save=true also writes them to {cfg.results_dir}, the published results)")


def planner_overrides(label: str) -> list[str]:
    """`hybrid+pooled` -> hybrid with TorchRec's pooled exchange for split tables' cold
    parts; `hybrid+all_devices` -> hybrid on every device (it weighs no part of the cluster);
    `<planner>+2d<G>` -> its plan for 2D groups of G ranks; any other label is a planner
    name."""
    name, _, variant = label.partition("+")
    if variant == "all_devices":
        return [f"planner={name}", "planner.leave_out=false"]
    if variant == "pooled":
        return [f"planner={name}", "planner.cold_only_exchange=false"]
    if variant.startswith("2d") and variant[2:].isdigit():
        return [f"planner={name}", f"trainer.sharding_group_size={int(variant[2:])}"]
    if variant:
        raise ValueError(
            f"unknown planner variant '{label}'; use <planner>, hybrid+pooled, "
            f"hybrid+all_devices or <planner>+2d<G> (2D groups of G ranks)"
        )
    return [f"planner={name}"]


def emulated_preset(cluster: Any, bench: str) -> str | None:
    """The name of `cluster=<preset>` on a benchmark's command line (None: not given); a
    preset that is not emulated is refused: these benchmarks read its link's counters."""
    if cluster is None:
        return None
    if not cluster.emulation.enabled:
        raise SystemExit(
            f"benchmarks.{bench} cluster={cluster.name}: not an emulated cluster "
            f"(emulation.enabled); use emu_mixed4, emu_mixed3 or emu_2node"
        )
    return cluster.name


def train_emulated(
    cluster: str, overrides: list[str], steps: int, run_dir: Path
) -> tuple[int, dict]:
    """`recsys.train` on the emulated cluster `cluster` (root) for `steps` steps, as
    `netns.train_pair` runs it across a veth pair; returns the bytes that crossed between
    its nodes during the whole job and the run's summary."""
    import hydra

    from recsys.app.train import train

    args = [
        f"cluster={cluster}",
        *overrides,
        f"trainer.max_steps={steps}",
        "trainer.progress_bar=false",
        "dataset.eval_batches=1",
        "trainer.warmup_steps=5",
    ]
    summary = train(hydra.compose(config_name="config", overrides=args), run_dir)
    return summary["link_bytes"], summary
