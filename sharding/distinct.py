"""What the nested pipeline's deduplicated exchange sends, from a profile.

With `pipeline.dedup=true` (`pipelines/dedup.py`) a requester routes each micro-batch's
distinct ids of a table-wise or column-wise table, instead of every id, and the owner sends
one row per distinct id, instead of one pooled vector per sample. For a micro-batch of s
samples and a table with L lookups per sample, D(s) distinct ids:
- ids sent: D(s) instead of s L (lengths still go),
- vectors sent (and gradients back): D(s) rows instead of s pooled vectors; more than
  without dedup when D(s) > s (multi-hot bags of rarely repeated ids).

D(s) comes from the profile: measured by `sharding.profile` in data order and after
key-centric clustering (`TableProfile.distinct`); for a profile without those counts, or the
parametric power law, the expected distinct ids of s L independent draws from the table's
coverage curve (`expected_distinct`; clustering needs the measurement: it depends on which
ids samples share, which a frequency curve does not hold).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from sharding.access_profile import AccessProfile
from sharding.types import FLOAT_BYTES, ID_BYTES, Coverage, Plan, PlanInputs, StepCost


def expected_distinct(coverage: Coverage, rows: int, draws: float, points: int = 64) -> float:
    """Expected distinct rows in `draws` independent lookups whose hottest k rows take
    `coverage(k)` of the lookups: the sum over rows of 1 - (1 - p)^draws, with p constant
    within log-spaced bands of rows."""
    if draws <= 0 or rows <= 0:
        return 0.0
    ks = np.unique(np.round(np.geomspace(1, rows, points)).astype(np.int64))
    edges = np.concatenate([[0], ks])
    shares = np.array([coverage(int(k)) for k in edges])
    width = np.diff(edges).astype(np.float64)
    p = np.clip(np.diff(shares) / width, 0.0, 1.0)
    return float(np.sum(width * -np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-12)))))


@dataclass(frozen=True)
class DedupVolume:
    """Per rank: what dedup's exchange sends relative to the pooled one, ids and vectors."""

    ids: list[float]
    vectors: list[float]
    source: str  # "measured", "measured, clustered" or "coverage curve"


def dedup_volume(
    plan: Plan,
    inputs: PlanInputs,
    micro_batches: int,
    profile: AccessProfile | None = None,
    clustered: bool = False,
) -> DedupVolume:
    """Each rank's micro-batch (its batch / N) priced with D(s) per table, weighted by each
    exchanged shard's bytes (its columns for vectors, its lookups for ids). Data-parallel,
    table-row-wise and sequence-exchanged shards are not deduplicated (the pipeline
    refuses dedup for those groups) and keep their volume."""
    if clustered and not _measured(profile, clustered=True):
        raise ValueError(
            "dedup with clustering needs distinct ids measured after clustering: pass a "
            "profile.json written by python -m sharding.profile (it measures them)"
        )
    by_name = {t.name: t for t in inputs.tables}
    shards = [s for s in plan.shards() if not s.dp]
    ratios: dict[float, tuple[float, float]] = {}  # per micro-batch size: (ids, vectors)
    for b in plan.batch_per_rank:
        samples = max(b / max(1, micro_batches), 1.0)
        if samples in ratios:
            continue
        ids_w = ids_new = vec_w = vec_new = 0.0
        distinct: dict[str, float] = {}
        for s in shards:
            t = by_name[s.table]
            ids = t.lookups_per_sample * samples
            ids_w += ids * ID_BYTES
            vec_w += s.cols * FLOAT_BYTES * samples
            if s.node_reduce or s.sparse_exchange:
                ids_new += ids * ID_BYTES
                vec_new += s.cols * FLOAT_BYTES * samples
                continue
            if t.name not in distinct:
                distinct[t.name] = _distinct(
                    t.name, t.rows, ids, samples, inputs, profile, clustered
                )
            d = distinct[t.name]
            ids_new += min(d, ids) * ID_BYTES
            vec_new += s.cols * FLOAT_BYTES * d
        ratios[samples] = (ids_new / ids_w if ids_w else 1.0, vec_new / vec_w if vec_w else 1.0)
    per_rank = [ratios[max(b / max(1, micro_batches), 1.0)] for b in plan.batch_per_rank]
    ids_out, vec_out = [r[0] for r in per_rank], [r[1] for r in per_rank]
    measured = _measured(profile, clustered)
    source = ("measured, clustered" if clustered else "measured") if measured else "coverage curve"
    return DedupVolume(ids_out, vec_out, source)


def _measured(profile: AccessProfile | None, clustered: bool) -> bool:
    if profile is None or not profile.tables:
        return False
    t = profile.tables[0]
    return bool(t.distinct_per_samples_clustered if clustered else t.distinct_per_samples)


def _distinct(
    name: str,
    rows: int,
    lookups: float,
    samples: float,
    inputs: PlanInputs,
    profile: AccessProfile | None,
    clustered: bool,
) -> float:
    if profile is not None:
        measured = profile.table(name).distinct(samples, clustered)
        if measured is not None:
            return measured
    return expected_distinct(inputs.coverage[name], rows, lookups)


def with_dedup(cost: StepCost, volume: DedupVolume, grads: bool = True) -> StepCost:
    """`cost` with each rank's id and embedding exchange scaled by dedup's volume (its
    latency too: a first-order model, documented in docs/scale.md). `grads=False`
    (`pipeline.dedup_grads=false`): the forward exchange only; every id is routed and the
    gradients go back pooled (the parts and CPU work of both directions: their mean)."""
    scale = lambda xs, f: [x * k for x, k in zip(xs, f, strict=True)]  # noqa: E731
    ones = [1.0] * len(volume.ids)
    ids = volume.ids if grads else ones
    both = volume.vectors if grads else [(1.0 + v) / 2 for v in volume.vectors]
    by_exchange = {"ids": ids, "emb": both}  # the all-reduce keeps its bytes
    return replace(
        cost,
        ids_a2a_s=scale(cost.ids_a2a_s, ids),
        emb_a2a_fwd_s=scale(cost.emb_a2a_fwd_s, volume.vectors),
        emb_a2a_bwd_s=scale(cost.emb_a2a_bwd_s, volume.vectors if grads else ones),
        ids_a2a_parts_s={k: scale(v, ids) for k, v in cost.ids_a2a_parts_s.items()},
        emb_a2a_parts_s={k: scale(v, both) for k, v in cost.emb_a2a_parts_s.items()},
        comm_cpu_s={
            k: scale(v, by_exchange[k]) if k in by_exchange else v
            for k, v in cost.comm_cpu_s.items()
        },
    )
