"""`python -m sharding.plan` and `sharding.predict`: a plan's files (json, png, TorchRec's
text), and bad input refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_command


def test_plan_and_predict_commands_refuse_bad_input_in_one_line(tmp_path) -> None:
    proc = run_command(
        "sharding.plan",
        "cluster=hetero_3node",
        "cluster.network.latency_us=-100000",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 1 and "network.latency_us must be >= 0" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    (tmp_path / "notalayout.json").write_text(json.dumps({"planner": "hybrid"}))
    proc = run_command(
        "sharding.predict", f"layout={tmp_path / 'notalayout.json'}", f"hydra.run.dir={tmp_path}"
    )
    assert proc.returncode == 1 and "is not a plan_layout.json" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_users_cluster_file_plans_and_one_without_kinds_is_refused(tmp_path: Path) -> None:
    """A cluster described in the user's own config directory (`--config-dir`), with a GPU
    the catalog lacks given by its figures, plans; the same file without a device's kind is
    refused naming the key, not planned as CPU ranks."""
    mine = tmp_path / "conf" / "cluster"
    mine.mkdir(parents=True)
    text = """name: my_a10g
nodes:
  - count: 1
    host_memory_gib: 128
    devices: [{kind: a10g_24g, count: 4, hbm_gib: 24, hbm_gbyte_s: 600, dense_tflops: 125}]
network: {intra_node_gbit_s: 64, inter_node_gbit_s: 25, latency_us: 10}
"""
    (mine / "my_a10g.yaml").write_text(text)
    (mine / "no_kind.yaml").write_text(text.replace("kind: a10g_24g, ", ""))
    conf = ["--config-dir", str(tmp_path / "conf")]
    proc = run_command(
        "sharding.plan",
        *conf,
        "cluster=my_a10g",
        "model=dcnv2_small",
        "planner=hybrid",
        f"hydra.run.dir={tmp_path / 'a'}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["cluster"] == "my_a10g" and {d["kind"] for d in plan["devices"]} == {"a10g_24g"}
    proc = run_command("sharding.plan", *conf, "cluster=no_kind", f"hydra.run.dir={tmp_path / 'b'}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "cluster.nodes[0].devices[0].kind is required and unset" in proc.stderr


def test_plan_command_writes_json_png_and_torchrec_text(tmp_path: Path) -> None:
    # in this process (the README tour, tests/commands/test_readme.py, starts it as one)
    proc = run_command(
        "sharding.plan",
        "cluster=hetero_3node",
        "model=dcnv2_mlperf",
        "planner=hybrid",
        "trainer.batch_size=2048",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    for key in (
        "planner",
        "cluster",
        "feasible",
        "est_step_ms",
        "lower_bound_ms",
        "planning_s",
        "devices",
        "tables",
    ):
        assert key in plan
    for key in (
        "rank",
        "kind",
        "hbm_used_bytes",
        "hbm_cap_bytes",
        "host_used_bytes",
        "host_cap_bytes",
        "est_ms",
        "batch",
    ):
        assert key in plan["devices"][0]
    for key in (
        "name",
        "rows",
        "dim",
        "sharding_type",
        "ranks",
        "tier",
        "hot_rows",
        "replicated_rows",
    ):
        assert key in plan["tables"][0]
    assert plan["feasible"] and plan["lower_bound_ms"] <= plan["est_step_ms"]
    parts = plan["step_parts_ms"]  # the picture's step bar: its parts add up to the step
    assert set(parts) == {
        "lookups",
        "dense",
        "all-reduce",
        "overhead + input",
        "split tables",
        "exchange left exposed",
        "quota-bound CPU",
        "feeding the batch",
    }
    assert sum(parts.values()) == pytest.approx(plan["est_step_ms"])
    assert all(v >= -1e-9 for v in parts.values())
    # where every constant the margins rest on comes from, per device kind
    assert sorted(plan["constants"]) == ["h100_80g", "t4_16g", "v100_16g"]
    h100 = plan["constants"]["h100_80g"]
    assert h100["source"] == "datasheet with assumed efficiencies (not measured)"
    assert h100["fields"]["dense_flops_per_s"].startswith("derived: dense TFLOP/s")
    assert h100["fields"]["emb_bwd_factor"] == "assumed (GPU_BWD_FACTOR)"
    assert h100["fields"]["host_read_bytes_per_s"] == "cluster config: host_to_device_gbyte_s"
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "plan_torchrec.txt").read_text()
    assert "model.sparse_arch.embedding_bag_collection" in text  # a real TorchRec plan
    assert all(t["name"] in text for t in plan["tables"])  # every table (or its parts)
    assert "lower bound" in proc.stdout


def test_describe_writes_this_machine_as_a_cluster_file(tmp_path: Path, monkeypatch) -> None:
    """CPU ranks: one per usable core, pinned, the host's memory; it trains-plans as written.
    A GPU the catalog lacks (a mocked A10G): its figures from the GPU probe's output, or
    `???` where nothing measured them, which planning refuses naming the first such key."""
    import os
    from types import SimpleNamespace

    import torch

    from recsys.app.describe import host_memory_gib

    out = tmp_path / "conf" / "cluster" / "here.yaml"
    proc = run_command("sharding.describe", f"output={out}", f"hydra.run.dir={tmp_path / 'd'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"use it with: --config-dir {tmp_path / 'conf'} cluster=here" in proc.stdout
    conf = ["--config-dir", str(tmp_path / "conf")]
    plan = run_command("sharding.plan", *conf, "cluster=here", f"hydra.run.dir={tmp_path / 'p'}")
    assert plan.returncode == 0, plan.stderr[-2000:]
    devices = json.loads((tmp_path / "p" / "plan.json").read_text())["devices"]
    cores = len(os.sched_getaffinity(0))
    assert [d["kind"] for d in devices] == ["cpu"] * cores
    assert f"host_memory_gib: {host_memory_gib()}" in out.read_text()
    again = run_command("sharding.describe", f"output={out}", f"hydra.run.dir={tmp_path / 'd2'}")
    assert (
        again.returncode == 1 and "exists; choose a new file or pass overwrite=true" in again.stderr
    )

    a10g = SimpleNamespace(name="NVIDIA A10G", total_memory=24 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: a10g)
    gpu = tmp_path / "conf" / "cluster" / "gpu.yaml"
    proc = run_command("sharding.describe", f"output={gpu}", f"hydra.run.dir={tmp_path / 'g'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = gpu.read_text()
    assert "kind: nvidia_a10g" in text and "count: 2" in text and "hbm_gbyte_s: ???" in text
    refused = run_command("sharding.plan", *conf, "cluster=gpu", f"hydra.run.dir={tmp_path / 'x'}")
    assert refused.returncode == 1 and "network.intra_node_gbit_s is required" in refused.stderr
    probe = tmp_path / "a10g.json"
    link = {"intra_node": {"alltoall": {"bytes_per_s": 8e9}}}
    probe.write_text(
        json.dumps(
            {
                "device": {"emb_read_bytes_per_s": 300e9},
                "links": link,
                "dense_flops_per_s_by_precision": {"bf16": 0.35 * 125e12},
            }
        )
    )
    proc = run_command(
        "sharding.describe",
        f"output={gpu}",
        f"probe={probe}",
        "overwrite=true",
        f"hydra.run.dir={tmp_path / 'g2'}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = gpu.read_text()
    assert "hbm_gbyte_s: 600.0" in text and "dense_tflops: 125.0" in text
    assert "intra_node_gbit_s: 64.0" in text
    ok = run_command(
        "sharding.plan",
        *conf,
        "cluster=gpu",
        "model=dcnv2_small",
        f"hydra.run.dir={tmp_path / 'y'}",
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
