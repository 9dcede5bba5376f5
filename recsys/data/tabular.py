"""`python -m recsys.data.tabular input=<csv|tsv|parquet file or dir> output=<new dir>
label=<column> dense=[...] categorical=[...] [multi_valued=[...]]`: your own logs into the
prepared layout the trainer reads.

A schema names the columns (on the command line, or a file in `conf/schema/` or your own
`--config-dir`, `schema=<name>`):
- `label`: 0/1, or any number with `label_threshold` (a click is `value >= threshold`);
- `dense`: numeric columns, `log(max(x, 0) + 1)` (`dense_transform=log1p`, the DLRM
  reference's) or as they are (`none`); empty is 0;
- `categorical`: one value a row, any type (strings, numbers); `multi_valued`: columns
  holding several values split on `value_separator` (genres `Comedy|Drama`), each a bag;
- values become rows of their table by a vocabulary (`categories=vocab`: by count, most
  frequent first, rows 1..K; values seen fewer than `min_count` times and missing ones share
  row 0) or by hashing (`categories=hash`: crc32 of the value's text into `hash_buckets`
  rows, row 0 for missing; no vocabulary, so new values map without one).
- `sort_by`: rows in this column's order (a timestamp) first, so the held-out split, the
  last rows, is the latest data.

It writes, whole or not at all like `prepare` (a non-empty output only with
`overwrite=true`; never into its input), per input file `<name>_dense.npy` (float32 [N, D]),
`<name>_sparse.npy` (int64 [N, C]; a bag's first id), `<name>_labels.npy` (int32 [N, 1]),
and where there are multi-valued columns `<name>_sparse_multi_hot.npz` (per table [N, longest
bag], -1 padded; `recsys.data.multi_hot`), plus `summary.json` (what `prepare` writes:
rows, bad rows, files), `schema.json` (the columns in table order, each table's rows), the
vocabularies (`vocab/<table>.txt`, row k on line k) and `model_override.txt` (the model
keys that size a model to the data). Rows with a missing or bad label or a non-numeric dense
value stop the run naming file, row and column, or are skipped and counted with
`skip_bad_rows=true`. `vocab_from=<a converted dir or an export>`: convert new data with
that conversion's schema and vocabularies (values it never saw go to row 0), as scoring does.

Each input file is read whole into memory (pyarrow): give a large log as several files.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf

from recsys import CONF_DIR
from recsys.data.atomic import atomic_dir, run_cli
from recsys.data.multi_hot import MULTI_HOT_SUFFIX, SCHEMA_FILE
from recsys.progress import Progress
from sharding.errors import UserError

SUFFIXES = (".csv", ".tsv", ".parquet", ".csv.gz", ".tsv.gz", ".parquet.brotli")
VOCAB_DIR = "vocab"
_NUMBER = r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$"


class TabularError(UserError, ValueError):
    """A schema or an input file that cannot be converted; the message names it."""


class Categories(str, Enum):
    vocab = "vocab"  # rows by count, most frequent first; rare and missing share row 0
    hash = "hash"  # crc32 of the value's text into hash_buckets rows (row 0: missing)


class DenseTransform(str, Enum):
    log1p = "log1p"  # log(max(x, 0) + 1), the DLRM reference's
    none = "none"  # the values as they are


@dataclass
class TabularConfig:
    input: str = MISSING  # a .csv/.tsv/.parquet file (csv, tsv gzipped too) or a directory
    output: str = MISSING  # a new directory
    label: str = MISSING  # the label column
    label_threshold: float | None = None  # a click is label >= this; None: the column is 0/1
    dense: list[str] = field(default_factory=list)
    dense_transform: DenseTransform = DenseTransform.log1p
    categorical: list[str] = field(default_factory=list)
    multi_valued: list[str] = field(default_factory=list)  # bags: values split on value_separator
    value_separator: str = "|"
    categories: Categories = Categories.vocab
    min_count: int = 1  # vocab: values seen fewer times share row 0
    hash_buckets: int = 1 << 20  # hash: rows per table
    sort_by: str | None = None  # rows in this column's order before the split (a time)
    # csv/tsv field separator: one character, or tab (or \t), comma, semicolon, space, pipe;
    # default "," (.csv) or tab (.tsv)
    separator: str | None = None
    vocab_from: str | None = None  # a converted dir or an export: its schema and vocabularies
    skip_bad_rows: bool = False
    overwrite: bool = False
    progress: bool = True


def input_files(path: str | Path) -> list[Path]:
    root = Path(path)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(p for p in root.iterdir() if p.name.lower().endswith(SUFFIXES))
    else:
        raise TabularError(f"input '{root}' does not exist")
    if not files:
        raise TabularError(f"input '{root}' holds no {', '.join(SUFFIXES)} files")
    bad = [p for p in files if not p.name.lower().endswith(SUFFIXES)]
    if bad:
        raise TabularError(f"'{bad[0]}': not a table file; give {', '.join(SUFFIXES)}")
    return files


def _name(path: Path) -> str:
    name = path.name
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def read_table(path: Path, columns: list[str], separator: str | None):
    """The file's `columns` as a pyarrow Table (CSV/TSV values as text, parquet as stored)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    try:
        if ".parquet" in path.name.lower():
            _check_columns(path, columns, pq.ParquetFile(path).schema_arrow.names)
            return pq.read_table(path, columns=columns)
        sep = separator or ("\t" if ".tsv" in path.name.lower() else ",")
        _check_columns(path, columns, _csv_header(path, sep))
        return pcsv.read_csv(
            path,
            parse_options=pcsv.ParseOptions(delimiter=sep),
            convert_options=pcsv.ConvertOptions(
                include_columns=columns,
                column_types={c: pa.string() for c in columns},
                strings_can_be_null=False,
            ),
        )
    except (pa.ArrowInvalid, OSError) as e:
        message = str(e).splitlines()[0][:300]
        raise TabularError(f"'{path}' cannot be read as a table: {message}") from None


def _csv_header(path: Path, sep: str) -> list[str]:
    import pyarrow.csv as pcsv

    return pcsv.open_csv(path, parse_options=pcsv.ParseOptions(delimiter=sep)).schema.names


def _check_columns(path: Path, wanted: list[str], have: list[str]) -> None:
    missing = [c for c in wanted if c not in have]
    if missing:
        raise TabularError(
            f"'{path}' has no column {missing[0]!r} (its columns: "
            f"{', '.join(have[:20])}); fix the schema"
        )


def _text(column):
    """A column as text, missing as ''."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
        column = pc.cast(column, pa.string())
    return pc.fill_null(column, "")


def _values(column, separator: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Per row its values as text: (values, bag length per row); one a row unless
    `separator` splits bags; empty values are dropped (missing)."""
    import pyarrow.compute as pc

    text = _text(column)
    if separator is None:
        values = np.asarray(text.to_numpy(zero_copy_only=False), dtype=object)
        present = values != ""
        return values[present], present.astype(np.int64)
    bags = pc.split_pattern(text, separator)
    flat = np.asarray(pc.list_flatten(bags).to_numpy(zero_copy_only=False), dtype=object)
    lengths = pc.list_value_length(bags).to_numpy(zero_copy_only=False).astype(np.int64)
    keep = np.char.strip(flat.astype(str)) != "" if len(flat) else np.zeros(0, bool)
    row = np.repeat(np.arange(len(lengths)), lengths)
    return np.char.strip(flat[keep].astype(str)).astype(object), np.bincount(
        row[keep], minlength=len(lengths)
    )


@dataclass
class Vocabulary:
    """A table's values in row order (row k + 1 is values[k]; row 0: missing and rare)."""

    values: list[str]

    def rows(self) -> int:
        return len(self.values) + 1

    def lookup(self, values: np.ndarray) -> np.ndarray:
        index = {v: i + 1 for i, v in enumerate(self.values)}
        return np.fromiter((index.get(v, 0) for v in values), dtype=np.int64, count=len(values))


def _hash(values: np.ndarray, buckets: int) -> np.ndarray:
    unique, inverse = np.unique(values.astype(str), return_inverse=True)
    rows = np.fromiter(
        (1 + zlib.crc32(v.encode()) % (buckets - 1) for v in unique),
        dtype=np.int64,
        count=len(unique),
    )
    return rows[inverse]


def _columns(cfg: TabularConfig) -> list[tuple[str, str | None]]:
    """The categorical columns in table order: (column, separator or None)."""
    return [(c, None) for c in cfg.categorical] + [
        (c, cfg.value_separator) for c in cfg.multi_valued
    ]


def check_schema(cfg: TabularConfig) -> None:
    cats = _columns(cfg)
    if not cats:
        raise TabularError(
            "the schema names no categorical column: give categorical=[...] or multi_valued=[...]"
        )
    names = [cfg.label, *cfg.dense, *(c for c, _ in cats)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TabularError(
            f"column {twice[0]!r} is named twice in the schema (label, dense, "
            f"categorical, multi_valued): give each column one role"
        )
    if cfg.min_count < 1 or cfg.hash_buckets < 2:
        raise TabularError("min_count must be >= 1 and hash_buckets >= 2")
    if cfg.multi_valued and not cfg.value_separator:
        raise TabularError("value_separator is empty: multi_valued columns need one")
    field_separator(cfg.separator)


# what `separator=` may also say: a shell passes a tab as the two characters \t
SEPARATOR_NAMES = {
    "tab": "\t",
    "\\t": "\t",
    "comma": ",",
    "semicolon": ";",
    "space": " ",
    "pipe": "|",
}


def field_separator(given: str | None) -> str | None:
    """The CSV field separator `separator=` names: one character, or tab, \\t, comma,
    semicolon, space or pipe; None: by the file's suffix."""
    if given is None:
        return None
    sep = SEPARATOR_NAMES.get(given, given)
    if len(sep) != 1:
        raise TabularError(
            f"separator={given!r}: give one character, or one of "
            f"{', '.join(SEPARATOR_NAMES)} (e.g. separator=tab)"
        )
    return sep


def _from_saved(cfg: TabularConfig) -> tuple[TabularConfig, list[Vocabulary] | None]:
    """`cfg` with the schema of `cfg.vocab_from` (and its vocabularies), or as it is."""
    if not cfg.vocab_from:
        return cfg, None
    root = Path(cfg.vocab_from)
    if not (root / SCHEMA_FILE).exists():
        raise TabularError(
            f"vocab_from='{root}' holds no {SCHEMA_FILE}: give a directory "
            f"recsys.data.tabular wrote, or an export of a model trained on "
            f"one"
        )
    schema = json.loads((root / SCHEMA_FILE).read_text())
    this_run = {
        k: getattr(cfg, k) for k in ("input", "output", "overwrite", "skip_bad_rows", "progress")
    }
    saved = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(TabularConfig), schema["config"], this_run)
    )
    vocabs = None
    if Categories(saved.categories) == Categories.vocab:
        vocabs = [
            Vocabulary((root / VOCAB_DIR / f"{t}.txt").read_text().splitlines())
            for t in range(len(schema["tables"]))
        ]
    return saved, vocabs


def _count(tables: list, cfg: TabularConfig) -> list[Vocabulary]:
    """Per categorical column its vocabulary over every input file."""
    vocabs = []
    for column, sep in _columns(cfg):
        counts: dict[str, int] = {}
        for t in tables:
            values, _ = _values(t.column(column), sep)
            uniq, n = np.unique(values.astype(str), return_counts=True)
            for v, k in zip(uniq.tolist(), n.tolist(), strict=True):
                counts[v] = counts.get(v, 0) + k
        kept = sorted(
            (v for v, k in counts.items() if k >= cfg.min_count), key=lambda v: (-counts[v], v)
        )
        vocabs.append(Vocabulary(kept))
    return vocabs


def _bad_rows(path: Path, table, cfg: TabularConfig) -> tuple[np.ndarray, list[str]]:
    """A mask of rows that cannot be samples, and a line naming the first few."""
    import pyarrow.compute as pc

    n = table.num_rows
    bad = np.zeros(n, dtype=bool)
    reasons = []
    checks = [(cfg.label, "label")] + [(c, "dense") for c in cfg.dense]
    for column, role in checks:
        text = pc.utf8_trim_whitespace(_text(table.column(column)))
        numeric = pc.match_substring_regex(text, _NUMBER).to_numpy(zero_copy_only=False)
        empty = pc.equal(text, "").to_numpy(zero_copy_only=False)
        wrong = ~numeric & (~empty if role == "dense" else True)
        if role == "label" and cfg.label_threshold is None:
            ok01 = pc.is_in(text, value_set=_pa_strings(["0", "1", "0.0", "1.0"]))
            wrong |= ~ok01.to_numpy(zero_copy_only=False)
        for i in np.flatnonzero(wrong & ~bad)[:3]:
            value = text[int(i)].as_py()
            need = "a number" if role == "dense" or cfg.label_threshold is not None else "0 or 1"
            reasons.append(
                f"{path}: row {int(i) + 1}: {role} column {column!r} is {value!r}, not {need}"
            )
        bad |= wrong
    return bad, reasons


def _numeric_label(column) -> bool:
    """Every value of the label column a number, some neither 0 nor 1 (a rating)."""
    import pyarrow.compute as pc

    text = pc.utf8_trim_whitespace(_text(column))
    if not pc.all(pc.match_substring_regex(text, _NUMBER)).as_py():
        return False
    values = _numbers(column)
    return bool(((values != 0) & (values != 1)).any())


def _pa_strings(values: list[str]):
    import pyarrow as pa

    return pa.array(values, type=pa.string())


def _sort_key(column) -> np.ndarray:
    import pyarrow.compute as pc

    text = pc.utf8_trim_whitespace(_text(column))
    if pc.all(pc.match_substring_regex(text, _NUMBER)).as_py() is not False:
        return _numbers(column)
    return np.asarray(text.to_numpy(zero_copy_only=False), dtype=str)


def _numbers(column) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    text = pc.utf8_trim_whitespace(_text(column))
    text = pc.if_else(pc.equal(text, ""), "0", text)
    return pc.cast(text, pa.float64()).to_numpy(zero_copy_only=False)


def convert_table(
    path: Path, table, cfg: TabularConfig, vocabs: list[Vocabulary] | None, out: Path, name: str
) -> dict:
    """Write one file's arrays; returns its summary entry."""
    bad, reasons = _bad_rows(path, table, cfg)
    numeric_label = _numeric_label(table.column(cfg.label)) and cfg.label_threshold is None
    if bad.any() and (not cfg.skip_bad_rows or bad.all() or numeric_label):
        more = f" ({int(bad.sum()):,} bad rows in all)" if bad.sum() > 1 else ""
        fix = (
            "fix the data, or pass skip_bad_rows=true to skip and count such rows"
            if not bad.all()
            else "every row is bad: check the schema's columns"
        )
        if numeric_label:  # a rating or a count: skipping rows would keep one class
            fix = (
                f"the label column {cfg.label!r} holds numbers other than 0 and 1: pass "
                f"label_threshold=<value> to count a click where the label is >= it"
            )
        raise TabularError(f"{reasons[0]}{more}; {fix}")
    if bad.any():
        table = table.filter(_pa_bools(~bad))
    if cfg.sort_by:  # numbers as numbers (CSV holds them as text), stable for ties
        table = table.take(np.argsort(_sort_key(table.column(cfg.sort_by)), kind="stable"))
    n = table.num_rows
    label = _numbers(table.column(cfg.label))
    labels = (label >= cfg.label_threshold) if cfg.label_threshold is not None else label
    # no dense column: one constant 0 column, since the models take at least one
    # (model_override says model.dense_in_features=1)
    dense = (
        np.stack([_numbers(table.column(c)) for c in cfg.dense], 1)
        if cfg.dense
        else (np.zeros((n, 1)))
    )
    if DenseTransform(cfg.dense_transform) == DenseTransform.log1p:
        dense = np.log1p(np.maximum(dense, 0))
    first, bags = [], []
    for t, (column, sep) in enumerate(_columns(cfg)):
        values, lengths = _values(table.column(column), sep)
        if Categories(cfg.categories) == Categories.vocab:
            ids = vocabs[t].lookup(values)
        else:
            ids = _hash(values, cfg.hash_buckets)
        width = max(1, int(lengths.max()) if n else 1)
        bag = np.full((n, width), -1, dtype=np.int64)
        rows = np.repeat(np.arange(n), lengths)
        starts = np.cumsum(lengths) - lengths
        bag[rows, np.arange(len(ids)) - starts[rows]] = ids
        bag[lengths == 0, 0] = 0  # missing: row 0, as a one-value column's
        first.append(bag[:, 0])
        bags.append(bag)
    np.save(out / f"{name}_dense.npy", dense.astype(np.float32))
    np.save(out / f"{name}_sparse.npy", np.stack(first, 1))
    np.save(out / f"{name}_labels.npy", labels.astype(np.int32)[:, None])
    if cfg.multi_valued:
        np.savez(out / f"{name}{MULTI_HOT_SUFFIX}", **{str(t): b for t, b in enumerate(bags)})
    return {
        "name": name,
        "path": str(path),
        "rows": n,
        "bad_lines": int(bad.sum()),
        "clicks": int(labels.sum()),
        "longest_bag": [int(b.shape[1]) for b in bags],
    }


def _pa_bools(mask: np.ndarray):
    import pyarrow as pa

    return pa.array(mask, type=pa.bool_())


def _check_two_classes(results: list[dict]) -> None:
    """Skipping bad rows must not leave labels of one class: the rows skipped were then most
    likely the other class, in a form the schema does not read."""
    rows, clicks = sum(r["rows"] for r in results), sum(r["clicks"] for r in results)
    skipped = sum(r["bad_lines"] for r in results)
    if skipped and clicks in (0, rows):
        raise TabularError(
            f"skip_bad_rows=true skipped {skipped:,} rows and left {rows:,} whose labels are "
            f"all {int(clicks > 0)}: no model can learn from one class. Check the label column "
            f"(label_threshold=<value> for a numeric one) before skipping rows"
        )


def convert_tabular(cfg: TabularConfig, run_dir: Path | None = None) -> dict:
    start = time.perf_counter()
    cfg, vocabs = _from_saved(cfg)
    check_schema(cfg)
    files = input_files(cfg.input)
    names = [_name(p) for p in files]
    if len(set(names)) < len(names):
        raise TabularError(f"'{cfg.input}': two files would both be '{names[0]}'; rename one")
    needed = [cfg.label, *cfg.dense, *(c for c, _ in _columns(cfg))]
    needed += [cfg.sort_by] if cfg.sort_by and cfg.sort_by not in needed else []
    bar = Progress(len(files) * 2, desc="tabular", unit="pass", enabled=cfg.progress)
    tables = []
    for p in files:
        tables.append(read_table(p, needed, field_separator(cfg.separator)))
        bar.update(1)
    if vocabs is None and Categories(cfg.categories) == Categories.vocab:
        vocabs = _count(tables, cfg)
    sizes = [v.rows() for v in vocabs] if vocabs else [cfg.hash_buckets] * len(_columns(cfg))
    with atomic_dir(cfg.output, cfg.overwrite, inputs=[cfg.input]) as out:
        results = []
        for p, t, name in zip(files, tables, names, strict=True):
            results.append(convert_table(p, t, cfg, vocabs, out, name))
            bar.update(1)
        bar.close()
        _check_two_classes(results)
        if vocabs:
            (out / VOCAB_DIR).mkdir()
            for t, v in enumerate(vocabs):
                (out / VOCAB_DIR / f"{t}.txt").write_text("".join(f"{x}\n" for x in v.values))
        sizes_text = ",".join(map(str, sizes))
        override = (
            f"model.dense_in_features={max(1, len(cfg.dense))} "
            f"model.num_embeddings_per_feature=[{sizes_text}]"
        )
        config = json.loads(json.dumps(asdict(cfg), default=lambda e: e.value))
        for key in ("input", "output", "overwrite", "progress", "vocab_from", "skip_bad_rows"):
            config.pop(key)
        schema = {
            "config": config,
            "tables": [
                {"feature": f"cat_{t}", "column": c, "separator": sep, "rows": n}
                for t, ((c, sep), n) in enumerate(zip(_columns(cfg), sizes, strict=True))
            ],
            "dense": list(cfg.dense),
            "bags": bool(cfg.multi_valued),
            "model_override": override,
        }
        (out / SCHEMA_FILE).write_text(json.dumps(schema, indent=1) + "\n")
        (out / "model_override.txt").write_text(override + "\n")
        summary = {
            "rows": sum(r["rows"] for r in results),
            "bad_lines": sum(r["bad_lines"] for r in results),
            "files": results,
            "seconds": time.perf_counter() - start,
            "output": str(Path(cfg.output).resolve()),
            "hotness": None,
            "dense": {"transform": DenseTransform(cfg.dense_transform).value},
            "tabular": True,
            "model_override": override,
        }
        text = json.dumps(summary, indent=2) + "\n"
        (out / "summary.json").write_text(text)
    if run_dir:
        (run_dir / "summary.json").write_text(text)
    return summary


ConfigStore.instance().store(name="base_tabular", node=TabularConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="tabular")
def main(cfg: DictConfig) -> None:
    typed: TabularConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_cli(
        lambda: convert_tabular(typed, run_dir),
        lambda s: (
            f"{s['rows']:,} rows from {len(s['files'])} file(s), {s['bad_lines']:,} bad rows "
            f"skipped -> {s['output']}\ntrain on it with: dataset=prepared "
            f"dataset.path={s['output']} {s['model_override']} (also in "
            f"{s['output']}/model_override.txt)"
        ),
    )


if __name__ == "__main__":
    main()
