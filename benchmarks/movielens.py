"""`python -m benchmarks.movielens`: DLRM on MovieLens-100K (real ratings) against a
popularity baseline, on the same held-out samples.

Converts the data if `data` holds none (`recsys.data.movielens`), trains
`dataset=movielens100k` on the 2 local ranks (validation AUC every `eval_every` steps:
the curve), evaluates the final checkpoint on the test split (the latest ratings;
`recsys.evaluate`'s path), and scores the very samples that evaluation read with the
movie's click rate in the training split (smoothed towards the overall rate): the
baseline a recommender must beat. Writes movielens.json and movielens.md.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import benchmark_command, environment, finish, start
from recsys import CONF_DIR
from recsys.config import register_configs

REPO = Path(__file__).resolve().parents[1]


@dataclass
class MovieLensBenchConfig:
    data: str = "outputs/data/movielens100k"  # converted here first if it holds nothing
    overrides: list[str] = field(default_factory=lambda: [
        "trainer.batch_size=256", "trainer.max_steps=500"])  # fmt: skip  # about 3 epochs
    eval_every: int = 100
    prior: float = 10.0  # the baseline's smoothing: ratings' weight of the overall rate
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(REPO / "benchmarks" / "results" / "movielens100k")


def popularity_scores(source, movie_key: str, world: int, prior: float
                      ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Labels and baseline scores of every rank's test batches (the samples evaluation
    reads), each the movie's smoothed click rate over the training split's rows."""
    clicks, seen = {}, {}
    lo, hi = source.split_range("train")
    labels = np.concatenate([lab[:, 0] for lab in source.labels])[lo:hi]
    col = source.keys.index(movie_key)
    movies = np.concatenate([s[:, col] for s in source.sparse])[lo:hi]
    for m, y in zip(movies.tolist(), labels.tolist(), strict=True):
        clicks[m] = clicks.get(m, 0) + y
        seen[m] = seen.get(m, 0) + 1
    rate = float(labels.mean())
    out_labels, out_scores = [], []
    for rank in range(world):
        for batch in source.batches("test", 0, source.num_batches("test"), rank):
            ids = batch.sparse_features[movie_key].values().tolist()
            out_labels.append(batch.labels.numpy())
            out_scores.append(np.array([(clicks.get(m, 0) + prior * rate)
                                        / (seen.get(m, 0) + prior) for m in ids]))  # fmt: skip
    return np.concatenate(out_labels), np.concatenate(out_scores)


def run(cfg: MovieLensBenchConfig) -> dict:
    from recsys.app.train import to_typed, train
    from recsys.data.movielens import MovieLensConfig, prepare_movielens
    from recsys.data.source import build_source
    from recsys.export import binary_metrics

    data = Path(cfg.data)
    if not (data / "summary.json").exists():
        prepare_movielens(MovieLensConfig(output=str(data), progress=False))
    common = ["dataset=movielens100k", f"dataset.path={data}", *cfg.overrides,
              "trainer.progress_bar=false"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        trained = train(hydra.compose(config_name="config", overrides=[
            *common, f"trainer.eval_every={cfg.eval_every}",
            "trainer.save_checkpoint=true"]), Path(tmp) / "train")  # fmt: skip
        test = train(hydra.compose(config_name="config", overrides=[
            *common, "trainer.mode=evaluate", f"trainer.resume_from={trained['checkpoint']}",
            "dataset.eval_split=test"]), Path(tmp) / "test")  # fmt: skip
    typed = to_typed(hydra.compose(config_name="config", overrides=common))
    world = trained["world_size"]
    source = build_source(typed.dataset, typed.model, typed.trainer.batch_size, world)
    labels, scores = popularity_scores(source, "cat_1", world, cfg.prior)  # cat_1: movie_id
    baseline = binary_metrics(scores.astype(np.float32), labels.astype(np.float32))
    assert len(labels) == test["eval_samples"], "the baseline must score the same samples"
    curve = [{"step": e["step"], "val_auc": e["eval_auc"]} for e in trained.get("evals", [])]
    return {
        "model": typed.model.name,
        "steps": trained["steps"],
        "val": {"auc": trained["eval_auc"], "ne": trained["eval_ne"]},
        "val_curve": curve + [{"step": trained["steps"], "val_auc": trained["eval_auc"]}],
        "test": {"auc": test["eval_auc"], "logloss": test["eval_logloss"],
                 "ne": test["eval_ne"], "samples": test["eval_samples"]},
        "popularity_baseline_test": {**baseline, "samples": int(len(labels)),
                                     "prior": cfg.prior},
        "test_click_rate": float(labels.mean()),
        "samples_per_s": trained["samples_per_s"],
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        "environment": environment(),
    }  # fmt: skip


def table(r: dict) -> str:
    t, b = r["test"], r["popularity_baseline_test"]
    lines = [
        f"MovieLens-100K, {r['model']}, {r['steps']} steps on 2 ranks; the test split: the "
        f"latest {t['samples']:,} ratings (click rate {r['test_click_rate']:.3f})",
        "",
        "| scorer | test AUC | test log loss | test NE |",
        "|---|---|---|---|",
        f"| DLRM | {t['auc']:.4f} | {t['logloss']:.4f} | {t['ne']:.4f} |",
        f"| movie popularity (train click rate) | {b['auc']:.4f} | {b['logloss']:.4f} | "
        f"{b['ne']:.4f} |",
        "",
        "Validation AUC by step: " + ", ".join(f"{c['step']}: {c['val_auc']:.4f}"
                                               for c in r["val_curve"]),
    ]  # fmt: skip
    return "\n".join(lines)


register_configs()
ConfigStore.instance().store(name="base_bench_movielens", node=MovieLensBenchConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_movielens")
@benchmark_command
def main(cfg: DictConfig) -> None:
    typed: MovieLensBenchConfig = start(cfg)
    result = run(typed)
    finish(result, table(result), "movielens", typed)


if __name__ == "__main__":
    from recsys.launch import serve_forks_from_here

    serve_forks_from_here()  # its ranks start from the stack this process imported
    main()
