"""What a GPU run needs that CPU ranks can check: the device and backend follow the cluster
config, not whether CUDA is present; a GPU cluster that this machine's GPUs cannot hold is
refused before any rank starts; every plan either planner makes for a GPU preset pickles
(TorchRec broadcasts the plan to the ranks)."""

from __future__ import annotations

import pickle
import re
from dataclasses import replace

import pytest
import torch
from conftest import CONF_DIR

from recsys.app import train as app
from recsys.app.planning import make_plan, plan_inputs
from recsys.config import TrainConfigError
from recsys.models.dlrm import build_model, feature_names
from recsys.trainer.build import backend_for, rank_device
from sharding.cluster import compute_device_type, resolve_cluster
from sharding.emit import for_cpu_ranks, to_torchrec_plan
from sharding.torchrec_planner import plan_with_torchrec
from sharding.types import PlannerName


def _ranks(typed_cfg, overrides: list[str]):
    return resolve_cluster(typed_cfg(overrides).cluster)


def test_cpu_ranks_run_on_cpu_with_gloo_even_where_cuda_is(typed_cfg, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("a CPU rank took a GPU"))
    ranks = _ranks(typed_cfg, ["cluster=local_cpu2"])
    assert [rank_device(r) for r in ranks] == [torch.device("cpu")] * 2
    assert backend_for(ranks) == "gloo"


def test_joining_the_group_takes_gloo_unless_told_even_where_cuda_is(monkeypatch) -> None:
    """The CPU link probe (`benchmarks.comm_probe`, which sends CPU tensors) and the test
    jobs join without naming a backend: on a GPU machine that must still be gloo."""
    import torch.distributed as dist

    from recsys import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    joined = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: joined.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    launch.init_distributed(5.0)
    launch.init_distributed(5.0, "nccl")
    assert joined == ["gloo", "nccl"]


def test_gpu_ranks_take_their_nodes_gpus_with_nccl(typed_cfg, monkeypatch) -> None:
    taken = []
    monkeypatch.setattr(torch.cuda, "set_device", taken.append)
    ranks = _ranks(typed_cfg, ["cluster=2x8_h100"])
    devices = [rank_device(r) for r in ranks]
    assert devices == [torch.device("cuda", i % 8) for i in range(16)]  # local rank, per node
    assert taken == [i % 8 for i in range(16)] and backend_for(ranks) == "nccl"


@pytest.mark.parametrize(
    "overrides, gpus, says",
    [
        (["cluster=1x8_a100_80g"], 2, "puts 8 GPU ranks on a node and this machine has 2 GPU(s)"),
        (["cluster=2x8_h100"], 8, "has 2 nodes; the local launcher starts one machine's ranks"),
    ],
)
def test_a_gpu_cluster_this_machine_cannot_hold_is_refused_in_one_line(
    typed_cfg, monkeypatch, overrides: list[str], gpus: int, says: str
) -> None:
    _gpus(monkeypatch, gpus, "NVIDIA A100-SXM4-80GB", 79.2)
    cfg = typed_cfg(overrides)
    with pytest.raises(TrainConfigError, match=re.escape(says)):
        app._check_launch(cfg, plan_inputs(cfg, None, None))
    fits = typed_cfg(["cluster=1x8_a100_80g", f"cluster.nodes.0.devices.0.count={gpus}"])
    app._check_launch(fits, plan_inputs(fits, None, None))  # as many ranks as GPUs: fine


def _gpus(monkeypatch, count: int, name: str, memory_gib: float) -> None:
    """This machine, as CUDA would describe it: `count` GPUs of one name and memory."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    props = SimpleNamespace(name=name, total_memory=int(memory_gib * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)


def test_gpus_of_another_kind_than_the_cluster_names_are_refused(typed_cfg, monkeypatch) -> None:
    """The cluster's kinds price the plan: a run on other GPUs stops before any rank starts.
    A device described by its figures has no name to check."""
    two = ["cluster.nodes.0.devices.0.count=2"]
    _gpus(monkeypatch, 2, "NVIDIA A100-SXM4-80GB", 79.2)
    h100 = typed_cfg(["cluster=1x8_h100", *two])
    with pytest.raises(
        TrainConfigError,
        match=r"says GPU 0 of this node is h100_80g; it is "
        r"NVIDIA A100-SXM4-80GB \(a100_80g\)",
    ):
        app._check_launch(h100, plan_inputs(h100, None, None))
    _gpus(monkeypatch, 2, "NVIDIA A10G", 22.0)  # not in the catalog
    a100 = typed_cfg(["cluster=1x8_a100_80g", *two])
    with pytest.raises(TrainConfigError, match=r"it is NVIDIA A10G \(not in the catalog\)"):
        app._check_launch(a100, plan_inputs(a100, None, None))
    dev = "cluster.nodes.0.devices.0"
    figures = typed_cfg(
        [
            "cluster=1x8_a100_80g",
            *two,
            f"{dev}.kind=a10g_24g",
            f"{dev}.hbm_gib=24",
            f"{dev}.hbm_gbyte_s=600",
            f"{dev}.speed=0.4",
        ]
    )
    app._check_launch(figures, plan_inputs(figures, None, None))


def test_a_rehearsal_needs_no_gpu_but_a_gpu_cluster_and_the_memory(typed_cfg, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rehearse = ["trainer.rehearse_on_cpu=true"]
    cfg = typed_cfg(["debug=tiny", "cluster=2x8_h100", *rehearse])
    app._check_launch(cfg, plan_inputs(cfg, None, None))  # 16 CPU ranks, no GPU: fine
    cpu = typed_cfg(["debug=tiny", *rehearse])
    with pytest.raises(TrainConfigError, match="is CPU ranks already: drop"):
        app._check_launch(cpu, plan_inputs(cpu, None, None))
    big = typed_cfg(["model=dcnv2_mlperf", "cluster=2x8_h100", *rehearse])  # 90 GB of tables
    with pytest.raises(TrainConfigError, match="the tables alone take .* rehearse a smaller"):
        app._check_launch(big, plan_inputs(big, None, None))


GPU_PRESETS = sorted(
    p.stem for p in (CONF_DIR / "cluster").glob("*.yaml") if not p.stem.startswith(("local", "emu"))
)


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_plan_for_a_gpu_preset_pickles(typed_cfg, preset: str) -> None:
    """TorchRec's planner broadcasts its plan with `broadcast_object_list` (pickled): a
    plan holding a closure (a coverage curve's lambda) killed rank 0 of every GPU run."""
    # TorchRec's search bounded to 1 s: any plan it returns carries the same cache_params
    cfg = typed_cfg(["debug=tiny", f"cluster={preset}", "planner.torchrec_timeout_s=1"])
    inputs = plan_inputs(cfg, None, None)
    assert compute_device_type(inputs.ranks) == "cuda"
    model = build_model(cfg.model, dense_device=torch.device("meta"))
    plans = {"torchrec": plan_with_torchrec(model, inputs, cfg.planner).plan}
    # what broke the broadcast: the cache statistics TorchRec copies into the plan
    stats = [
        ps.cache_params.stats
        for m in plans["torchrec"].plan.values()
        for ps in m.values()
        if ps.cache_params is not None
    ]
    assert stats and all(s is not None for s in stats)
    hybrid = replace(cfg, planner=replace(cfg.planner, name=PlannerName.hybrid))
    feature_of = {f"t_{f}": f for f in feature_names(cfg.model)}
    plans["hybrid"] = to_torchrec_plan(make_plan(hybrid, inputs), feature_of, "cuda")
    for name, plan in plans.items():
        back = pickle.loads(pickle.dumps(plan))
        assert str(back) == str(plan), name
        _check_rehearsed(plan, for_cpu_ranks(plan))


def _check_rehearsed(gpu, cpu) -> None:
    """A GPU plan as CPU ranks run it: the same tables, sharding types, ranks and shard
    shapes; CPU kernels, no cache, every shard on a CPU."""
    assert gpu.plan.keys() == cpu.plan.keys()
    for module, params in gpu.plan.items():
        assert params.keys() == cpu.plan[module].keys()
        for name, g in params.items():
            c = cpu.plan[module][name]
            assert (c.sharding_type, c.ranks) == (g.sharding_type, g.ranks), name
            assert c.compute_kernel in ("fused", "dense") and c.cache_params is None, name
            assert (g.compute_kernel == "dense") == (c.compute_kernel == "dense"), name
            if g.sharding_spec is None:
                assert c.sharding_spec is None, name
                continue
            for gs, cs in zip(g.sharding_spec.shards, c.sharding_spec.shards, strict=True):
                assert (cs.shard_offsets, cs.shard_sizes) == (gs.shard_offsets, gs.shard_sizes)
                assert cs.placement.rank() == gs.placement.rank()
                assert str(cs.placement.device()) == "cpu" and gs.placement.device().type == "cuda"


def test_the_trainers_sums_run_on_the_ranks_device(monkeypatch) -> None:
    """A count kept on the host is summed on the rank's device (NCCL takes CUDA tensors
    only): here the meta device stands for a GPU."""
    import torch.distributed as dist

    from recsys import collectives

    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device))
    counts = torch.zeros(5, dtype=torch.float64)
    summed = collectives.all_reduce_sum(counts, torch.device("meta"))
    assert seen == [torch.device("meta")] and summed.device.type == "meta"
    assert counts.device.type == "cpu"  # the caller's tensor is left as it was


def test_no_module_of_recsys_calls_a_collective_but_the_collectives_module() -> None:
    """Every collective of the trainer and its metrics goes through recsys/collectives.py
    (on the rank's device); the launcher's barrier is the one other."""
    import ast

    names = {
        "all_reduce",
        "all_gather",
        "broadcast",
        "reduce",
        "all_to_all",
        "all_to_all_single",
        "all_gather_object",
        "broadcast_object_list",
        "gather",
        "scatter",
        "reduce_scatter",
    }
    calls = []
    for path in sorted((CONF_DIR.parent / "recsys").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in names
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "dist"
            ):
                calls.append(f"{path.relative_to(CONF_DIR.parent)}:{node.lineno}")
    assert calls and all(c.startswith("recsys/collectives.py:") for c in calls), calls
