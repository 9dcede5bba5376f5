"""Parts of a cluster (`sharding/subsets.py`) and hybrid's weighing of them: a user may train
on some ranks of a layout (`cluster.only_ranks`), and hybrid keeps the fastest of its plan on
every device and on each part worth weighing, saying which it weighed and what it left out."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import cluster_of

from sharding.cluster import ClusterConfigError, resolve_cluster
from sharding.subsets import candidates, parse, subset, subset_name


def test_a_part_keeps_its_ranks_devices_and_host_memory_per_device():
    spec = cluster_of("hetero_3node")
    ranks = resolve_cluster(spec)
    keep = [0, 1, 8, 9, 10]  # two of node 0's devices, three of node 1's
    part = subset(spec, keep)
    assert part.name == "hetero_3node@ranks_0_1_8_9_10" and parse(part.name) == (
        "hetero_3node",
        keep,
    )
    got = resolve_cluster(part)
    assert [r.kind for r in got] == [ranks[r].kind for r in keep]
    assert [r.node for r in got] == [0, 0, 1, 1, 1]
    assert [r.host_bytes for r in got] == pytest.approx(
        [ranks[r].host_bytes for r in keep], rel=1e-9
    )
    assert part.network == spec.network and subset_name("x", [2]) == "x@ranks_2"
    assert subset(part, [2, 4]).name == "hetero_3node@ranks_8_10"  # the whole's numbering
    with pytest.raises(ClusterConfigError, match="has ranks 0-23"):
        subset(spec, [24])


def test_only_ranks_trains_and_plans_on_that_part(typed_cfg):
    cfg = typed_cfg(["cluster=emu_mixed4", "cluster.only_ranks=[0,1]"])
    assert cfg.cluster.name == "emu_mixed4@ranks_0_1" and cfg.cluster.only_ranks is None
    assert [r.share for r in resolve_cluster(cfg.cluster)] == [0.6, 0.6]


def test_the_parts_weighed_are_node_sets_and_the_fastest_kinds_each_once():
    assert candidates(cluster_of("emu_mixed4")) == [([0, 1], "node 0"), ([2, 3], "node 1")]
    assert candidates(cluster_of("local_cpu2")) == []  # one node, one kind: nothing to leave
    # two alike nodes: either one is the same part
    assert [w for _, w in candidates(cluster_of("2x8_h100"))] == ["node 0"]
    skewed = candidates(cluster_of("local_cpu3_skewed"))
    assert skewed == [([2], "the fastest device kind: cpu")]
    big = candidates(cluster_of("hetero_64"))  # many nodes: the fastest first
    node_sets = [k for k, what in big if what.startswith("node")]
    assert [len(k) for k in node_sets] == [8, 16, 24, 32, 40, 48, 56]  # 8 nodes of 8
    assert all(set(a) < set(b) for a, b in zip(node_sets, node_sets[1:], strict=False))


def test_a_part_is_priced_with_the_whole_clusters_calibration_unless_it_has_its_own(typed_cfg):
    from recsys.app.planning import plan_inputs
    from sharding.calibration import load_calibration

    cal = load_calibration()

    def on(ranks: str, calibration=cal):
        cfg = typed_cfg(["cluster=emu_mixed4", f"cluster.only_ranks=[{ranks}]"])
        return plan_inputs(cfg, None, None, calibration)

    whole = plan_inputs(typed_cfg(["cluster=emu_mixed4"]), None, None, cal)
    one_node, two_nodes = on("0,1"), on("0,2")
    assert one_node.devices == whole.devices[:2]  # each share's rates as measured there
    assert one_node.network == cal.links["loopback"]  # nothing crosses between nodes
    assert two_nodes.network == cal.links["emu_mixed4"]
    own = dict(cal.links, **{"emu_mixed4@ranks_0_1": cal.links["veth_1gbit"]})
    measured = on("0,1", calibration=dataclasses.replace(cal, links=own))
    assert measured.network == cal.links["veth_1gbit"]


def test_hybrid_leaves_devices_out_only_where_that_is_predicted_faster(typed_cfg):
    from recsys.app.planning import make_plan, plan_inputs, plan_json

    cfg = typed_cfg(["cluster=emu_mixed4", "planner=hybrid", "trainer.batch_size=2048"])
    inputs = plan_inputs(cfg, None, None)
    plan = make_plan(cfg, inputs)
    weighed = {w["what"]: w for w in plan.weighed}
    assert set(weighed) == {"every device", "node 0", "node 1"}
    planned = [w for w in weighed.values() if "est_step_ms" in w]  # the others: bound too slow
    assert all(
        w["lower_bound_ms"] >= plan.est_step_ms for w in weighed.values() if w not in planned
    )
    fastest = min(planned, key=lambda w: w["est_step_ms"])
    assert plan.est_step_ms == pytest.approx(fastest["est_step_ms"])
    if fastest["what"] == "every device":
        assert plan.left_out == [] and plan.cluster == "emu_mixed4"
    else:  # a part: its ranks, the same global batch, the others named as left out
        keep = fastest["ranks"]
        assert plan.left_out == [r for r in range(4) if r not in keep]
        assert plan.cluster == subset_name("emu_mixed4", keep)
        assert len(plan.batch_per_rank) == len(keep)
    assert sum(plan.batch_per_rank) == inputs.global_batch
    saved = plan_json(plan)
    assert saved["left_out"] == plan.left_out and saved["weighed"] == plan.weighed
    json.dumps(saved)  # strict JSON

    off = typed_cfg(["cluster=emu_mixed4", "planner=hybrid", "planner.leave_out=false"])
    kept = make_plan(off, plan_inputs(off, None, None))
    assert kept.left_out == [] and kept.weighed == [] and len(kept.batch_per_rank) == 4


def test_a_part_that_cannot_be_priced_is_listed_with_why(typed_cfg, monkeypatch):
    from recsys.app import planning
    from sharding.calibration import CalibrationError

    real = planning.plan_inputs

    def no_node_1(cfg, *a, **k):
        if cfg.cluster.name.endswith("ranks_2_3"):
            raise CalibrationError("no calibration here")
        return real(cfg, *a, **k)

    monkeypatch.setattr(planning, "plan_inputs", no_node_1)
    cfg = typed_cfg(["cluster=emu_mixed4", "planner=hybrid"])
    plan = planning.make_plan(cfg, real(cfg, None, None))
    by = {w["what"]: w for w in plan.weighed}
    assert by["node 1"]["not_weighed"] == "no calibration here" and "est_step_ms" in by["node 0"]


def test_plan_train_trains_torchrec_on_the_part_its_plan_is_fastest_on(capsys):
    """`benchmarks.plan_train parts=[torchrec]`: TorchRec's planner on each part, each
    predicted; the fastest trained, on its ranks alone, at the same global batch."""
    from hydra import initialize_config_dir

    from benchmarks import plan_train as bench
    from recsys import CONF_DIR

    cfg = bench.PlanTrainBenchConfig(cluster=cluster_of("emu_mixed4"), parts=["torchrec"])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        labels = bench.part_labels(cfg)
        overrides = bench._overrides(cfg, labels[0])
    printed = capsys.readouterr().out
    assert "torchrec@ranks_0_1 (node 0): predicted" in printed
    assert "torchrec@ranks_2_3 (node 1): predicted" in printed
    assert labels == ["torchrec@ranks_0_1"]  # the fast node: 2 ranks at 0.6 of a core
    assert "planner=torchrec" in overrides and "cluster.only_ranks=[0,1]" in overrides
    assert overrides[-1] == "trainer.batch_size=4096"  # 4 x 2048 on 2 ranks


def test_plan_train_runs_the_parts_beside_the_planners_it_was_told(monkeypatch):
    """Every row trained, the part's among them, each run listed; the result's config keeps
    the planners it was told (the part's rows are added, not written into it)."""
    import contextlib

    from hydra import initialize_config_dir

    from benchmarks import plan_train as bench
    from recsys import CONF_DIR

    trained = []

    def train(overrides, steps, run_dir):
        trained.append(overrides)
        world = 2 if any(o.startswith("cluster.only_ranks") for o in overrides) else 4
        return 1000 * steps, {
            "samples_per_s": 100.0 * world,
            "batch_per_rank": [1] * world,
            "step_time_s": 0.1,
            "steps": steps,
        }

    monkeypatch.setattr(bench, "trainer_on", lambda cfg: contextlib.nullcontext(train))
    monkeypatch.setattr(bench, "measured_ms", lambda summary: 100.0)
    cfg = bench.PlanTrainBenchConfig(
        cluster=cluster_of("emu_mixed4"),
        planners=["torchrec", "hybrid+all_devices", "hybrid"],
        parts=["torchrec"],
        repeats=1,
        steps=[2, 4],
    )
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        result = bench.run(cfg)
    rows = {r["planner"]: r for r in result["rows"]}
    assert set(rows) == {"torchrec", "hybrid+all_devices", "hybrid", "torchrec@ranks_0_1"}
    assert rows["torchrec@ranks_0_1"]["speedup_vs_first"] == 0.5
    assert result["config"]["planners"] == ["torchrec", "hybrid+all_devices", "hybrid"]
    assert len(trained) == 8  # a short and a long run each


def test_plan_train_rates_hybrid_against_the_fastest_other_way_round_by_round():
    from benchmarks.plan_train import table, versus_best_alternative

    def row(planner, runs):
        figures = dict.fromkeys(["bytes_per_step", "bytes_vs_first", "speedup_vs_first"], 1.0)
        return {
            **figures,
            **dict.fromkeys(["predicted_a2a_bytes_per_step", "predicted_step_ms"], 1.0),
            "measured_step_ms": 1.0,
            "speedup_vs_first_range": [1.0, 1.0],
            "planner": planner,
            "samples_per_s": sorted(runs)[1],
            "samples_per_s_runs": runs,
        }

    rows = [
        row("torchrec", [10.0, 12.0, 11.0]),
        row("torchrec@ranks_0_1", [20.0, 30.0, 25.0]),  # the fastest alternative by median
        row("hybrid", [22.0, 27.0, 30.0]),
    ]
    vs = versus_best_alternative(rows)
    assert vs["alternative"] == "torchrec@ranks_0_1" and vs["speedup"] == 27.0 / 25.0
    assert vs["speedup_range"] == [0.9, 1.2]  # 27/30 and 30/25; 22/20 between
    assert versus_best_alternative(rows[:2]) is None  # no hybrid row
    assert versus_best_alternative(rows[2:]) is None  # nothing to compare with
    assert "hybrid against the best alternative (torchrec@ranks_0_1): 1.08x (each round " in (
        table(
            {
                "rows": rows,
                "hybrid_vs_best_alternative": vs,
                "environment": {"date": "d", "torch": "t", "torchrec": "r"},
                "config": {"cluster": None, "link_rate": "1gbit", "overrides": [], "repeats": 3},
            }
        )
    )
