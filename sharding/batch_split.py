"""How a step's global batch is split over ranks: equally, in proportion to speed, or in
proportion to speed with a cap on any one rank's share (water-filling)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

import sharding.cost_model as cost_model

if TYPE_CHECKING:
    from sharding.types import PlanInputs


def equal_batch(global_batch: int, world: int) -> list[int]:
    base, extra = divmod(global_batch, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def proportional_batch(global_batch: int, weights: list[float]) -> list[int]:
    """Split the batch by weight, largest remainders first; every rank gets at least 1."""
    w = np.asarray(weights, dtype=np.float64)
    raw = global_batch * w / w.sum()
    out = np.maximum(1, np.floor(raw)).astype(int)
    for r in np.argsort(-(raw - np.floor(raw)))[: global_batch - int(out.sum())]:
        out[r] += 1
    while out.sum() > global_batch:  # the floor of 1 overshot: take from the largest
        out[int(np.argmax(out))] -= 1
    return out.tolist()


def dense_s_per_sample(inputs: PlanInputs) -> np.ndarray:
    """Per rank: seconds of dense work (MLPs and feature interaction) per sample."""
    return np.array(
        [
            cost_model.dense_s_per_sample(
                d, inputs.dense_params, inputs.interaction_flops_per_sample
            )
            for d in inputs.devices
        ]
    )


def capped_time(global_batch: int, sample_s: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Per cap: the least T with sum_r min(cap, T / sample_s[r]) >= global_batch, i.e. the
    dense stage of the best split that gives no rank more than `cap` samples (continuous)."""
    caps = np.atleast_1d(np.asarray(caps, dtype=np.float64))
    lo = np.full_like(caps, global_batch / np.sum(1.0 / sample_s))  # uncapped: proportional
    hi = caps * sample_s.max()  # every rank at the cap (needs cap >= global_batch / world)
    for _ in range(60):
        mid = (lo + hi) / 2
        enough = np.minimum(caps[:, None], mid[:, None] / sample_s[None, :]).sum(1) >= global_batch
        hi, lo = np.where(enough, mid, hi), np.where(enough, lo, mid)
    return hi


def capped_batch(global_batch: int, sample_s: np.ndarray, cap: int) -> list[int]:
    """Shares in proportion to speed (1 / sample_s), but none above `cap` samples: the rest
    goes to the slower ranks, still in proportion (water-filling); integers summing up."""
    cap = max(int(cap), math.ceil(global_batch / len(sample_s)))
    t = float(capped_time(global_batch, sample_s, np.array([cap]))[0])
    raw = np.minimum(cap, t / sample_s)
    raw *= global_batch / raw.sum()
    out = np.minimum(cap, np.maximum(1, np.floor(raw))).astype(int)
    order = np.argsort(-(raw - np.floor(raw)))
    while out.sum() < global_batch:  # largest remainders first, never past the cap
        for r in order:
            if out.sum() < global_batch and out[r] < cap:
                out[r] += 1
    while out.sum() > global_batch:
        out[int(np.argmax(out))] -= 1
    return out.tolist()
