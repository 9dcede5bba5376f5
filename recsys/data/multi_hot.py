"""Multi-hot bags: per-table bag sizes (`dataset.hotness`) and the prepared-file layout.

Real recommendation models look up several ids per feature and sample (MLPerf's
DLRM-DCNv2 trains on Criteo 1TB made multi-hot, bag sizes 1 to 100 per table). A bag size
of 0 makes that table's bags empty (a feature missing from every sample).

Prepared files keep TorchRec's multi-hot layout (its DLRM v2 example reads the same):
next to each `<name>_sparse.npy`, `<name>_sparse_multi_hot.npz` holds one array per table,
named by the table's index ("0" .. "25"), of shape [rows, bag size]. As in MLPerf's
`materialize_synthetic_multihot_dataset.py`, a bag is a deterministic function of the
sample's one-hot id (the id itself first, then ids drawn from it), so the same id always
makes the same bag and the frequency skew carries over.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from recsys.progress import Progress
from sharding.errors import UserError

# MLPerf Training DLRM-DCNv2 (Criteo 1TB multi-hot): bag size per table, cat_0 .. cat_25
MLPERF_HOTNESS = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
_ID_SPACE = 1 << 31  # drawn ids stay in the raw id range; tables hash them to their rows
MULTI_HOT_SUFFIX = "_sparse_multi_hot.npz"
SCHEMA_FILE = "schema.json"  # a tabular conversion's columns (recsys.data.tabular)


class HotnessError(UserError, ValueError):
    """A `dataset.hotness` that does not fit the model."""


def resolve_hotness(value, tables: int) -> list[int] | None:
    """`dataset.hotness` as a bag size per table; None means one id per bag (one-hot)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value != "mlperf":
            raise HotnessError(
                f"dataset.hotness='{value}': give a list of bag sizes, one per table, or "
                f"'mlperf' (MLPerf DLRM-DCNv2's {len(MLPERF_HOTNESS)})"
            )
        value = MLPERF_HOTNESS
    sizes = [int(h) for h in value]
    if len(sizes) != tables:
        raise HotnessError(
            f"dataset.hotness has {len(sizes)} bag sizes but the model has {tables} tables; "
            f"give one per table"
        )
    if min(sizes) < 0:
        raise HotnessError(f"dataset.hotness: bag sizes must be >= 0 (0: empty), got {sizes}")
    return None if all(h == 1 for h in sizes) else sizes


def expand(ids_N: np.ndarray, table: int, hotness: int) -> np.ndarray:
    """Each one-hot id's bag of `hotness` ids, [N, hotness]: the id, then
    `(id * a_k + b_k) mod 2^31` with constants fixed per (table, k)."""
    gen = np.random.default_rng([7, table])
    a = gen.integers(1, _ID_SPACE, max(hotness - 1, 0), dtype=np.int64) | 1
    b = gen.integers(0, _ID_SPACE, max(hotness - 1, 0), dtype=np.int64)
    ids = ids_N.astype(np.int64)[:, None]
    if hotness == 0:
        return ids[:, :0]
    drawn = (ids % _ID_SPACE * a[None, :] + b[None, :]) % _ID_SPACE
    return np.concatenate([ids, drawn], axis=1)


def write_multi_hot(
    out_dir: str | Path,
    names: list[str],
    hotness: list[int],
    chunk_rows: int = 1 << 20,
    progress: bool = True,
) -> list[Path]:
    """`<name>_sparse_multi_hot.npz` beside each prepared `<name>_sparse.npy`, and
    `multi_hot.json` naming the bag sizes. Memory stays bounded: each table's array is
    filled `chunk_rows` at a time into a memory-mapped `.npy`, then stored (uncompressed)
    into the zip that `np.load` reads as an npz."""
    root = Path(out_dir)
    written = []
    for name in names:
        sparse = np.load(root / f"{name}_sparse.npy", mmap_mode="r")
        path = root / f"{name}{MULTI_HOT_SUFFIX}"
        bar = Progress(len(hotness), desc=f"multi-hot {name}", unit="tables", enabled=progress)
        with bar, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as npz:
            for t, h in enumerate(hotness):
                tmp = root / f".{name}_multi_hot_{t}.npy"
                out = np.lib.format.open_memmap(tmp, "w+", np.int64, (len(sparse), h))
                for a in range(0, len(sparse), chunk_rows):
                    out[a : a + chunk_rows] = expand(
                        np.asarray(sparse[a : a + chunk_rows, t]), t, h
                    )
                out.flush()
                del out
                npz.write(tmp, arcname=f"{t}.npy")
                tmp.unlink()
                bar.update(1)
        written.append(path)
    (root / "multi_hot.json").write_text(json.dumps({"hotness": hotness}) + "\n")
    return written


def variable_bags(root: Path) -> bool:
    """Whether a prepared directory holds bags of a multi-valued column (its schema.json,
    written by `recsys.data.tabular`, says so): read whatever their width, -1 padding."""
    schema = root / SCHEMA_FILE
    return schema.exists() and bool(json.loads(schema.read_text()).get("bags"))


def read_multi_hot(
    root: Path, name: str, rows: int, hotness: list[int] | None, tables: int | None = None
) -> list[np.ndarray]:
    """The per-table [rows, bag size] arrays of one prepared file, checked against
    `hotness` (None: bags of any width, -1 padded, one array for each of `tables`); a clear
    error names the command that writes them."""
    path = root / f"{name}{MULTI_HOT_SUFFIX}"
    fix = (
        "prepare the text again into a new directory with `python -m recsys.data.prepare "
        "input=<tsv> output=<new dir> hotness=<the same list>` and pass it as "
        "dataset.path"
    )
    if hotness is None:
        fix = "convert the data again into a new directory (recsys.data.tabular)"
    if not path.exists():
        raise HotnessError(
            f"dataset.hotness is set but '{path}' does not exist; {fix}"
            if hotness is not None
            else f"'{path}' is missing; {fix}"
        )
    count = len(hotness) if hotness is not None else tables
    with np.load(path) as npz:
        arrays = [npz[str(t)] for t in range(count) if str(t) in npz]
    shapes = [a.shape for a in arrays]
    if hotness is None:
        if len(arrays) != count or any(len(s) != 2 or s[0] != rows for s in shapes):
            raise HotnessError(
                f"'{path}' holds {len(arrays)} tables' bags of shapes {shapes}, "
                f"not {count} of {rows} rows; {fix}"
            )
        return arrays
    if shapes != [(rows, h) for h in hotness]:
        raise HotnessError(
            f"'{path}' holds bags of sizes {[s[1] for s in shapes]} for {len(shapes)} tables "
            f"({shapes[0][0] if shapes else 0} rows), not dataset.hotness={hotness} for {rows} "
            f"rows; {fix}"
        )
    return arrays


def bags_to_jagged(bags: list[np.ndarray], padded: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature [B, h] id arrays -> KJT values and lengths (feature-major, as TorchRec);
    with `padded`, negative ids are padding (bags of a multi-valued column), left out."""
    if not bags:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    if not padded:  # fixed-size bags
        values = np.concatenate([b.reshape(-1) for b in bags])
        lengths = np.concatenate([np.full(len(b), b.shape[1], dtype=np.int32) for b in bags])
        return values, lengths
    values = np.concatenate([b[b >= 0] for b in bags])  # row-major: each bag in order
    lengths = np.concatenate([(b >= 0).sum(axis=1, dtype=np.int32) for b in bags])
    return values, lengths
