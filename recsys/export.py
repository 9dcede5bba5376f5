"""Export a checkpoint as one unsharded model; score samples with it.

`python -m recsys.export checkpoint=<checkpoint or run dir> output=<new dir>` reads a DCP
checkpoint that `recsys.train` saved (any plan, any world size) in one process, without a
process group or TorchRec's sharding, and writes:
- `model.pt`: the plain `state_dict` of the unsharded model (`recsys.models.dlrm.build_model`
  with no split: one `t_cat_<i>` table per feature, all rows, fp32 whatever the tables were
  trained in), saved with `torch.save`, so `torch.load(..., weights_only=True)` reads it;
- `export.json`: the model config that builds it, the checkpoint and step, the dataset it
  was trained on and that data's prepare settings (the dense transform a text file to score
  must go through), the versions.
Split tables (hybrid's hot rows and cold parts, `recsys.models.split`) are merged back into
whole tables with the hot ids the checkpoint's split.npz holds, so the exported model
computes what the sharded one does: the same scores within float rounding.

`python -m recsys.score export=<export dir> input=<prepared dir | Criteo text> output=<file>`
scores every sample of the input with the exported model on this process: a prepared
directory (every `<name>_dense.npy` in it, in name order), or Criteo TSV text (a file or a
directory, prepared first into a temporary directory with the training data's dense
settings), or for a model trained on `recsys.data.tabular` output, CSV/TSV/parquet files,
converted with its schema and vocabularies (copied into the export: `schema.json`,
`vocab/`; values the vocabulary never saw go to row 0). It writes `score` (the click
probability) and `label` per sample, as CSV or `.npy` (a [N, 2] float32 array: label,
score; label -1 where the input has none) by the output's suffix, and prints AUC, log loss
and NE where the input has labels.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from recsys import CONF_DIR
from recsys.checkpoint import (
    checkpoint_step,
    no_model_message,
    saved_run,
    saved_split,
    verified_checkpoint,
)
from recsys.config import ModelConfig, TableDtype
from recsys.data.atomic import atomic_dir, check_not_input, run_cli
from recsys.data.multi_hot import SCHEMA_FILE, variable_bags
from recsys.data.tabular import SUFFIXES as TABLE_SUFFIXES
from recsys.data.tabular import VOCAB_DIR
from sharding.errors import UserError

FORMAT = "recsys.export/1"
MODEL_FILE, META_FILE = "model.pt", "export.json"
_BAGS = "model.sparse_arch.embedding_bag_collection.embedding_bags."
_SEQUENCES = "model.sparse_arch.embedding_collection.embeddings."


class ExportError(UserError, ValueError):
    """A checkpoint that cannot be exported, or an export or input that cannot be scored."""


@dataclass
class ExportConfig:
    checkpoint: str = MISSING  # a step_* checkpoint, or a directory of them (the newest)
    output: str = MISSING  # a new directory: model.pt and export.json
    overwrite: bool = False  # replace a non-empty output directory whole


@dataclass
class ScoreConfig:
    export: str = MISSING  # a directory recsys.export wrote
    input: str = MISSING  # a prepared directory, or Criteo TSV text (file or directory)
    output: str = MISSING  # scores: <file>.csv (label,score) or <file>.npy ([N, 2] float32)
    batch_size: int = 8192
    overwrite: bool = False  # replace an existing output file
    progress: bool = True


def model_config_of(saved: dict) -> ModelConfig:
    """A ModelConfig from its saved dict (run.json, export.json)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))


def unsharded_model(cfg: ModelConfig) -> torch.nn.Module:
    """The train module (`DLRMTrain`) of `cfg` on this process's CPU, every table whole, in
    eval mode; its parameters uninitialised (load a state_dict into it)."""
    from recsys.models.dlrm import build_model

    model = build_model(cfg, dense_device=torch.device("cpu"))
    # the tables only: to_empty on the whole would also wipe buffers no state_dict restores
    # (the interaction's triu_indices)
    model.model.sparse_arch.to_empty(device="cpu")
    return model.eval()


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP checkpoint, whole, read on this one process; keys as
    the unsharded train module names them (the checkpoint's without its leading 'model.')."""
    reader = dcp.FileSystemReader(str(path))
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader)  # no process group: one process, every shard
    return {k[len("model.") :]: v for k, v in state.items()}


def _merged_tables(tensors: dict[str, torch.Tensor], cfg: ModelConfig, path: Path) -> None:
    """Replace each split table's parts in `tensors` by the whole table (in place)."""
    from recsys.models.dlrm import table_configs
    from recsys.models.split import HOT, merge_weights
    from sharding.row_parts import cold_suffixes

    split = saved_split(path)
    if split is None:
        return
    hot_ids, parts = split
    for t in table_configs(cfg):
        (feature,) = t.feature_names
        if feature not in hot_ids:
            continue
        names = ([t.name + HOT] if len(hot_ids[feature]) else []) + [
            t.name + s for s in cold_suffixes(parts.get(feature, 1))
        ]
        found = {}
        for name in names:
            key = next(
                (
                    p + name + ".weight"
                    for p in (_BAGS, _SEQUENCES)
                    if p + name + ".weight" in tensors
                ),
                None,
            )
            if key is None:
                raise ExportError(
                    f"checkpoint '{path}' has no part {name} of split table "
                    f"{t.name}: incomplete, or not from recsys.train"
                )
            found[name] = tensors.pop(key)
        hot = found.pop(t.name + HOT, None)
        whole = merge_weights(
            hot, torch.from_numpy(hot_ids[feature]), list(found.values()), t.num_embeddings
        )
        tensors[_BAGS + t.name + ".weight"] = whole


def _prepare_settings(dataset: dict | None) -> dict | None:
    """The prepare summary's dense settings and hotness of the training data, if it has one."""
    path = (dataset or {}).get("path")
    summary = Path(path) / "summary.json" if path else None
    if summary is None or not summary.exists():
        return None
    s = json.loads(summary.read_text())
    return {
        "dense": s.get("dense"),
        "hotness": s.get("hotness"),
        "remapped": (Path(path) / "remap.json").exists(),
    }


def export_checkpoint(checkpoint: str | Path, output: str | Path, overwrite: bool = False) -> dict:
    """Write `output`/model.pt and export.json (module docstring); returns export.json."""
    path = verified_checkpoint(checkpoint, key="checkpoint")
    run = saved_run(path)
    if run is None or "model" not in run:
        raise ExportError(no_model_message(path))
    trained = model_config_of(run["model"])
    cfg = model_config_of({**run["model"], "table_dtype": TableDtype.fp32.value})
    tensors = _checkpoint_tensors(path)
    _merged_tables(tensors, cfg, path)
    model = unsharded_model(cfg)
    tensors = {k: v.float() if k.startswith(_BAGS) else v for k, v in tensors.items()}
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ExportError(
            f"checkpoint '{path}' does not hold model '{cfg.name}' as its run.json "
            f"says: {str(e).splitlines()[0][:300]}"
        ) from None
    from recsys.trainer.outputs import versions

    meta = {
        "format": FORMAT,
        "model": json.loads(json.dumps(asdict(cfg), default=str)),
        "trained_table_dtype": TableDtype(trained.table_dtype).value,
        "checkpoint": str(path.resolve()),
        "step": checkpoint_step(path),
        "dataset": run.get("dataset"),
        "prepared": _prepare_settings(run.get("dataset")),
        "versions": versions(),
    }
    data = Path((run.get("dataset") or {}).get("path") or "")
    with atomic_dir(output, overwrite, inputs=[path]) as out:
        torch.save(model.state_dict(), out / MODEL_FILE)
        (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        if (data / SCHEMA_FILE).exists():  # own data: how to convert new files for scoring
            shutil.copy(data / SCHEMA_FILE, out / SCHEMA_FILE)
            if (data / VOCAB_DIR).is_dir():
                shutil.copytree(data / VOCAB_DIR, out / VOCAB_DIR)
    return meta


def load_exported(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """The exported train module (eval mode) and its export.json."""
    root = Path(path)
    if not (root / META_FILE).exists() or not (root / MODEL_FILE).exists():
        raise ExportError(
            f"'{root}' is not an exported model (model.pt and export.json): "
            f"make one with `python -m recsys.export checkpoint=<checkpoint> "
            f"output={root}`"
        )
    meta = json.loads((root / META_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ExportError(
            f"'{root / META_FILE}' is format {meta.get('format')!r}, this "
            f"version reads {FORMAT!r}: export the checkpoint again"
        )
    model = unsharded_model(model_config_of(meta["model"]))
    model.load_state_dict(torch.load(root / MODEL_FILE, weights_only=True, map_location="cpu"))
    return model, meta


def score_batches(model: torch.nn.Module, batches) -> tuple[np.ndarray, np.ndarray]:
    """Click probabilities and labels of every sample of `batches`, in order."""
    scores, labels = [], []
    with torch.no_grad():
        for batch in batches:
            _, (_, logits, batch_labels) = model(batch)
            scores.append(torch.sigmoid(logits.float()).numpy())
            labels.append(batch_labels.numpy())
    if not scores:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate(scores), np.concatenate(labels)


def prepared_batches(
    root: Path,
    model_cfg: ModelConfig,
    hotness: list[int] | None,
    batch_size: int,
    progress: bool = False,
):
    """Batches of every row of every prepared file in `root` (`<name>_dense.npy`, name
    order, Kaggle's unlabeled test file too), ids hashed to the model's tables."""
    from recsys.data.convert import natural_key
    from recsys.data.criteo_binary import assemble_batch
    from recsys.data.multi_hot import read_multi_hot
    from recsys.data.prepared import open_npy
    from recsys.models.dlrm import feature_names
    from recsys.progress import Progress

    names = sorted(
        (p.name[: -len("_dense.npy")] for p in root.glob("*_dense.npy")),
        key=lambda n: natural_key(Path(n)),
    )
    if not names:
        raise ExportError(
            f"'{root}' holds no prepared files (<name>_dense.npy); give a "
            f"directory `recsys.data.prepare` wrote, or Criteo text"
        )
    hashes = np.asarray(model_cfg.num_embeddings_per_feature, dtype=np.int64)[:, None]
    keys = feature_names(model_cfg)
    arrays = {
        n: [open_npy(root / f"{n}_{k}.npy") for k in ("dense", "sparse", "labels")] for n in names
    }
    total = sum(len(a[0]) for a in arrays.values())
    bar = Progress(total, desc="scoring", unit="sample", enabled=progress)
    for n in names:
        dense, sparse, labels = arrays[n]
        if dense.shape[1] != model_cfg.dense_in_features or sparse.shape[1] != len(keys):
            raise ExportError(
                f"'{root}/{n}_*.npy' hold {dense.shape[1]} dense and {sparse.shape[1]} "
                f"categorical features; the model takes {model_cfg.dense_in_features} and "
                f"{len(keys)}"
            )
        bags, padded = None, variable_bags(root)
        if hotness or padded:
            bags = read_multi_hot(root, n, len(sparse), hotness, len(keys))
        for a in range(0, len(dense), batch_size):
            b = min(a + batch_size, len(dense))
            yield assemble_batch(
                dense[a:b],
                labels[a:b],
                sparse[a:b],
                hashes,
                keys,
                None if bags is None else [x[a:b] for x in bags],
                padded=padded,
            )
            bar.update(b - a)
    bar.close()


def _table_to_prepared(source: Path, tmp: Path, export: Path) -> Path:
    """CSV/TSV/parquet converted with the training data's schema and vocabularies."""
    from recsys.data.tabular import TabularConfig, convert_tabular

    if source.is_file() and not source.name.lower().endswith(TABLE_SUFFIXES):
        raise ExportError(
            f"input '{source}': the model was trained on tabular data; give "
            f"{', '.join(TABLE_SUFFIXES)} files or a prepared directory"
        )
    out = tmp / "prepared"
    convert_tabular(
        TabularConfig(input=str(source), output=str(out), vocab_from=str(export), progress=False)
    )
    return out


def _text_to_prepared(source: str, tmp: Path, meta: dict) -> Path:
    """Criteo text prepared as the training data was (its dense transform, shift, floor)."""
    from recsys.data.prepare import PrepareConfig, prepare

    prepared = meta.get("prepared")
    if prepared is None:
        raise ExportError(
            "the model was not trained on prepared Criteo files (its dataset has no "
            "summary.json), so how its text was turned into numbers is unknown: score a "
            "prepared directory instead"
        )
    if prepared.get("remapped"):
        raise ExportError(
            "the model was trained on remapped ids (recsys.data.remap: rows by the training "
            "files' vocabulary), which raw text does not carry: score a prepared and remapped "
            "directory instead"
        )
    dense = prepared["dense"]
    cfg = PrepareConfig(
        input=source,
        output=str(tmp / "prepared"),
        progress=False,
        dense_transform=dense["transform"],
        dense_shift=dense["shift"],
        dense_floor=dense["floor"],
        clip_dense=dense["clip"],
        hotness=prepared.get("hotness"),
    )
    prepare(cfg)
    return Path(cfg.output)


def score(cfg: ScoreConfig) -> dict:
    """Scores of every sample of `cfg.input` written to `cfg.output`; returns a summary."""
    out = Path(cfg.output)
    if out.suffix not in (".csv", ".npy"):
        raise ExportError(f"output={out}: name a .csv or a .npy file")
    if out.exists() and not cfg.overwrite:
        raise ExportError(f"output '{out}' exists; choose a new file or pass overwrite=true")
    check_not_input(out, [cfg.input, cfg.export])
    model, meta = load_exported(cfg.export)
    model_cfg = model_config_of(meta["model"])
    source = Path(cfg.input)
    if not source.exists():
        raise ExportError(f"input '{source}' does not exist")
    hotness = (meta.get("prepared") or {}).get("hotness")
    with tempfile.TemporaryDirectory(prefix=".score-", dir=out.parent) as tmp:
        root = source
        if (Path(cfg.export) / SCHEMA_FILE).exists() and not any(source.glob("*_dense.npy")):
            root = _table_to_prepared(source, Path(tmp), Path(cfg.export))
        elif not (source.is_dir() and any(source.glob("*_dense.npy"))):
            root = _text_to_prepared(str(source), Path(tmp), meta)
        batches = prepared_batches(root, model_cfg, hotness, cfg.batch_size, cfg.progress)
        scores, labels = score_batches(model, batches)
        written = Path(tmp) / ("scores" + out.suffix)
        table = np.stack([labels, scores], axis=1).astype(np.float32)
        if out.suffix == ".npy":
            np.save(written, table)
        else:
            np.savetxt(
                written, table, fmt=["%d", "%.7g"], delimiter=",", header="label,score", comments=""
            )
        os.replace(written, out)
    summary = {"samples": len(scores), "output": str(out.resolve()), "export": str(cfg.export)}
    known = labels >= 0
    if known.any():
        summary |= binary_metrics(scores[known], labels[known])
    return summary


def binary_metrics(scores: np.ndarray, labels: np.ndarray) -> dict:
    """AUC, log loss and NE of probabilities `scores` (the trainer's metrics, one process)."""
    from torchmetrics.functional.classification import binary_auroc

    from recsys.metrics import normalized_entropy

    p = torch.from_numpy(scores).double().clamp(1e-12, 1 - 1e-12)
    y = torch.from_numpy(labels).double()
    bce = torch.nn.functional.binary_cross_entropy(p, y, reduction="sum")
    n, pos = torch.tensor(float(len(y)), dtype=torch.float64), y.sum()
    return {
        "auc": float(binary_auroc(p, y.int())),
        "logloss": float(bce / n),
        "ne": normalized_entropy(bce, n, pos),
    }


ConfigStore.instance().store(name="base_export", node=ExportConfig)
ConfigStore.instance().store(name="base_score", node=ScoreConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="export")
def main(cfg: DictConfig) -> None:
    typed: ExportConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_cli(
        lambda: export_checkpoint(typed.checkpoint, typed.output, typed.overwrite),
        lambda m: (
            f"exported {m['checkpoint']} (step {m['step']}, model {m['model']['name']}) -> "
            f"{Path(typed.output).resolve()}\nscore a file with: python -m recsys.score "
            f"export={typed.output} input=<prepared dir or Criteo text> output=scores.csv"
        ),
    )


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="score")
def score_main(cfg: DictConfig) -> None:
    typed: ScoreConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]

    def report(s: dict) -> str:
        line = f"{s['samples']:,} samples scored -> {s['output']}"
        if "auc" in s:
            line += f"\nAUC {s['auc']:.4f} | log loss {s['logloss']:.4f} | NE {s['ne']:.4f}"
        return line

    run_cli(lambda: score(typed), report)


if __name__ == "__main__":
    main()
