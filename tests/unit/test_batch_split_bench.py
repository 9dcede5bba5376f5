"""`benchmarks.batch_split`: the splits it trains keep the global batch and move samples
between the slower and the fastest ranks as asked; a cluster of equal ranks is refused."""

from __future__ import annotations

import pytest

from benchmarks.batch_split import split_with, table


def test_a_shift_moves_each_slower_ranks_share_to_the_fastest_ranks() -> None:
    # emu_mixed4's shape: two fast ranks, two slow; 30% of each slow rank's 1362 is 409
    assert split_with([2734, 2734, 1362, 1362], [0.46, 0.46, 0.22, 0.22], 0.3) == [
        3143,
        3143,
        953,
        953,
    ]
    # one fast rank takes all of it; the remainder of an uneven share goes to the first
    assert split_with([3450, 1347, 1347], [0.62, 0.22, 0.22], 0.3) == [4258, 943, 943]
    assert split_with([10, 10, 1], [1.0, 1.0, 0.5], 1.0) == [10, 10, 1]  # keeps one sample
    odd = split_with([100, 100, 51, 50], [1.0, 1.0, 0.5, 0.5], 0.5)
    assert odd == [126, 125, 25, 25] and sum(odd) == 301  # 26 + 25 moved, 1 left over


def test_a_negative_shift_moves_samples_back_to_the_slower_ranks() -> None:
    back = split_with([3450, 1347, 1347], [0.62, 0.22, 0.22], -0.15)
    assert back == [3046, 1549, 1549] and sum(back) == 6144


def test_equal_ranks_have_no_split_to_move() -> None:
    with pytest.raises(ValueError, match="every rank is as fast as the fastest"):
        split_with([1024, 1024], [1.0, 1.0], 0.2)


def test_the_table_names_the_fastest_split_measured_and_predicted() -> None:
    rows = [
        {
            "split": "torchrec",
            "batch_per_rank": [2, 2],
            "predicted_ms": 30.0,
            "runs": [25.0],
            "measured_ms": 25.0,
            "error": 0.2,
        },
        {
            "split": "hybrid's",
            "batch_per_rank": [3, 1],
            "predicted_ms": 20.0,
            "runs": [21.0, 19.0],
            "measured_ms": 20.0,
            "error": 0.0,
        },
        {
            "split": "+0.50",
            "batch_per_rank": [4, 0],
            "predicted_ms": 22.0,
            "runs": [16.0],
            "measured_ms": 16.0,
            "error": 0.375,
        },
    ]
    result = {
        "rows": rows,
        "best_measured": "+0.50",
        "best_predicted": "hybrid's",
        "best_vs_hybrids": 1.25,
        "median_abs_error": 0.2,
        "environment": {"date": "today", "torch": "t", "torchrec": "r"},
        "config": {"cluster": {"name": "emu_mixed3"}, "overrides": ["b"], "steps": 9, "repeats": 2},
    }
    text = table(result)
    assert "| hybrid's | [3, 1] | 20.0 | 20.0 (21.0, 19.0) | +0% | 1.00x |" in text
    assert "| +0.50 | [4, 0] | 22.0 | 16.0 (16.0) | +38% | 1.25x |" in text
    assert "Fastest measured: +0.50; fastest predicted: hybrid's" in text


def test_the_pictures_labels_name_each_split_by_its_runs_of_equal_ranks() -> None:
    from benchmarks.plots import _runs

    assert _runs([2731, 2731, 1365, 1365]) == "2731x2/1365x2"
    assert _runs([3558, 1293, 1293]) == "3558/1293x2"
    assert _runs([5, 6, 5]) == "5/6/5"
