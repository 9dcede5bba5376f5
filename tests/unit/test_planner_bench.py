"""The planner benchmark's grid summary."""

from __future__ import annotations

import pytest

from benchmarks.planner_grid import summarize, table


def _row(suite: str, cluster: str, planner: str, ms: float | None) -> dict:
    return {"suite": suite, "cluster": cluster, "planner": planner, "tables": 10,
            "feasible": ms is not None, "est_step_ms": ms if ms is not None else 0.0}  # fmt: skip


def _cell(suite: str, cluster: str, **ms: float | None) -> list[dict]:
    planners = {"hybrid": None, "torchrec": None, "torchrec_own": None, "greedy_size": None,
                "round_robin": None, **ms}  # fmt: skip
    return [_row(suite, cluster, p, v) for p, v in planners.items()]


def test_summary_lists_each_losing_cell_once_with_its_fastest_rival() -> None:
    rows = (
        _cell("a", "c1", hybrid=1.0, torchrec=2.0, torchrec_own=2.5, greedy_size=3.0)
        + _cell("b", "c1", hybrid=2.0, torchrec=1.5, torchrec_own=1.8, round_robin=1.9)
        + _cell("c", "c2", hybrid=4.0, torchrec=None, greedy_size=5.0)
        + _cell("d", "c2", hybrid=None, greedy_size=5.0)  # hybrid finds no plan: a loss
        + _cell("e", "c2")  # nobody fits
    )
    g = summarize(rows)
    assert g["cell_count"] == 5
    assert g["wins"] == {"hybrid": 2, "torchrec": 1, "torchrec_own": 0, "greedy_size": 1,
                         "round_robin": 0}  # fmt: skip
    losses = {(x["suite"], x["planner"], x["hybrid_ms"]) for x in g["hybrid_losses"]}
    assert losses == {("b", "torchrec", 2.0), ("d", "greedy_size", None)}
    assert g["worst_vs_torchrec"]["suite"] == "b"
    assert g["worst_vs_torchrec"]["speedup_vs_torchrec"] == pytest.approx(0.75)
    c1, c2 = g["clusters"]["c1"], g["clusters"]["c2"]
    assert c1["median_speedup_vs_torchrec"] == pytest.approx((2.0 + 0.75) / 2)
    assert (c2["hybrid_feasible"], c2["torchrec_feasible"], c2["only_hybrid_fits"]) == (1, 0, 0)
    text = "\n".join(table(g))
    assert "Cells where another planner beats hybrid: 2." in text
    assert "d on c2: greedy_size 5.00 ms vs hybrid no plan" in text
