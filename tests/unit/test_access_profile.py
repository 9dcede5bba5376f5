"""Access profiles: exact on known distributions, bounded error when sketched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recsys.data.planted import power_law_ranks
from sharding.access_profile import AccessProfile, build_profile


def power_law_batches(rows: int, exponent: float, batches: int, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(batches):
        yield batch, {"t": power_law_ranks(rng.random(batch), rows, exponent)}


def test_coverage_matches_the_known_distribution() -> None:
    rows, e = 10_000, 1.1
    profile = build_profile(power_law_batches(rows, e, 50, 4000), {"t": rows})
    t = profile.table("t")
    assert t.counting == "exact" and t.max_count_error == 0
    assert t.lookups == 200_000 and t.lookups_per_sample == pytest.approx(1.0)
    cdf = lambda k: ((k + 1) ** (1 - e) - 1) / ((rows + 1) ** (1 - e) - 1)  # noqa: E731
    for label, f in {"0.1%": 0.001, "1%": 0.01, "10%": 0.1}.items():
        assert t.coverage[label] == pytest.approx(cdf(f * rows), abs=0.01), label
    assert t.hot_ids[:5] == [0, 1, 2, 3, 4]  # rank k is id k in this generator
    assert t.hit_rate(100) == pytest.approx(cdf(100), abs=0.01)
    assert t.hit_rate(0) == 0.0 and t.hit_rate(rows) == 1.0
    assert 0 < t.distinct_per_batch < 4000


def test_sketch_counts_stay_within_the_stated_error() -> None:
    rows = 50_000
    batches = list(power_law_batches(rows, 1.05, 40, 2000, seed=1))
    exact = build_profile(batches, {"t": rows}).table("t")
    small = {"exact_max_rows": 1000, "sketch_capacity": 500}
    sketched = build_profile(batches, {"t": rows}, **small).table("t")
    assert sketched.counting == "misra_gries"
    assert sketched.max_count_error == 80_000 // 501
    true_counts = np.bincount(np.concatenate([b[1]["t"] for b in batches]), minlength=rows)
    # the heavy hitters are found, and coverage is low by at most capacity x error / N
    assert set(sketched.hot_ids[:20]) == set(exact.hot_ids[:20])
    slack = 500 * sketched.max_count_error / sketched.lookups
    for label in ("0.1%", "1%"):
        assert exact.coverage[label] - slack <= sketched.coverage[label] <= exact.coverage[label]
    assert true_counts[exact.hot_ids[0]] >= true_counts[exact.hot_ids[1]]


def test_out_of_range_ids_and_bad_files_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"ids outside \[0, 10\)"):
        build_profile([(1, {"t": np.array([10])})], {"t": 10})
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(ValueError, match="not a profile.json"):
        AccessProfile.load(tmp_path / "p.json")


def _kjt(bags: list[list[int]]):
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=["f"],
        values=torch.tensor([i for b in bags for i in b]),
        lengths=torch.tensor([len(b) for b in bags]),
    )


def test_distinct_ids_per_micro_batch_are_counted_in_data_order_and_clustered() -> None:
    from recsys.app.profile import MicroBatchDistinct, micro_sizes_to_count

    assert micro_sizes_to_count(512, 64) == [64, 128, 256, 512]
    assert micro_sizes_to_count(96, 30) == [32]  # powers of two that divide the batch
    # ids 1 and 2 alternate: each half of the batch holds both in data order; clustered,
    # the samples of each id share a micro-batch (a multi-hot bag and an empty one too)
    bags = [[1], [2], [1, 1], [2], [1], [], [1], [2]]
    counter = MicroBatchDistinct(["f"], [4, 8])
    counter.add(_kjt(bags))
    profile = build_profile([(8, {"t_f": np.array([1, 2, 1, 1, 2, 1, 1, 2])})], {"t_f": 10})
    counter.write_into(profile)
    t = profile.table("t_f")
    assert t.distinct_per_samples == {"4": 2.0, "8": 2.0}
    assert t.distinct_per_samples_clustered == {"4": 1.0, "8": 2.0}
    assert t.distinct(4) == 2.0 and t.distinct(4, clustered=True) == 1.0
    assert t.distinct(6, clustered=True) == pytest.approx(1.5)  # 1 at 4, 2 at 8: log-log


def test_distinct_interpolates_log_log_and_is_none_unmeasured() -> None:
    profile = build_profile([(4, {"t": np.array([0, 1, 2, 3])})], {"t": 10})
    t = profile.table("t")
    assert t.distinct(64) is None
    t.distinct_per_samples = {"64": 40.0, "256": 100.0}
    assert t.distinct(64) == pytest.approx(40.0) and t.distinct(256) == pytest.approx(100.0)
    assert t.distinct(128) == pytest.approx(np.sqrt(40.0 * 100.0))  # the geometric middle
