"""A prepared Criteo directory (TorchRec's binary layout, as `recsys.data.prepare` writes
it): its file names, its summary's check, its arrays memory-mapped; numpy alone, so the data
commands import no torch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from recsys.data.convert import TEXT_SUFFIXES, natural_key
from sharding.errors import UserError


class CriteoDataError(UserError, ValueError):
    """Prepared Criteo files that are missing or do not fit the run."""


def prepared_names(path: str | Path) -> list[str]:
    root = Path(path)
    names = sorted(
        (p.name[: -len("_dense.npy")] for p in root.glob("*_dense.npy")),
        key=lambda n: natural_key(Path(n)),
    )
    names = [n for n in names if n != "test" and not n.startswith(".")]  # Kaggle's unlabeled test
    if not names:
        raise CriteoDataError(
            f"no prepared Criteo files (<name>_dense.npy, _sparse.npy, "
            f"_labels.npy) in '{root}'. {prepare_advice(root)}"
        )
    return names


def prepare_advice(root: Path) -> str:
    """How to make prepared files for `root`, never writing into a directory of raw text."""
    out = root.parent / f"{root.name}_binary"
    if root.is_dir() and any(
        p.name.lower().endswith(TEXT_SUFFIXES) or re.fullmatch(r"day_\d+", p.name)
        for p in root.iterdir()
    ):
        return (
            f"It holds Criteo text: prepare it into a new directory with `python -m "
            f"recsys.data.prepare input={root} output={out}`, then pass dataset.path={out}"
        )
    return (
        "Make them with `python -m recsys.data.prepare input=<tsv file or dir> "
        "output=<a new directory>` and pass that directory as dataset.path"
    )


def open_npy(path: Path) -> np.ndarray:
    """A prepared array, memory-mapped; a missing, truncated or foreign file names itself."""
    try:
        return np.load(path, mmap_mode="r")
    except FileNotFoundError:
        raise CriteoDataError(
            f"'{path}' is missing: the prepared directory is incomplete; "
            f"prepare it again into a new directory"
        ) from None
    except (ValueError, OSError) as e:
        raise CriteoDataError(
            f"'{path}' is truncated or not a .npy file ({e}); prepare it again into a new directory"
        ) from None


def check_prepared_dir(root: Path, rows: dict[str, int]) -> None:
    """Refuse a directory whose files cannot come from one `prepare` run: day_N files beside
    other names (two layouts), or files that its summary.json does not list as they are."""
    days = sorted(n for n in rows if re.fullmatch(r"day_\d+", n))
    others = sorted(n for n in rows if n not in days)
    if days and others:
        raise CriteoDataError(
            f"'{root}' mixes two layouts: {days[:3]} (Criteo 1TB) and {others[:3]}; prepare "
            f"each dataset into its own directory"
        )
    summary = root / "summary.json"
    if not summary.exists():
        return
    try:
        listed = {f["name"]: f["rows"] for f in json.loads(summary.read_text())["files"]}
    except (ValueError, KeyError, TypeError):
        raise CriteoDataError(f"'{summary}' is not a prepare summary; remove it") from None
    for name in sorted(set(rows) | set(listed)):
        if rows.get(name) != listed.get(name):
            have = f"{rows[name]:,} rows" if name in rows else "no files"
            said = f"{listed[name]:,} rows" if name in listed else "nothing"
            raise CriteoDataError(
                f"'{root}/{name}_*.npy': the directory holds {have}, its summary.json says "
                f"{said}: files of two runs are mixed. Prepare again into an empty directory "
                f"(or with overwrite=true)"
            )


def model_advice(root: Path) -> str:
    """How to give the model the data's shapes."""
    override = root / "model_override.txt"
    if override.exists():
        return f"pass $(cat {override}) (the shapes its converter wrote there)"
    return "set model.dense_in_features and model.num_embeddings_per_feature (one per column)"


CHECK_ROWS = 1 << 20  # rows read at a time by check_values


def check_values(root: Path, names: list[str], tables: list[int]) -> dict[str, int]:
    """Every row of the prepared files `names` in `root`, read once in chunks: labels 0 or
    1, dense features finite, ids not negative. Refused naming the file, the row and the
    fix. Ids at or past a table's size are taken modulo it (the Criteo convention, as
    TorchRec's loader does): returned per feature that has such ids, its largest id, for
    the run to say so."""
    beyond: dict[str, int] = {}
    for name in names:
        labels, dense, sparse = (
            open_npy(root / f"{name}_{k}.npy") for k in ("labels", "dense", "sparse")
        )
        for lo in range(0, len(labels), CHECK_ROWS):
            hi = lo + CHECK_ROWS
            lab = np.asarray(labels[lo:hi]).reshape(len(labels[lo:hi]), -1)[:, 0]
            bad = np.flatnonzero((lab != 0) & (lab != 1))
            if len(bad):
                row = lo + int(bad[0])
                raise CriteoDataError(
                    f"'{root / name}_labels.npy' row {row:,}: label {lab[bad[0]]}, not 0 or 1 "
                    f"({len(bad):,} such rows in rows {lo:,}-{min(hi, len(labels)) - 1:,}); "
                    f"labels are clicks: convert the data again (recsys.data.tabular takes "
                    f"label_threshold=<value> for a numeric label)"
                )
            d = np.asarray(dense[lo:hi])
            if d.dtype.kind == "f" and not np.isfinite(d).all():
                row, col = (int(x[0]) for x in np.nonzero(~np.isfinite(d)))
                raise CriteoDataError(
                    f"'{root / name}_dense.npy' row {lo + row:,}: dense feature {col} is "
                    f"{d[row, col]}: the model would predict NaN; fix or drop such rows and "
                    f"prepare the data again"
                )
            ids = np.asarray(sparse[lo:hi])
            if ids.size and ids.min() < 0:
                row, col = (int(x[0]) for x in np.nonzero(ids < 0))
                raise CriteoDataError(
                    f"'{root / name}_sparse.npy' row {lo + row:,}: categorical feature {col} "
                    f"has id {ids[row, col]}; ids are row numbers >= 0: prepare the data again"
                )
            if ids.size:
                top = ids.max(axis=0)
                for t in np.flatnonzero(top >= np.asarray(tables)):
                    beyond[f"cat_{t}"] = max(beyond.get(f"cat_{t}", 0), int(top[t]))
    return beyond
