"""`python -m benchmarks.movielens`: DLRM on MovieLens-100K (real ratings) against the
baselines a practitioner tries first, on the same held-out samples and the same features.

Converts the data if `data` holds none (`recsys.data.movielens`), trains
`dataset=movielens100k` on the 2 local ranks once per seed of `seeds` (validation AUC every
`eval_every` steps: the curve), evaluates each final checkpoint on the test split (the
latest ratings; `recsys.evaluate`'s path), and scores the very samples that evaluation read
with: the movie's click rate in the training split (smoothed towards the overall rate);
logistic regression on the one-hot ids and the dense features (every id of every table a
column, genres a bag of them: DLRM's own inputs); and gradient-boosted trees
(scikit-learn's HistGradientBoostingClassifier: the ids as categories, each table's 254 most
frequent in training kept, the rest one category). Each scorer is also scored on the test
samples whose user the training split holds (warm) and the rest (cold). Writes
movielens.json and movielens.md.
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
    overrides: list[str] = field(
        default_factory=lambda: ["trainer.batch_size=256", "trainer.max_steps=500"]
    )  # about 3 epochs
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # DLRM trained once each
    eval_every: int = 100
    prior: float = 10.0  # the baseline's smoothing: ratings' weight of the overall rate
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(REPO / "benchmarks" / "results" / "movielens100k")


def popularity_scores(
    source, movie_key: str, world: int, prior: float
) -> tuple[np.ndarray, np.ndarray]:
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
            out_scores.append(
                np.array(
                    [(clicks.get(m, 0) + prior * rate) / (seen.get(m, 0) + prior) for m in ids]
                )
            )
    return np.concatenate(out_labels), np.concatenate(out_scores)


def split_rows(source, split: str, world: int) -> tuple[np.ndarray, list, np.ndarray]:
    """Every rank's batches of `split`, in the order evaluation reads them: the dense
    features [N, D], each table's ids of each sample (a list per table of per-sample id
    arrays) and the labels [N]."""
    dense, ids, labels = [], [[] for _ in source.keys], []
    for rank in range(world):
        for batch in source.batches(split, 0, source.num_batches(split), rank):
            dense.append(batch.dense_features.numpy())
            labels.append(batch.labels.numpy())
            for t, key in enumerate(source.keys):
                jt = batch.sparse_features[key]
                ids[t] += np.split(jt.values().numpy(), np.cumsum(jt.lengths().numpy())[:-1])
    return np.concatenate(dense), ids, np.concatenate(labels)


def one_hot(dense: np.ndarray, ids: list, sizes: list[int]):
    """DLRM's inputs as logistic regression takes them: a column per row of every table (a
    sample's bag sets each of its ids), then the dense features."""
    from scipy import sparse

    offsets = np.cumsum([0, *sizes])
    rows, cols = [], []
    for t, per_sample in enumerate(ids):
        for i, bag in enumerate(per_sample):
            rows += [i] * len(bag)
            cols += (offsets[t] + bag).tolist()
    hot = sparse.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(dense), offsets[-1]))
    return sparse.hstack([hot, sparse.csr_matrix(dense)]).tocsr()


def tree_features(dense: np.ndarray, ids: list, keep: list[np.ndarray]) -> np.ndarray:
    """Gradient-boosted trees' inputs: per one-id table its id as a category among the
    `keep` (its 254 most frequent in training; the rest share category 254), per bag table
    a 0/1 column for each kept id, then the dense features."""
    columns = []
    for per_sample, kept in zip(ids, keep, strict=True):
        lookup = {int(v): j for j, v in enumerate(kept)}
        if max(len(b) for b in per_sample) <= 1:
            columns.append([[lookup.get(int(b[0]), 254) if len(b) else 254] for b in per_sample])
        else:
            bags = np.zeros((len(per_sample), len(kept)))
            for i, b in enumerate(per_sample):
                bags[i, [lookup[int(v)] for v in b if int(v) in lookup]] = 1
            columns.append(bags)
    return np.hstack([np.asarray(c, float) for c in columns] + [dense])


def _kept_ids(per_sample: list) -> np.ndarray:
    values, counts = np.unique(np.concatenate(per_sample), return_counts=True)
    return values[np.argsort(-counts, kind="stable")][:254]


def baselines(source, world: int, sizes: list[int], seed: int) -> dict[str, np.ndarray]:
    """Test-sample scores of logistic regression and gradient-boosted trees, each fitted on
    the training split's samples (`seed`: the trees' random state)."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression

    dense, ids, labels = split_rows(source, "train", world)
    test_dense, test_ids, _ = split_rows(source, "test", world)
    lr = LogisticRegression(max_iter=2000).fit(one_hot(dense, ids, sizes), labels)
    keep = [_kept_ids(per_sample) for per_sample in ids]
    x = tree_features(dense, ids, keep)
    categorical = [max(len(b) for b in per) <= 1 for per in ids]
    mask = [c for c, k in zip(categorical, keep, strict=True) for _ in (range(1) if c else k)]
    mask += [False] * dense.shape[1]
    gbdt = HistGradientBoostingClassifier(
        categorical_features=np.asarray(mask), random_state=seed
    ).fit(x, labels)
    return {
        "logistic regression": lr.predict_proba(one_hot(test_dense, test_ids, sizes))[:, 1],
        "gradient-boosted trees": gbdt.predict_proba(tree_features(test_dense, test_ids, keep))[
            :, 1
        ],
    }


def _dlrm_scores(checkpoint: str, source, world: int, tmp: Path) -> np.ndarray:
    """The trained model's score of every test sample, in evaluation's order (exported: one
    process, the same weights)."""
    from recsys.export import export_checkpoint, load_exported, score_batches

    export_checkpoint(checkpoint, tmp / "export")
    model, _ = load_exported(tmp / "export")
    model.eval()
    batches = (
        b for r in range(world) for b in source.batches("test", 0, source.num_batches("test"), r)
    )
    return score_batches(model, batches)[0]


def run(cfg: MovieLensBenchConfig) -> dict:
    from recsys.app.train import to_typed, train
    from recsys.data.movielens import MovieLensConfig, prepare_movielens
    from recsys.data.source import build_source
    from recsys.export import binary_metrics

    data = Path(cfg.data)
    if not (data / "summary.json").exists():
        prepare_movielens(MovieLensConfig(output=str(data), progress=False))
    common = [
        "dataset=movielens100k",
        f"dataset.path={data}",
        *cfg.overrides,
        "trainer.progress_bar=false",
    ]
    typed = to_typed(hydra.compose(config_name="config", overrides=common))
    runs, scores = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in cfg.seeds:
            seeded = [*common, f"trainer.seed={seed}"]
            trained = train(
                hydra.compose(
                    config_name="config",
                    overrides=[
                        *seeded,
                        f"trainer.eval_every={cfg.eval_every}",
                        "trainer.save_checkpoint=true",
                    ],
                ),
                Path(tmp) / f"train{seed}",
            )
            test = train(
                hydra.compose(
                    config_name="config",
                    overrides=[
                        *seeded,
                        "trainer.mode=evaluate",
                        f"trainer.resume_from={trained['checkpoint']}",
                        "dataset.eval_split=test",
                    ],
                ),
                Path(tmp) / f"test{seed}",
            )
            runs.append((seed, trained, test))
        world = runs[0][1]["world_size"]
        source = build_source(typed.dataset, typed.model, typed.trainer.batch_size, world)
        for seed, trained, _ in runs:
            scores[f"DLRM, seed {seed}"] = _dlrm_scores(
                trained["checkpoint"], source, world, Path(tmp) / f"s{seed}"
            )
    labels, popular = popularity_scores(source, "cat_1", world, cfg.prior)  # cat_1: movie_id
    assert len(labels) == runs[0][2]["eval_samples"], "every scorer scores the same samples"
    scores["movie popularity"] = popular
    scores |= baselines(source, world, list(typed.model.num_embeddings_per_feature), cfg.seeds[0])
    _, train_ids, _ = split_rows(source, "train", world)
    _, test_ids, _ = split_rows(source, "test", world)
    seen = {int(b[0]) for b in train_ids[0]}  # cat_0: user_id
    warm = np.array([int(b[0]) in seen for b in test_ids[0]])
    metrics = {
        name: {
            "all": binary_metrics(s.astype(np.float32), labels.astype(np.float32)),
            "warm_users": binary_metrics(
                s[warm].astype(np.float32), labels[warm].astype(np.float32)
            ),
            "cold_users": binary_metrics(
                s[~warm].astype(np.float32), labels[~warm].astype(np.float32)
            ),
        }
        for name, s in scores.items()
    }
    seed0, trained, test = runs[0]
    dlrm_aucs = [t["eval_auc"] for _, _, t in runs]
    curve = [{"step": e["step"], "val_auc": e["eval_auc"]} for e in trained.get("evals", [])]
    return {
        "model": typed.model.name,
        "steps": trained["steps"],
        "val": {"auc": trained["eval_auc"], "ne": trained["eval_ne"]},
        "val_curve": curve + [{"step": trained["steps"], "val_auc": trained["eval_auc"]}],
        "test": {
            "auc": test["eval_auc"],
            "logloss": test["eval_logloss"],
            "ne": test["eval_ne"],
            "samples": test["eval_samples"],
            "seed": seed0,
        },
        "dlrm_test_auc_over_seeds": {
            "seeds": list(cfg.seeds),
            "auc": dlrm_aucs,
            "median": float(np.median(dlrm_aucs)),
            "range": [min(dlrm_aucs), max(dlrm_aucs)],
        },
        "popularity_baseline_test": {
            **metrics["movie popularity"]["all"],
            "samples": int(len(labels)),
            "prior": cfg.prior,
        },
        "logistic_regression_test": metrics["logistic regression"]["all"],
        "gbdt_test": metrics["gradient-boosted trees"]["all"],
        "by_scorer": metrics,
        "warm_user_share": float(warm.mean()),
        "test_click_rate": float(labels.mean()),
        "samples_per_s": trained["samples_per_s"],
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        "environment": environment(),
    }


def table(r: dict) -> str:
    t, d = r["test"], r["dlrm_test_auc_over_seeds"]
    lines = [
        f"MovieLens-100K, {r['model']}, {r['steps']} steps on 2 ranks; the test split: the "
        f"latest {t['samples']:,} ratings (click rate {r['test_click_rate']:.3f}), "
        f"{r['warm_user_share']:.0%} of them by users the training split holds (warm)",
        "",
        f"DLRM test AUC over seeds {d['seeds']}: median {d['median']:.4f}, range "
        f"{d['range'][0]:.4f}-{d['range'][1]:.4f} (the trees and logistic regression are "
        f"deterministic here)",
        "",
        "| scorer | test AUC | test log loss | test NE | AUC, warm users | AUC, cold users |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in r["by_scorer"].items():
        a, w, c = m["all"], m["warm_users"], m["cold_users"]
        lines.append(
            f"| {name} | {a['auc']:.4f} | {a['logloss']:.4f} | {a['ne']:.4f} | "
            f"{w['auc']:.4f} | {c['auc']:.4f} |"
        )
    lines += [
        "",
        "Validation AUC by step (seed "
        + str(t["seed"])
        + "): "
        + ", ".join(f"{c['step']}: {c['val_auc']:.4f}" for c in r["val_curve"]),
    ]
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
