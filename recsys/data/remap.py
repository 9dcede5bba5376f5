"""`python -m recsys.data.remap input=<prepared dir> output=<dir> threshold=T [max_ind_range=M]`

The optional steps after `prepare`, as TorchRec's and MLPerf's pipelines do them:
- modulo: raw hex values % `max_ind_range` (MLPerf's 40M cap), when it is > 0;
- frequency threshold: ids seen fewer than `threshold` times in the training files share
  row 0; the others get contiguous rows 1..K in id order (K + 1 rows per table).
Writes (whole or not at all, as `prepare` does; `overwrite=true` replaces a non-empty
output) remapped `<name>_sparse.npy` files (dense and labels are linked, or copied where
links are impossible), `remap.json` with the new `num_embeddings_per_feature`, and
`model_override.txt`: the override that gives the model those tables
(`model.num_embeddings_per_feature=[...]`), which the command also prints. Memory: the
distinct ids per feature (16 bytes each), never the whole file.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from recsys import CONF_DIR
from recsys.data.atomic import atomic_dir, check_not_input, run_cli
from recsys.data.criteo_tsv import CAT_FEATURES
from recsys.data.npy_io import NpyAppender
from recsys.data.prepared import CriteoDataError, prepared_names
from recsys.progress import Progress

BLOCK_ROWS = 1 << 20


@dataclass
class RemapConfig:
    input: str = MISSING  # a directory written by recsys.data.prepare
    output: str = MISSING
    threshold: int = 1  # ids seen fewer times share row 0; 1 keeps every id seen
    max_ind_range: int = 0  # > 0: values % max_ind_range first
    progress: bool = True
    overwrite: bool = False  # replace a non-empty output directory whole


def _merge_counts(acc: tuple[np.ndarray, np.ndarray], values: np.ndarray):
    ids, counts = np.unique(values, return_counts=True)
    all_ids = np.concatenate([acc[0], ids])
    all_counts = np.concatenate([acc[1], counts])
    merged, inverse = np.unique(all_ids, return_inverse=True)
    summed = np.zeros(len(merged), dtype=np.int64)
    np.add.at(summed, inverse, all_counts)
    return merged, summed


def count_ids(arrays: list[np.ndarray], max_ind_range: int, progress: bool):
    """Per feature: (sorted distinct ids, their counts) over all rows of `arrays`."""
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    acc = [empty] * CAT_FEATURES
    total = sum(-(-len(a) // BLOCK_ROWS) for a in arrays)
    with Progress(total, desc="count ids", unit="blocks", enabled=progress) as bar:
        for arr in arrays:
            for i in range(0, len(arr), BLOCK_ROWS):
                block = np.asarray(arr[i : i + BLOCK_ROWS])
                if max_ind_range > 0:
                    block = block % max_ind_range
                acc = [_merge_counts(acc[c], block[:, c]) for c in range(CAT_FEATURES)]
                bar.update(1)
    return acc


def _new_ids(kept: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Row k + 1 for values equal to kept[k] (kept is sorted), row 0 for the rest."""
    if len(kept) == 0:
        return np.zeros_like(values)
    pos = np.searchsorted(kept, values)
    hit = kept[np.minimum(pos, len(kept) - 1)] == values
    return np.where(hit, pos + 1, 0)


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def remap(cfg: RemapConfig) -> dict:
    if cfg.threshold < 1:
        raise CriteoDataError(f"remap: threshold must be >= 1, got {cfg.threshold}")
    src, out = Path(cfg.input), Path(cfg.output)
    check_not_input(out, [src])  # before reading: input files are kept
    train_names = prepared_names(src)  # the files that train; Kaggle's test.txt is not one
    with atomic_dir(out, cfg.overwrite, inputs=[src]) as tmp:
        return _remap(cfg, src, tmp, train_names)


def _remap(cfg: RemapConfig, src: Path, out: Path, train_names: list[str]) -> dict:
    train_names = train_names[:-1] if len(train_names) > 1 else train_names  # not the held-out day
    sparse = {n: np.load(src / f"{n}_sparse.npy", mmap_mode="r") for n in _all_names(src)}
    counts = count_ids([sparse[n] for n in train_names], cfg.max_ind_range, cfg.progress)
    kept = [ids[c >= cfg.threshold] for ids, c in counts]  # sorted: row k+1 for kept[k]
    for name, arr in sparse.items():
        with NpyAppender(out / f"{name}_sparse.npy", np.int64, CAT_FEATURES) as w:
            for i in range(0, len(arr), BLOCK_ROWS):
                block = np.asarray(arr[i : i + BLOCK_ROWS])
                if cfg.max_ind_range > 0:
                    block = block % cfg.max_ind_range
                w.append(np.stack([_new_ids(kept[c], block[:, c]) for c in range(CAT_FEATURES)], 1))
        for kind in ("dense", "labels"):
            _link_or_copy(src / f"{name}_{kind}.npy", out / f"{name}_{kind}.npy")
    result = {
        "threshold": cfg.threshold,
        "max_ind_range": cfg.max_ind_range,
        "counted_files": train_names,
        "num_embeddings_per_feature": [len(k) + 1 for k in kept],
        "distinct_ids_per_feature": [len(ids) for ids, _ in counts],
    }
    sizes = ",".join(str(n) for n in result["num_embeddings_per_feature"])
    result["model_override"] = f"model.num_embeddings_per_feature=[{sizes}]"
    (out / "remap.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "model_override.txt").write_text(result["model_override"] + "\n")
    return result


def _all_names(root: Path) -> list[str]:
    return sorted(p.name[: -len("_sparse.npy")] for p in root.glob("*_sparse.npy"))


ConfigStore.instance().store(name="base_remap", node=RemapConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="remap")
def main(cfg: DictConfig) -> None:
    run_cli(
        lambda: remap(OmegaConf.to_object(cfg)),
        lambda r: (
            f"tables: {r['num_embeddings_per_feature']} -> {cfg.output}/remap.json\n"
            f"train on it with: dataset.path={cfg.output} {r['model_override']} "
            f"(also in {cfg.output}/model_override.txt)"
        ),
    )


if __name__ == "__main__":
    main()
