"""Write synthetic Criteo files in the real text format, from the same planted model as the
in-memory source, so every step from raw text to training runs on files.

Per feature, ids follow a power law over `cardinality` distinct values, written as 8-digit
hex (scattered 32-bit values, like Criteo's hashes). Counts are integers: exp of the planted
dense value, with some -1/-2 as Criteo's first count column has. Some values are missing
(empty fields, every line keeps its 40 fields as the real files do: TorchRec's converter,
which MLPerf runs on them, fails on shorter lines), and the last line of a file can be left
without its newline. `strip_trailing_empty` writes files whose trailing empty fields were
stripped by some tool (read with `prepare pad_short_lines=true`).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np

from recsys.config import SyntheticConfig
from recsys.data.atomic import atomic_dir
from recsys.data.criteo_tsv import CAT_FEATURES, INT_FEATURES
from recsys.data.planted import PlantedModel, power_law_ranks
from recsys.progress import Progress
from sharding.errors import UserError

KAGGLE_CARDINALITIES = [
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
]
CRITEO_1TB_CARDINALITIES = [
    40000000,
    39060,
    17295,
    7424,
    20265,
    3,
    7122,
    1543,
    63,
    40000000,
    3067956,
    405282,
    10,
    2209,
    11938,
    155,
    4,
    976,
    14,
    40000000,
    40000000,
    40000000,
    590152,
    12973,
    108,
    36,
]
_HASH_MULT = 2_654_435_761  # Knuth's multiplicative hash: distinct ids -> scattered 32 bits


class Preset(str, Enum):
    kaggle = "kaggle"  # train.txt (+ test.txt without labels)
    criteo_1tb = "criteo_1tb"  # day_0 .. day_{files-1}


@dataclass
class SynthConfig:
    output: str = "outputs/data/synthetic_criteo/tsv"
    preset: Preset = Preset.kaggle
    scale: float = 100.0  # cardinalities divided by this (at least 1 id per feature)
    rows: int = 200_000  # per file
    files: int = 1  # criteo_1tb: day files; kaggle: always train.txt
    test_rows: int = 0  # kaggle: rows of an unlabeled test.txt
    gzip: bool = False
    zipf_exponent: float = 1.1
    missing_rate: float = 0.05  # share of empty values
    strip_trailing_empty: bool = False  # true: short lines, as some tools leave them
    final_newline: bool = False  # real files sometimes end without one
    seed: int = 1234
    signal: float = 1.0
    chunk_rows: int = 50_000
    cardinalities: list[int] = field(default_factory=list)  # overrides the preset's
    overwrite: bool = False  # replace a non-empty output directory whole


class SynthConfigError(UserError, ValueError):
    """A `recsys.data.synth` key no file can be written with."""


def cardinalities(cfg: SynthConfig) -> list[int]:
    base = cfg.cardinalities or (
        KAGGLE_CARDINALITIES if Preset(cfg.preset) == Preset.kaggle else CRITEO_1TB_CARDINALITIES
    )
    if len(base) != CAT_FEATURES:
        raise SynthConfigError(f"synth: need {CAT_FEATURES} cardinalities, got {len(base)}")
    return [max(1, int(c / cfg.scale)) for c in base]


def _lines(
    cfg: SynthConfig,
    model: PlantedModel,
    cards: list[int],
    rng: np.random.Generator,
    rows: int,
    labeled: bool,
) -> list[str]:
    z_ND = rng.standard_normal((rows, INT_FEATURES))
    ids_CN = (
        np.stack([power_law_ranks(rng.random(rows), c, cfg.zipf_exponent) for c in cards])
        * _HASH_MULT
        + np.arange(CAT_FEATURES)[:, None] * 0x9E3779B9
    )
    hashed_CN = ids_CN & 0xFFFFFFFF
    p_N = 1.0 / (1.0 + np.exp(-model.logits(z_ND, hashed_CN)))
    labels_N = (rng.random(rows) < p_N).astype(np.int64)
    counts_ND = np.floor(np.exp(1.5 * z_ND + 1.0)).astype(np.int64) - 1
    counts_ND[:, 0] = np.where(rng.random(rows) < 0.02, -rng.integers(1, 3, rows), counts_ND[:, 0])
    miss_int = rng.random((rows, INT_FEATURES)) < cfg.missing_rate
    miss_cat = rng.random((rows, CAT_FEATURES)) < cfg.missing_rate
    miss_cat[:, -3:] |= rng.random((rows, 1)) < 0.3  # a trailing block often empty
    lines = []
    for n in range(rows):
        ints = ["" if miss_int[n, i] else str(counts_ND[n, i]) for i in range(INT_FEATURES)]
        cats = ["" if miss_cat[n, c] else f"{hashed_CN[c, n]:08x}" for c in range(CAT_FEATURES)]
        fields = ([str(labels_N[n])] if labeled else []) + ints + cats
        line = "\t".join(fields)
        lines.append(line.rstrip("\t") if cfg.strip_trailing_empty else line)
    return lines


def write_file(cfg: SynthConfig, path: Path, rows: int, labeled: bool, file_seed: int) -> None:
    cards = cardinalities(cfg)
    planted = SyntheticConfig(seed=cfg.seed, signal=cfg.signal, zipf_exponent=cfg.zipf_exponent)
    model = PlantedModel(planted, cards, INT_FEATURES)
    rng = np.random.default_rng([cfg.seed, file_seed])
    opener = gzip.open if cfg.gzip else open
    with opener(path, "wt", newline="\n") as f:
        written = 0
        with Progress(rows, desc=f"synth {path.name}", unit="rows") as bar:
            for start in range(0, rows, cfg.chunk_rows):
                lines = _lines(cfg, model, cards, rng, min(cfg.chunk_rows, rows - start), labeled)
                written += len(lines)
                last = written == rows
                f.write("\n".join(lines) + ("\n" if not last or cfg.final_newline else ""))
                bar.update(len(lines))


def synthesize(cfg: SynthConfig) -> list[Path]:
    if cfg.rows < 1:
        raise SynthConfigError(f"synth: rows must be >= 1, got {cfg.rows}")
    out = Path(cfg.output)
    cardinalities(cfg)  # bad ones: before the output is touched
    with atomic_dir(out, cfg.overwrite) as tmp:
        return [out / p.name for p in _synthesize(cfg, tmp)]


def _synthesize(cfg: SynthConfig, out: Path) -> list[Path]:
    suffix = ".gz" if cfg.gzip else ""
    jobs: list[tuple[Path, int, bool]] = []
    if Preset(cfg.preset) == Preset.kaggle:
        jobs.append((out / f"train.txt{suffix}", cfg.rows, True))
        if cfg.test_rows:
            jobs.append((out / f"test.txt{suffix}", cfg.test_rows, False))
    else:
        jobs += [(out / f"day_{d}{suffix or ''}", cfg.rows, True) for d in range(cfg.files)]
    for i, (path, rows, labeled) in enumerate(jobs):
        write_file(cfg, path, rows, labeled, file_seed=i)
    return [p for p, _, _ in jobs]
