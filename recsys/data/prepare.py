"""`python -m recsys.data.prepare input=<file or dir> output=<dir>`: Criteo TSV -> binary.

Writes TorchRec's binary Criteo layout (see `recsys.data.convert`) and `summary.json`
(`rows`, `bad_lines`, `files`, `mb_per_s`, `dense`: the transform, floor and shift, and per
file the shift used and each count column's minimum, maximum and clipped values) into the
output directory and the Hydra run dir. The output may be neither the input nor inside it,
nor contain it.
The output directory appears whole or not at all (`recsys.data.atomic`): a non-empty one is
refused unless `overwrite=true`, which replaces it whole; an error or Ctrl-C leaves nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf

from recsys import CONF_DIR
from recsys.data.atomic import atomic_dir, run_cli
from recsys.data.convert import (
    ConvertOptions,
    DenseTransform,
    LabelColumn,
    convert,
    input_files,
)
from recsys.data.criteo_tsv import CAT_FEATURES, CRITEO_DENSE_FLOOR, BadInputError, LineRules
from recsys.data.multi_hot import resolve_hotness, write_multi_hot
from recsys.data.prepared import prepared_names


@dataclass
class PrepareConfig:
    input: str = MISSING  # a TSV file (optionally .gz) or a directory of them
    output: str = MISSING  # directory for <name>_{dense,sparse,labels}.npy
    skip_bad_lines: bool = False  # false: stop at the first malformed line, naming it
    pad_short_lines: bool = False  # true: lines whose trailing empty fields were stripped
    # counts below this are malformed (Criteo's start at -3); <= 0, since missing counts are 0
    dense_floor: int = CRITEO_DENSE_FLOOR
    clip_dense: bool = False  # true: clip counts below the floor to it and count them
    dense_transform: DenseTransform = DenseTransform.torchrec  # or log1p (DLRM reference)
    # torchrec transform, log(x - shift + 2): null takes each file's minimum (TorchRec's
    # converter); a value fixes it for every file (multi-day data). Counts below it are
    # out of range like those below dense_floor.
    dense_shift: int | None = None
    label_column: LabelColumn = LabelColumn.auto
    chunk_mb: float = 16.0
    workers: int = 0  # parse processes; 0: one per core (at most 4)
    progress: bool = True
    # also write multi-hot bags (TorchRec's layout, `recsys.data.multi_hot`): a bag size per
    # table, or "mlperf"; train with the same `dataset.hotness`
    hotness: Any = None
    overwrite: bool = False  # replace a non-empty output directory whole


def line_rules(cfg: PrepareConfig) -> LineRules:
    """The checks every line passes; the floor is the higher of dense_floor and dense_shift."""
    for key in ("dense_floor", "dense_shift"):
        value = getattr(cfg, key)
        if value is not None and value > 0:
            raise BadInputError(
                f"{key}={value}: must be <= 0, since a missing count is read as 0 "
                f"(Criteo's lowest count is {CRITEO_DENSE_FLOOR})"
            )
    floor = cfg.dense_floor if cfg.dense_shift is None else max(cfg.dense_floor, cfg.dense_shift)
    return LineRules(
        skip_bad_lines=cfg.skip_bad_lines,
        pad_short_lines=cfg.pad_short_lines,
        dense_floor=floor,
        clip_dense=cfg.clip_dense,
    )


def prepare(cfg: PrepareConfig, run_dir: Path | None = None) -> dict:
    start = time.perf_counter()
    rules = line_rules(cfg)
    transform = DenseTransform(cfg.dense_transform)
    opts = ConvertOptions(
        rules=rules,
        dense_transform=transform,
        dense_shift=cfg.dense_shift,
        label_column=LabelColumn(cfg.label_column),
        chunk_mb=cfg.chunk_mb,
        workers=cfg.workers,
        progress=cfg.progress,
    )
    hotness = resolve_hotness(cfg.hotness, CAT_FEATURES)  # checked before the long part
    input_files(cfg.input)  # an input that is not there: before the output is touched
    with atomic_dir(cfg.output, cfg.overwrite, inputs=[cfg.input]) as out:
        results = convert(cfg.input, out, opts)
        if hotness is not None:
            write_multi_hot(out, prepared_names(out), hotness, progress=cfg.progress)
        seconds = time.perf_counter() - start
        text_mb = sum(r.text_mb for r in results)
        summary = {
            "rows": sum(r.rows for r in results),
            "bad_lines": sum(r.bad_lines for r in results),
            "files": [asdict(r) for r in results],
            "text_mb": text_mb,
            "seconds": seconds,
            "mb_per_s": text_mb / seconds if seconds else None,
            "output": str(Path(cfg.output).resolve()),
            "hotness": hotness,  # null: one-hot only
            "dense": {
                "transform": transform.value,
                "floor": rules.dense_floor,
                "shift": cfg.dense_shift,  # null: each file's minimum (files[*].dense_shift)
                "clip": cfg.clip_dense,
                "clipped": sum(sum(r.dense_clipped) for r in results),
            },
        }
        text = json.dumps(summary, indent=2) + "\n"
        (out / "summary.json").write_text(text)
    if run_dir:
        (run_dir / "summary.json").write_text(text)
    return summary


ConfigStore.instance().store(name="base_prepare", node=PrepareConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="prepare")
def main(cfg: DictConfig) -> None:
    typed: PrepareConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_cli(lambda: prepare(typed, run_dir), _report)


def _report(summary: dict) -> str:
    clipped = summary["dense"]["clipped"]
    return (
        f"{summary['rows']:,} rows from {len(summary['files'])} file(s), "
        f"{summary['bad_lines']:,} bad lines skipped, "
        + (f"{clipped:,} counts clipped to {summary['dense']['floor']}, " if clipped else "")
        + f"{summary['mb_per_s']:.1f} MB/s of text -> {summary['output']}"
    )


if __name__ == "__main__":
    main()
