"""The planner benchmark's grid summary."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.planner_grid import summarize, table


def _row(suite: str, cluster: str, planner: str, ms: float | None) -> dict:
    return {
        "suite": suite,
        "cluster": cluster,
        "planner": planner,
        "tables": 10,
        "feasible": ms is not None,
        "est_step_ms": ms if ms is not None else 0.0,
        "planning_s": 0.5,
    }


def _cell(suite: str, cluster: str, **ms: float | None) -> list[dict]:
    planners = {
        "hybrid": None,
        "torchrec": None,
        "torchrec_own": None,
        "greedy_size": None,
        "round_robin": None,
        **ms,
    }
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
    assert g["cell_seconds"] == pytest.approx(5 * 4 * 0.5)  # torchrec_own: torchrec's search
    assert g["wins"] == {
        "hybrid": 2,
        "torchrec": 1,
        "torchrec_own": 0,
        "greedy_size": 1,
        "round_robin": 0,
    }
    losses = {(x["suite"], x["planner"], x["hybrid_ms"]) for x in g["hybrid_losses"]}
    assert losses == {("b", "torchrec", 2.0), ("d", "greedy_size", None)}
    assert g["worst_vs_torchrec"]["suite"] == "b"
    assert g["worst_vs_torchrec"]["speedup_vs_torchrec"] == pytest.approx(0.75)
    c1, c2 = g["clusters"]["c1"], g["clusters"]["c2"]
    assert c1["median_speedup_vs_torchrec"] == pytest.approx((2.0 + 0.75) / 2)
    assert (c2["hybrid_feasible"], c2["torchrec_feasible"], c2["only_hybrid_fits"]) == (1, 0, 0)
    text = "\n".join(table(g))
    assert "Cells where another planner beats hybrid by more than 0.5%: 2; ties" in text
    assert "d on c2: greedy_size 5.00 ms vs hybrid no plan" in text


def test_a_rival_within_half_a_percent_is_a_tie_not_a_loss() -> None:
    rows = _cell("a", "c", hybrid=1.0, torchrec=0.998) + _cell("b", "c", hybrid=1.0, torchrec=0.99)
    g = summarize(rows)
    assert [x["suite"] for x in g["hybrid_ties"]] == ["a"]
    assert [x["suite"] for x in g["hybrid_losses"]] == ["b"]
    assert g["wins"]["hybrid"] == 1 and g["wins"]["torchrec"] == 2  # a tie counts to each


def test_the_gap_to_the_bound_counts_only_plans_that_fit() -> None:
    """A plan that does not fit has a predicted step and a bound too; the grid's median
    and largest gap are over hybrid's feasible plans."""
    rows = _cell("a", "c", hybrid=1.2) + _cell("b", "c", hybrid=1.5) + _cell("c", "c")
    for r, gap in zip([r for r in rows if r["planner"] == "hybrid"], (1.2, 1.5, 9.0), strict=True):
        r["gap_to_bound"] = gap  # cell c: hybrid's plan overflows memory
    rows += _cell("d", "other", hybrid=2.0)
    rows[-5]["gap_to_bound"] = 1.01
    g = summarize(rows)
    assert g["median_gap_to_bound"] == pytest.approx(1.2)  # 1.01, 1.2, 1.5
    assert g["max_gap_to_bound"] == pytest.approx(1.5)
    # per cluster too (a layout's cells, e.g. the mixed ones joined by slow links)
    assert g["clusters"]["c"]["median_gap_to_bound"] == pytest.approx(1.35)
    assert g["clusters"]["other"]["median_gap_to_bound"] == pytest.approx(1.01)

    # and over the cells of the mixed clusters joined by slow links, each cell listed
    g = summarize(rows, slow=["c"])
    sm = g["slow_mixed"]
    assert sm["clusters"] == ["c"] and sm["median_gap_to_bound"] == pytest.approx(1.35)
    assert [(c["suite"], c["gap_to_bound"]) for c in sm["cells"]] == [("a", 1.2), ("b", 1.5)]
    assert "(c; 2 cells hybrid fits) hybrid's gap to the lower bound: median 1.350x" in "\n".join(
        table(g)
    )


def test_slow_mixed_clusters_have_mixed_devices_on_several_nodes_joined_slowly() -> None:
    from types import SimpleNamespace as NS

    from benchmarks.planner_grid import slow_mixed

    def cluster(kinds_by_node: list[list[str]], gbit_s: float) -> NS:
        ranks = [NS(kind=k, node=n) for n, kinds in enumerate(kinds_by_node) for k in kinds]
        return NS(ranks=ranks, network=NS(alltoall=NS(bytes_per_s=gbit_s * 1e9 / 8)))

    assert slow_mixed(cluster([["h100", "h100"], ["t4"]], 25.0))
    assert not slow_mixed(cluster([["h100", "h100"], ["t4"]], 26.0))  # a fast link
    assert not slow_mixed(cluster([["h100"], ["h100"]], 10.0))  # one kind
    assert not slow_mixed(cluster([["h100", "t4"]], 10.0))  # one node


def test_the_grid_goes_on_from_the_cells_a_stopped_run_wrote(tmp_path, capsys) -> None:
    """Each cell is written as it finishes; run again, the grid plans only the cells it
    lacks, and a file of another grid is refused."""
    from test_planners import NET, inputs_for

    from benchmarks.planner_grid import CELLS_FILE, GridConfig, run_grid
    from sharding.errors import UserError
    from sharding.suites import SuiteSpec, random_suite
    from sharding.types import ClusterSpec, DeviceGroup, NodeGroup

    spec = SuiteSpec(tables=(3, 4), rows=(100, 1000), weights_gb=(0.001, 0.002))
    node = NodeGroup(host_memory_gib=4, devices=[DeviceGroup("a100_80g", 2)])
    cluster = inputs_for(ClusterSpec(name="two", nodes=[node], network=NET), [])
    cfg = GridConfig(cells=2, clusters=["two"], workers=1, torchrec_timeout_s=5, spec=spec)
    named = [random_suite(100, spec)]
    first = run_grid(cfg, {"two": cluster}, named, tmp_path)
    assert first["cell_count"] == 2 and first["cells_resumed"] == 0
    assert first["cell_seconds"] <= first["elapsed_s"]  # one worker: cells one after another
    assert all(r["search_limit_s"] >= 5 for r in first["cells"] if r["planner"] == "torchrec")
    lines = (tmp_path / CELLS_FILE).read_text().splitlines()
    assert len(lines) == 3  # the grid's settings, then one line a cell
    (tmp_path / CELLS_FILE).write_text("\n".join(lines[:2]) + "\n")  # stopped after one
    capsys.readouterr()
    again = run_grid(cfg, {"two": cluster}, named, tmp_path)
    assert "1 of 2 cells from" in capsys.readouterr().out
    assert again["cells_resumed"] == 1
    key = lambda r: (r["suite"], r["planner"])  # noqa: E731
    assert sorted(map(key, again["cells"])) == sorted(map(key, first["cells"]))
    with pytest.raises(UserError, match="another grid .*seed"):
        run_grid(GridConfig(**{**cfg.__dict__, "seed": 7}), {"two": cluster}, named, tmp_path)
    only_slow = run_grid(
        replace(cfg, only_slow_mixed=True), {"two": cluster}, named, tmp_path / "slow"
    )
    assert only_slow["cell_count"] == 0  # "two" is one node of one kind
    bigger = replace(cluster, global_batch=2 * cluster.global_batch)  # same name, other cells
    with pytest.raises(UserError, match="another grid .*clusters"):
        run_grid(cfg, {"two": bigger}, named, tmp_path)


def test_the_planning_time_goals_are_planned_and_timed() -> None:
    """`at_scale`'s other cases: random tables on 16 H100 ranks, MLPerf's multi-hot tables on
    512 H100s; each plan feasible, at or above its bound, its planning time recorded."""
    from hydra import initialize_config_dir

    from benchmarks.planners import PlannerBenchConfig, planning_time_goals
    from recsys import CONF_DIR
    from recsys.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        goals = planning_time_goals(PlannerBenchConfig(scale_tables=12))
    assert list(goals) == ["12_tables_16_ranks", "mlperf_multihot_512_h100"]
    assert [(g["tables"], g["devices"]) for g in goals.values()] == [(12, 16), (26, 512)]
    for g in goals.values():
        assert g["feasible"] and g["planning_s"] > 0
        assert g["est_step_ms"] >= g["lower_bound_ms"] * (1 - 1e-9)


def test_the_recheck_takes_the_cut_cells_closest_to_a_torchrec_win() -> None:
    """benchmarks.grid_recheck: only cells whose TorchRec search was cut and where both
    planners fit, hybrid's smallest lead first; its table says how many verdicts changed."""
    from benchmarks.grid_recheck import closest_cut_cells
    from benchmarks.grid_recheck import table as recheck_table

    rows = (
        _cell("a", "c", hybrid=1.0, torchrec=2.0)
        + _cell("b", "c", hybrid=1.0, torchrec=1.1)
        + _cell("c", "c", hybrid=1.0, torchrec=1.01)
        + _cell("d", "c", hybrid=None, torchrec=1.0)
    )
    for r in rows:
        if r["planner"] == "torchrec":
            r["search_cut"], r["search_s"] = r["suite"] != "c", 31.0  # c ran to its end
    chosen = closest_cut_cells(rows, 5)
    assert [c["suite"] for c in chosen] == ["b", "a"]
    cell = {
        **chosen[0],
        "torchrec_longer_ms": 0.9,
        "search_s": 240.0,
        "cut_again": True,
        "verdict_changed": True,
    }
    result = {
        "config": {"limit_s": 240.0, "cells": 1},
        "environment": {"date": "today"},
        "cells": [cell],
        "changed": 1,
    }
    text = recheck_table(result)
    assert "Verdicts changed (TorchRec faster than hybrid by more than 0.5%): 1 of 1." in text
    assert "| c | b | 10 | 1.00 | 1.10 | 31 | 0.90 | 240 | yes | 0.900x |" in text


def test_each_preset_is_also_planned_leaving_devices_out() -> None:
    """Beside every planner on every device: hybrid as it plans by default (weighing parts
    of the cluster) and TorchRec's planner on the fastest part, each at the same global
    batch, naming the ranks it leaves out."""
    from hydra import initialize_config_dir

    from benchmarks import planners as bench
    from recsys import CONF_DIR

    cfg = bench.PlannerBenchConfig(model="dlrm_small", precision="fp32", at_scale=False)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        out = bench.preset(cfg, "emu_mixed4")
    p = out["planners"]
    assert p["torchrec@best_part"]["left_out"] in ([0, 1], [2, 3])
    assert p["hybrid"]["left_out"] == [] and p["torchrec"]["left_out"] == []
    whole_or_part = p["hybrid+parts"]
    assert whole_or_part["est_step_ms"] <= p["hybrid"]["est_step_ms"] * 1.001
    assert sum(whole_or_part["batch_range"]) > 0
