"""Access-frequency profiles: how often each table's rows are looked up, measured from data.

Per table: lookups per sample (pooling factor), distinct ids per batch, the frequency curve
(share of lookups covered by the hottest k rows), coverage at 0.1% / 1% / 10% of the rows,
the hottest ids, and (when the caller measures them, `sharding.profile` does) the distinct
ids among s consecutive samples for s a power of two: what a deduplicated exchange of a
micro-batch of s samples sends, in data order and after key-centric clustering.

Built by streaming over batches of ids with bounded memory: exact counts (`np.bincount`, 4
bytes a row) for tables up to `exact_max_rows`, else a Misra-Gries heavy-hitter summary of
`sketch_capacity` counters, merged batch by batch (Agarwal et al., "Mergeable summaries",
2012): every count it keeps is low by at most N / (capacity + 1), N being the table's
lookups, and that bound is written into the profile.

The curve is stored at log-spaced k (every power of 2^(1/4), plus the coverage points);
`hit_rate(cache_rows)` interpolates it. No Hydra, no torch: ids come in as numpy arrays.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sharding.errors import UserError

COVERAGE_FRACTIONS = {"0.1%": 0.001, "1%": 0.01, "10%": 0.1}


class ProfileError(UserError, ValueError):
    """A profile.json that is not one, or not of this model."""


@dataclass
class TableProfile:
    name: str
    rows: int
    lookups_per_sample: float
    distinct_per_batch: float  # mean distinct ids in one batch of `batch_size` samples
    batch_size: int
    coverage: dict[str, float]  # share of lookups on the hottest 0.1% / 1% / 10% of rows
    curve_k: list[int]  # hottest-k points of the frequency curve ...
    curve_share: list[float]  # ... and the share of lookups they cover
    hot_ids: list[int]  # hottest first
    counting: str  # "exact" or "misra_gries"
    max_count_error: int  # counts are low by at most this much (0 when exact)
    lookups: int
    # mean distinct ids among s consecutive samples, by s (a power of two, as a string: JSON
    # keys), in data order and after `pipelines.clustering.cluster_order`; empty: not measured
    distinct_per_samples: dict[str, float] = field(default_factory=dict)
    distinct_per_samples_clustered: dict[str, float] = field(default_factory=dict)

    def distinct(self, samples: float, clustered: bool = False) -> float | None:
        """Distinct ids among `samples` samples (micro-batch), interpolated in log-log
        between the measured sizes (and scaled past them); None if not measured."""
        measured = self.distinct_per_samples_clustered if clustered else self.distinct_per_samples
        if not measured or samples <= 0:
            return None
        s = np.array(sorted(int(k) for k in measured), dtype=np.float64)
        d = np.array([max(measured[str(int(k))], 1e-9) for k in s])
        if len(s) == 1:
            return float(d[0] * samples / s[0])
        x = np.log(samples)
        lo = int(np.clip(np.searchsorted(np.log(s), x) - 1, 0, len(s) - 2))
        slope = (np.log(d[lo + 1]) - np.log(d[lo])) / (np.log(s[lo + 1]) - np.log(s[lo]))
        return float(np.exp(np.log(d[lo]) + slope * (x - np.log(s[lo]))))

    def hit_rate(self, cache_rows: int) -> float:
        """Share of lookups served by a cache holding the hottest `cache_rows` rows."""
        if cache_rows <= 0:
            return 0.0
        if cache_rows >= self.rows:
            return 1.0
        return float(np.interp(np.log(cache_rows), np.log(self.curve_k), self.curve_share))


@dataclass
class AccessProfile:
    tables: list[TableProfile]
    batches: int
    samples: int
    source: dict = field(default_factory=dict)

    def table(self, name: str) -> TableProfile:
        for t in self.tables:
            if t.name == name:
                return t
        raise ProfileError(f"profile has no table '{name}'; it has {[t.name for t in self.tables]}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> AccessProfile:
        try:
            raw = json.loads(Path(path).read_text())
            return AccessProfile(
                tables=[TableProfile(**t) for t in raw["tables"]],
                batches=raw["batches"],
                samples=raw["samples"],
                source=raw.get("source", {}),
            )
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            msg = f"'{path}' is not a profile.json written by sharding.profile: {e}"
            raise ProfileError(msg) from e


def _mg_merge(ids: np.ndarray, counts: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum duplicate ids, then keep at most `capacity` counters (Misra-Gries merge)."""
    merged, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros(len(merged), dtype=np.int64)
    np.add.at(summed, inverse, counts)
    if len(merged) > capacity:
        cut = np.partition(summed, len(summed) - capacity - 1)[len(summed) - capacity - 1]
        summed = summed - cut
        keep = summed > 0
        merged, summed = merged[keep], summed[keep]
    return merged, summed


class _TableCounter:
    def __init__(self, rows: int, exact_max_rows: int, capacity: int) -> None:
        self.rows = rows
        self.exact = rows <= exact_max_rows
        self.capacity = capacity
        self.counts = np.zeros(rows, dtype=np.int32) if self.exact else None
        self.ids = np.zeros(0, dtype=np.int64)
        self.mg = np.zeros(0, dtype=np.int64)
        self.lookups = 0
        self.distinct = 0

    def add(self, ids: np.ndarray) -> None:
        if len(ids) and (ids.min() < 0 or ids.max() >= self.rows):
            raise ValueError(f"ids outside [0, {self.rows}) in a profiled batch")
        self.lookups += len(ids)
        uniq, cnt = np.unique(ids, return_counts=True)
        self.distinct += len(uniq)
        if self.exact:
            self.counts[uniq] += cnt.astype(np.int32)
        else:
            self.ids, self.mg = _mg_merge(
                np.concatenate([self.ids, uniq]), np.concatenate([self.mg, cnt]), self.capacity
            )

    def sorted_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, counts), hottest first."""
        if self.exact:
            order = np.argsort(-self.counts, kind="stable")
            return order, self.counts[order].astype(np.int64)
        order = np.argsort(-self.mg, kind="stable")
        return self.ids[order], self.mg[order]


def curve_points(rows: int) -> np.ndarray:
    ks = np.unique(np.round(2 ** np.arange(0, np.log2(max(rows, 1)) + 0.25, 0.25)).astype(np.int64))
    extra = [max(1, int(np.ceil(f * rows))) for f in COVERAGE_FRACTIONS.values()]
    return np.unique(np.clip(np.concatenate([ks, extra, [rows]]), 1, rows))


def build_profile(
    batches: Iterable[tuple[int, Mapping[str, np.ndarray]]],
    table_rows: Mapping[str, int],
    hot_ids: int = 1000,
    exact_max_rows: int = 1 << 25,
    sketch_capacity: int = 1 << 16,
) -> AccessProfile:
    """`batches` yields (samples in the batch, {table: ids looked up by the batch})."""
    counters = {n: _TableCounter(r, exact_max_rows, sketch_capacity) for n, r in table_rows.items()}
    n_batches = samples = 0
    for batch_samples, ids_by_table in batches:
        n_batches += 1
        samples += batch_samples
        for name, ids in ids_by_table.items():
            counters[name].add(np.asarray(ids, dtype=np.int64))
    if n_batches == 0:
        raise ValueError("no batches to profile")
    tables = []
    for name, c in counters.items():
        ids, counts = c.sorted_counts()
        cum = np.cumsum(counts) / max(c.lookups, 1)
        ks = curve_points(c.rows)
        share = [float(cum[min(k, len(cum)) - 1]) if len(cum) else 0.0 for k in ks]
        coverage = {
            label: float(cum[min(max(1, int(np.ceil(f * c.rows))), len(cum)) - 1])
            if len(cum)
            else 0.0
            for label, f in COVERAGE_FRACTIONS.items()
        }
        tables.append(
            TableProfile(
                name=name,
                rows=c.rows,
                lookups_per_sample=c.lookups / samples,
                distinct_per_batch=c.distinct / n_batches,
                batch_size=samples // n_batches,
                coverage=coverage,
                curve_k=[int(k) for k in ks],
                curve_share=share,
                hot_ids=[int(i) for i in ids[:hot_ids]],
                counting="exact" if c.exact else "misra_gries",
                max_count_error=0 if c.exact else c.lookups // (c.capacity + 1),
                lookups=c.lookups,
            )
        )
    return AccessProfile(tables=tables, batches=n_batches, samples=samples)
