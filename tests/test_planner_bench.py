"""The planner benchmark: its grid summary, and one small run of the command end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.planner_grid import summarize, table

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "benchmarks" / "results" / "planners" / "profile_mlperf_synthetic.json"


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


@pytest.mark.slow
def test_a_small_benchmark_run_writes_the_names_checks_rely_on(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.planners", "clusters=[hetero_3node]",
         "at_scale=false", "grid.cells=4", "grid.clusters=[hetero_3node,1x8_a100_80g]",
         "grid.torchrec_timeout_s=5", f"grid.profile={PROFILE}", f"results_dir={tmp_path}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "summary.json").exists()  # published results only with save=true
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    p = s["presets"]["hetero_3node"]
    assert p["hybrid_ms"] < p["torchrec_ms"]  # the mixed preset: speed shares alone pay
    assert p["lower_bound_ms"] <= p["hybrid_ms"]
    assert p["torchrec_own_best_ms"] >= p["torchrec_ms"]  # the best rated, by definition
    steps = [d["step"] for d in p["decomposition"]]
    assert steps[0] == "torchrec" and steps[-1] == "+row_parts"
    assert p["decomposition"][-1]["ms"] == pytest.approx(p["hybrid_ms"])
    cells = s["grid"]["cells"]
    assert len({(c["suite"], c["cluster"]) for c in cells}) == 4
    assert {c["planner"] for c in cells} == {"hybrid", "torchrec", "torchrec_own",
                                             "greedy_size", "round_robin"}  # fmt: skip
    assert set(s["grid"]["wins"]) == {c["planner"] for c in cells}
    assert isinstance(s["grid"]["hybrid_losses"], list)
    run = tmp_path / "run"
    assert (run / "grid.csv").read_text().count("\n") == len(cells) + 1
    assert (run / "grid.png").stat().st_size > 10_000
    assert (run / "planner_gains.png").stat().st_size > 10_000
    assert "## Grid: 4 cells" in (run / "planners.md").read_text()
