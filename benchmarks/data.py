"""`python -m benchmarks.data`: Criteo data-path speed, measured side by side in one run.

1. prepare: TSV text -> binary files, MB/s of text, with 1 and with N parse workers;
2. loader: samples/s of one process assembling torchrec `Batch`es (dense, KJT, labels) from
   the binary files, ours (`CriteoBinary`, memory-mapped) beside TorchRec's
   `InMemoryBinaryCriteoIterDataPipe` (mmap_mode) on the same files and batch size.
Files come from `recsys.data.synth` (Kaggle preset), so the text has real-format rough edges.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import benchmark_command, environment, finish, start
from recsys import CONF_DIR
from recsys.data.convert import ConvertOptions, convert
from recsys.data.synthetic_files import SynthConfig, synthesize

REPO = Path(__file__).resolve().parents[1]


@dataclass
class DataBenchConfig:
    rows: int = 1_000_000  # synthetic Kaggle-format rows
    batch_size: int = 4096
    epochs: int = 3  # loader passes over the train split (first one warms the page cache)
    workers: list[int] = field(default_factory=lambda: [1, 2])
    chunk_mb: float = 16.0
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(REPO / "benchmarks" / "results" / "data")


def _time_loader(batches, batch_size: int) -> tuple[float, int]:
    start, n = time.perf_counter(), 0
    for b in batches:
        n += b.labels.shape[0]
    assert n % batch_size == 0
    return n / (time.perf_counter() - start), n


def run(cfg: DataBenchConfig) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        synthesize(SynthConfig(output=str(work / "tsv"), rows=cfg.rows, scale=100))
        text_mb = sum(p.stat().st_size for p in (work / "tsv").iterdir()) / 1e6
        prepare = {}
        for w in cfg.workers:
            out = work / f"bin_{w}"
            start = time.perf_counter()
            convert(
                work / "tsv", out, ConvertOptions(workers=w, chunk_mb=cfg.chunk_mb, progress=False)
            )
            prepare[w] = text_mb / (time.perf_counter() - start)
        # imported here: prepare's spawned workers import this module, which stays torch-free
        # so that they start as `python -m recsys.data.prepare`'s do
        from recsys.data.criteo_binary import CriteoBinary

        binary = work / f"bin_{cfg.workers[0]}"
        rows = [10_000] * 26
        names = [f"cat_{i}" for i in range(26)]
        ours = CriteoBinary(binary, rows, names, cfg.batch_size, world_size=1)
        n = ours.num_batches("train")

        from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

        paths = [[str(binary / f"train_{k}.npy")] for k in ("dense", "sparse", "labels")]
        loader = {"ours": [], "torchrec": []}
        for _ in range(cfg.epochs):  # interleaved, so both see the same machine state
            loader["ours"].append(_time_loader(ours.batches("train", 0, n, 0), cfg.batch_size)[0])
            pipe = InMemoryBinaryCriteoIterDataPipe(
                "train",
                *paths,
                batch_size=cfg.batch_size,
                rank=0,
                world_size=1,
                mmap_mode=True,
                hashes=rows,
                drop_last=True,
            )
            loader["torchrec"].append(_time_loader(iter(pipe), cfg.batch_size)[0])
        best = {k: max(v) for k, v in loader.items()}
        return {
            "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
            "environment": environment(),
            "text_mb": text_mb,
            "prepare_mb_per_s": {str(w): v for w, v in prepare.items()},
            "prepare_speedup_workers": prepare[cfg.workers[-1]] / prepare[cfg.workers[0]],
            "loader_samples_per_s": best,
            "loader_samples_per_s_all_epochs": loader,
            "loader_vs_torchrec": best["ours"] / best["torchrec"],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(r: dict) -> str:
    env = r["environment"]
    lines = [
        f"# Criteo data path ({env['date']}, {env['cpus']} CPUs, torch {env['torch']}, "
        f"torchrec {env['torchrec']}, fbgemm_gpu {env['fbgemm_gpu']})",
        "",
        f"Synthetic Kaggle-format text: {r['config']['rows']:,} rows, {r['text_mb']:.0f} MB.",
        "",
        "| prepare workers | MB/s of text |",
        "|---|---|",
        *[f"| {w} | {v:.1f} |" for w, v in r["prepare_mb_per_s"].items()],
        "",
        f"Speedup with {r['config']['workers'][-1]} workers: {r['prepare_speedup_workers']:.2f}x",
        "",
        f"| loader (1 process, batch {r['config']['batch_size']}) | samples/s (best of "
        f"{r['config']['epochs']} epochs) |",
        "|---|---|",
        *[f"| {k} | {v:,.0f} |" for k, v in r["loader_samples_per_s"].items()],
        "",
        f"Ours vs TorchRec's InMemoryBinaryCriteoIterDataPipe: {r['loader_vs_torchrec']:.2f}x",
    ]
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_data", node=DataBenchConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_data")
@benchmark_command
def main(cfg: DictConfig) -> None:
    warnings.filterwarnings("ignore", message=".*non-writable tensors.*")  # TorchRec's reader
    typed: DataBenchConfig = start(cfg)
    result = run(typed)
    finish(result, table(result), "data", typed)


if __name__ == "__main__":
    main()
