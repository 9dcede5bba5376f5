"""`python -m recsys.data.prepare input=<file or dir> output=<dir>`: Criteo TSV -> binary.

Writes TorchRec's binary Criteo layout (see `recsys.data.convert`) and `summary.json`
(`rows`, `bad_lines`, `files`, `mb_per_s`) into the output directory and the Hydra run dir.
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

from recsys.data.atomic import atomic_dir, run_cli
from recsys.data.convert import ConvertOptions, LabelColumn, convert, input_files
from recsys.data.criteo_binary import prepared_names
from recsys.data.criteo_tsv import CAT_FEATURES, BadInputError
from recsys.data.multi_hot import HotnessError, resolve_hotness, write_multi_hot


@dataclass
class PrepareConfig:
    input: str = MISSING  # a TSV file (optionally .gz) or a directory of them
    output: str = MISSING  # directory for <name>_{dense,sparse,labels}.npy
    skip_bad_lines: bool = False  # false: stop at the first malformed line, naming it
    label_column: LabelColumn = LabelColumn.auto
    chunk_mb: float = 16.0
    workers: int = 0  # parse processes; 0: one per core (at most 4)
    progress: bool = True
    # also write multi-hot bags (TorchRec's layout, `recsys.data.multi_hot`): a bag size per
    # table, or "mlperf"; train with the same `dataset.hotness`
    hotness: Any = None
    overwrite: bool = False  # replace a non-empty output directory whole


def prepare(cfg: PrepareConfig, run_dir: Path | None = None) -> dict:
    start = time.perf_counter()
    opts = ConvertOptions(
        skip_bad_lines=cfg.skip_bad_lines,
        label_column=LabelColumn(cfg.label_column),
        chunk_mb=cfg.chunk_mb,
        workers=cfg.workers,
        progress=cfg.progress,
    )
    hotness = resolve_hotness(cfg.hotness, CAT_FEATURES)  # checked before the long part
    input_files(cfg.input)  # an input that is not there: before the output is touched
    with atomic_dir(cfg.output, cfg.overwrite) as out:
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
        }
        text = json.dumps(summary, indent=2) + "\n"
        (out / "summary.json").write_text(text)
    if run_dir:
        (run_dir / "summary.json").write_text(text)
    return summary


ConfigStore.instance().store(name="base_prepare", node=PrepareConfig)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="prepare")
def main(cfg: DictConfig) -> None:
    typed: PrepareConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    summary = run_cli(lambda: prepare(typed, run_dir),
                      (BadInputError, FileNotFoundError, HotnessError))  # fmt: skip
    print(
        f"{summary['rows']:,} rows from {len(summary['files'])} file(s), "
        f"{summary['bad_lines']:,} bad lines skipped, {summary['mb_per_s']:.1f} MB/s of text "
        f"-> {summary['output']}"
    )


if __name__ == "__main__":
    main()
