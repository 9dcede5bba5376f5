"""`python -m benchmarks.dense_reduce`: the dense gradients' reduction over ranks, measured
side by side: `trainer.dense_allreduce=buckets` (the default: fixed buckets every pipeline
shares, `pipelines/dense_reduce.py`), `per_tensor` (a bucket per gradient) and
`ddp_buckets` (TorchRec's DDP), each with the plain loop and TorchRec's SparseDist, on 2
ranks over loopback, each pinned to a core of its own (`cluster=local_cpu2_pinned`: two
unpinned ranks sometimes share a core, which spreads the runs of one setting wider), for
each model; the runs interleaved `repeats` times, the reductions' order rotated each time
(the run after another can be faster or slower by more than the difference measured), the
best and the median samples/s of each kept. A reduction named with `@glibc`
(`buckets@glibc`) runs with glibc's default malloc (`trainer.retain_host_memory=false`,
`recsys/host_memory.py`), to measure what keeping the host memory is worth."""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import benchmark_command, environment, finish, start
from recsys import CONF_DIR
from recsys.config import register_configs

REPO = Path(__file__).resolve().parents[1]
BASELINE = "ddp_buckets"


@dataclass
class DenseReduceBenchConfig:
    reductions: list[str] = field(
        default_factory=lambda: [
            "ddp_buckets",
            "buckets",
            "per_tensor",
            "ddp_buckets@glibc",
            "buckets@glibc",
        ]
    )
    pipelines: list[str] = field(default_factory=lambda: ["plain", "sparse_dist"])
    models: list[str] = field(default_factory=lambda: ["dlrm_small", "dcnv2_small"])
    cluster: str = "local_cpu2_pinned"
    overrides: list[str] = field(default_factory=lambda: ["trainer.batch_size=2048"])
    steps: int = 60
    repeats: int = 4
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(REPO / "benchmarks" / "results" / "dense_reduce")


def run(cfg: DenseReduceBenchConfig) -> dict:
    from recsys.app.train import train

    for r in cfg.reductions:
        if r.partition("@")[2] not in ("", "glibc"):
            raise ValueError(f"reductions: '{r}' is neither <reduction> nor <reduction>@glibc")
    keys = [(m, p, r) for m in cfg.models for p in cfg.pipelines for r in cfg.reductions]
    runs: dict[str, list[float]] = {"/".join(k): [] for k in keys}
    losses: dict[str, list[float]] = {}
    faults: dict[str, list[float]] = {"/".join(k): [] for k in keys}  # rank 0's, per step
    n = len(cfg.reductions)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(cfg.repeats):
            order = [keys[i - i % n + (i + rep) % n] for i in range(len(keys))]  # rotated
            for model, pipeline, reduction in order:
                name = f"{model}/{pipeline}/{reduction}"
                mode, _, malloc = reduction.partition("@")
                overrides = [
                    f"model={model}",
                    f"pipeline={pipeline}",
                    f"cluster={cfg.cluster}",
                    f"trainer.dense_allreduce={mode}",
                    *cfg.overrides,
                    f"trainer.retain_host_memory={not malloc}",
                    f"trainer.max_steps={cfg.steps}",
                    "trainer.progress_bar=false",
                    "trainer.warmup_steps=5",
                    "dataset.eval_batches=1",
                ]
                s = train(
                    hydra.compose(config_name="config", overrides=overrides),
                    Path(tmp) / f"{name.replace('/', '_')}_{rep}",
                )
                runs[name].append(s["samples_per_s"])
                faults[name].append(s["host_page_faults_per_step"])
                losses[name] = s["step_losses"]
                print(name, rep, f"{s['samples_per_s']:,.0f} samples/s", flush=True)
    best = {k: max(v) for k, v in runs.items()}
    median = {k: statistics.median(v) for k, v in runs.items()}
    base = lambda k: k.rsplit("/", 1)[0] + "/" + BASELINE  # noqa: E731
    vs = {k: v / best[base(k)] for k, v in best.items() if BASELINE in cfg.reductions}
    vs_median = {k: v / median[base(k)] for k, v in median.items() if BASELINE in cfg.reductions}
    same = {
        k: losses[k] == losses[k.rsplit("/", 1)[0] + "/" + BASELINE]
        for k in losses
        if BASELINE in cfg.reductions
    }
    return {
        "runs": runs,
        "best_samples_per_s": best,
        "vs_ddp_buckets": vs,
        "median_vs_ddp_buckets": vs_median,
        "page_faults_per_step": faults,
        "median_page_faults_per_step": {k: statistics.median(v) for k, v in faults.items()},
        "losses_equal_ddp_buckets": same,
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        "environment": environment(),
    }


def table(r: dict) -> str:
    env, c = r["environment"], r["config"]
    lines = [
        f"# Dense reduction on 2 ranks over loopback ({c.get('cluster', 'local_cpu2')}, "
        f"{env['date']}, torch {env['torch']}, "
        f"torchrec {env['torchrec']}, fbgemm-gpu {env['fbgemm_gpu']}; "
        f"{' '.join(c['overrides'])}, {c['steps']} steps, best of {c['repeats']})",
        "",
        "| model | pipeline | dense_allreduce | samples/s | vs ddp_buckets | median vs "
        "ddp_buckets' median | rank 0's page faults / step (median) | losses equal "
        "ddp_buckets' |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, v in r["best_samples_per_s"].items():
        model, pipeline, reduction = k.split("/")
        ratio = r["vs_ddp_buckets"].get(k)
        mid = r.get("median_vs_ddp_buckets", {}).get(k)
        same = r["losses_equal_ddp_buckets"].get(k)
        lines.append(
            f"| {model} | {pipeline} | {reduction} | {v:,.0f} | "
            f"{'-' if ratio is None else f'{ratio:.3f}x'} | "
            f"{'-' if mid is None else f'{mid:.3f}x'} | "
            f"{_median_faults(r, k)} | "
            f"{'-' if same is None else ('yes' if same else 'no')} |"
        )
    return "\n".join(lines)


def _median_faults(r: dict, key: str) -> str:
    f = r.get("median_page_faults_per_step", {}).get(key)
    return "-" if f is None else f"{f:,.0f}"


register_configs()
ConfigStore.instance().store(name="base_bench_dense_reduce", node=DenseReduceBenchConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_dense_reduce")
@benchmark_command
def main(cfg: DictConfig) -> None:
    typed: DenseReduceBenchConfig = start(cfg)
    result = run(typed)
    finish(result, table(result), "dense_reduce", typed)


if __name__ == "__main__":
    from recsys.launch import serve_forks_from_here

    serve_forks_from_here()  # its ranks start from the stack this process imported
    main()
