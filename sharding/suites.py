"""Workloads to plan: seeded random suites of tables, and named ones built elsewhere.

A `Workload` is what a planner needs besides the cluster: tables with their lookups per
sample, each table's access frequency (coverage curve), and the dense model's size.
`random_suite(seed, spec)` draws one the way real recommendation models vary (MLPerf
DLRM-DCNv2 and published industrial models span these ranges): 10 to 1,000 tables, rows
log-uniform from 1e2 to 1e8, dims 16 to 256, pooling factors 1 to 100 (log-uniform), each
table's skew its own power-law exponent. Real models with many tables have smaller ones: a
suite whose weights exceed its drawn size (`weights_gb`, log-uniform) has every table's rows
scaled down by one factor (never below `rows[0]`). The dense part is MLPerf DLRM-DCNv2's
(bottom MLP 512-256-128, 3 low-rank cross layers of rank 512, top MLP 1024-1024-512-256-1)
over the suite's concatenated embedding width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sharding.activations import dcnv2_activation_bytes
from sharding.types import FLOAT_BYTES, Coverage, PowerLawCoverage, TableStats

DENSE_IN = 13  # Criteo's dense features
BOTTOM = (512, 256, 128)
TOP = (1024, 1024, 512, 256, 1)
CROSS_LAYERS, CROSS_RANK = 3, 512


@dataclass(frozen=True)
class SuiteSpec:
    """Ranges a random suite is drawn from (each pair: low, high)."""

    tables: tuple[int, int] = (10, 1000)  # log-uniform
    rows: tuple[float, float] = (1e2, 1e8)  # log-uniform
    dims: tuple[int, ...] = (16, 32, 64, 128, 256)
    pooling: tuple[float, float] = (1.0, 100.0)  # lookups per sample, log-uniform
    skew: tuple[float, float] = (0.6, 1.3)  # power-law exponent, uniform
    weights_gb: tuple[float, float] = (1.0, 400.0)  # the suite's size at most, log-uniform


@dataclass
class Workload:
    name: str
    tables: list[TableStats]
    coverage: dict[str, Coverage]
    dense_params: int
    interaction_flops_per_sample: float = 0.0
    activation_bytes_per_sample: float = 0.0  # the dense part's, saved for backward
    source: dict = field(default_factory=dict)  # how it was made, for the report

    def weights_bytes(self) -> int:
        return sum(t.rows * t.dim * FLOAT_BYTES for t in self.tables)


def dcnv2_dense_params(embedding_width: int) -> int:
    """Parameters of MLPerf DLRM-DCNv2's dense part over `embedding_width` pooled floats."""

    def mlp(n_in: int, sizes: tuple[int, ...]) -> int:
        total = 0
        for n_out in sizes:
            total += n_in * n_out + n_out
            n_in = n_out
        return total

    width = BOTTOM[-1] + embedding_width
    cross = CROSS_LAYERS * (2 * width * CROSS_RANK + width)
    return mlp(DENSE_IN, BOTTOM) + cross + mlp(width, TOP)


def random_suite(seed: int, spec: SuiteSpec | None = None) -> Workload:
    spec = spec or SuiteSpec()
    rng = np.random.default_rng(seed)

    def log_uniform(lo: float, hi: float, n: int | None = None):
        return np.exp(rng.uniform(np.log(lo), np.log(hi), n))

    n = int(round(log_uniform(*spec.tables)))
    rows = log_uniform(*spec.rows, n)
    dims = rng.choice(spec.dims, n)
    pooling = log_uniform(*spec.pooling, n)
    skew = rng.uniform(*spec.skew, n)
    budget = log_uniform(*spec.weights_gb) * 2**30
    size = float(np.sum(rows * dims * FLOAT_BYTES))
    if size > budget:
        rows = np.maximum(spec.rows[0], rows * budget / size)
    tables = [
        TableStats(f"t{i}", int(r), int(d), float(p))
        for i, (r, d, p) in enumerate(zip(rows, dims, pooling, strict=True))
    ]
    coverage = {
        t.name: PowerLawCoverage(t.rows, float(e)) for t, e in zip(tables, skew, strict=True)
    }
    return Workload(
        name=f"random_{seed}",
        tables=tables,
        coverage=coverage,
        dense_params=dcnv2_dense_params(int(dims.sum())),
        activation_bytes_per_sample=dcnv2_activation_bytes(
            DENSE_IN, BOTTOM, int(dims.sum()), CROSS_LAYERS, CROSS_RANK, TOP
        ),
        source={
            "seed": seed,
            "tables": n,
            "skew": [float(skew.min()), float(skew.max())],
            "weights_gb": size / 2**30 if size <= budget else budget / 2**30,
        },
    )
