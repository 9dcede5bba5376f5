"""The GPU probe runs on CPU (`--device cpu --quick`), writes its results in the shapes the
cost model reads, and its constants replace the datasheet assumptions for that kind."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO

from sharding import calibration
from sharding.calibration import (
    constants_provenance,
    constants_source,
    device_costs,
    host_assembly_s,
    load_calibration,
)
from sharding.cluster import resolve_cluster
from sharding.cost_model import datasheet_device_cost
from sharding.types import ClusterSpec, DeviceGroup, NetworkSpec, NodeGroup

SECTIONS = ("tbe", "embedding", "dense", "copies", "host_gather", "sequence", "links")

# one worker runs this module's tests, so the probe (15 s) runs once, not once a worker
pytestmark = pytest.mark.xdist_group("gpu_probe")


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """One quick CPU run in a fresh interpreter that records what it imported, as on a GPU
    machine with torch alone: fbgemm_gpu cannot be imported there."""
    out = tmp_path_factory.mktemp("probe")
    code = (
        "import sys; sys.modules['fbgemm_gpu'] = None; import benchmarks.gpu_probe as g; "
        "rc = g.main(sys.argv[1:]); print('IMPORTED', sorted({m.split('.')[0] for m, v in "
        "sys.modules.items() if v is not None})); sys.exit(rc)"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--device",
            "cpu",
            "--quick",
            "--kind",
            "a100_40g",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "stdout.txt").write_text(proc.stdout)
    return out


def _numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_the_probe_imports_torch_only(probe: Path) -> None:
    line = next(x for x in (probe / "stdout.txt").read_text().splitlines() if x.startswith("IMP"))
    imported = set(eval(line.removeprefix("IMPORTED ")))  # noqa: S307 - our own output
    assert "torch" in imported
    assert not imported & {"torchrec", "fbgemm_gpu", "hydra", "omegaconf", "recsys"}


def test_every_section_measures_and_every_figure_is_positive_and_finite(probe: Path) -> None:
    result = json.loads((probe / "gpu_probe.json").read_text())
    assert result["device"]["kind"] == "a100_40g" and result["device"]["type"] == "cpu"
    assert result["environment"]["torch"] and result["complete"] is True
    assert result["tbe"] == [] and result["embedding_kernel"].startswith("torch embedding_bag")
    for section in SECTIONS[1:]:
        assert result[section], f"{section} measured nothing"
    # between 2 CPU processes over gloo (--device cpu): each collective at each size
    assert {(x["collective"], x["ranks"]) for x in result["links"]} == {
        ("alltoall", 2),
        ("allreduce", 2),
    }
    for e in result["embedding"]:
        assert {"rows", "dim", "pooling", "ids", "forward_ms", "backward_ms"} <= set(e)
    assert {e["ids"] for e in result["embedding"]} == {"uniform", "power_law"}
    assert {d["precision"] for d in result["dense"]} == {"fp32", "bf16"}  # no tf32 on CPU
    assert {d["model"] for d in result["dense"]} == {"dcnv2_mlperf", "dlrm_small"}
    figures = [x for s in SECTIONS for x in _numbers(result[s])]
    assert figures and all(math.isfinite(x) and x > 0 for x in figures)


def test_its_constants_load_as_a_calibration_and_name_what_is_assumed(probe: Path) -> None:
    consts = json.loads((probe / "a100_40g.json").read_text())
    cal = load_calibration(probe / "a100_40g.json")  # the CPU calibration's format
    measured = consts["measured"]
    assert "emb_read_bytes_per_s" not in measured["assumed"]
    assert "step_overhead_s" in measured["assumed"]
    assert cal.device.emb_read_bytes_per_s == consts["device"]["emb_read_bytes_per_s"]
    assert measured["datasheet"]["emb_read_bytes_per_s"] == pytest.approx(1555e9 * 0.5)
    out = (probe / "stdout.txt").read_text()
    assert "emb_read_bytes_per_s" in out and "778 GB/s" in out  # beside the datasheet's


def test_measured_constants_replace_the_datasheet_for_that_kind(probe, tmp_path, monkeypatch):
    spec = ClusterSpec(
        name="two_kinds",
        network=NetworkSpec(300),
        nodes=[
            NodeGroup(
                devices=[
                    DeviceGroup("a100_40g", 1),
                    DeviceGroup("a100_40g", 1, hbm_gbyte_s=777.5),
                    DeviceGroup("t4_16g", 1),
                ]
            )
        ],
    )
    ranks = resolve_cluster(spec)
    monkeypatch.setattr(calibration, "GPU_DIR", tmp_path)
    assert constants_source("a100_40g").startswith("datasheet")
    sheet = replace(datasheet_device_cost(ranks[0]), host_s_per_sample=host_assembly_s())
    assert device_costs(ranks, None)[0] == sheet
    (tmp_path / "a100_40g.json").write_text((probe / "a100_40g.json").read_text())
    saved = json.loads((probe / "a100_40g.json").read_text())
    measured, dense = saved["device"], saved["dense_flops_per_s_by_precision"]
    assert set(dense) == {"fp32", "bf16"}  # on a CPU: no TF32
    full, half, t4 = device_costs(ranks, None)
    assert full.emb_read_bytes_per_s == measured["emb_read_bytes_per_s"]
    assert full.dense_flops_per_s == dense["fp32"]  # the run's precision: fp32 by default
    assert device_costs(ranks, None, "bf16")[0].dense_flops_per_s == dense["bf16"]
    # tf32 was not measured: the datasheet's rate at tf32, not another precision's measurement
    tf32 = device_costs(ranks, None, "tf32")[0]
    assert tf32.dense_flops_per_s == datasheet_device_cost(ranks[0], "tf32").dense_flops_per_s
    assert tf32.emb_read_bytes_per_s == measured["emb_read_bytes_per_s"]
    assert half.emb_read_bytes_per_s == pytest.approx(measured["emb_read_bytes_per_s"] / 2)
    assert t4 == replace(datasheet_device_cost(ranks[2]), host_s_per_sample=host_assembly_s())
    assert constants_source("a100_40g").startswith("measured by benchmarks.gpu_probe")
    fields = constants_provenance("a100_40g")["fields"]  # plan.json's, field by field
    assumed = set(saved["measured"]["assumed"])
    for f, said in fields.items():
        assert said.startswith("measured by benchmarks.gpu_probe") == (
            f in saved["device"] and f not in assumed or f == "dense_flops_per_s"
        ), f
    assert not constants_provenance("t4_16g")["fields"]["emb_read_bytes_per_s"].startswith("meas")


def test_without_cuda_the_probe_says_how_to_check_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_probe", "--out", "/nonexistent"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        pytest.skip("this machine has CUDA")
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr and "--device cpu --quick" in proc.stderr


def test_tables_are_sized_to_the_free_memory(monkeypatch) -> None:
    """The 40M x 128 table (20.5 GB) on a 16 GB GPU: as many rows as fit, recorded as such."""
    from benchmarks import gpu_probe as g

    free = 16 * 2**30
    rows = g.table_rows(40_000_000, 128, free)
    assert 0 < rows < 40_000_000 and rows * 129 * 4 <= g.TABLE_SHARE * free
    assert g.table_rows(1_000_000, 128, free) == 1_000_000
    monkeypatch.setattr(g, "free_bytes", lambda device: 2**20)  # 1 MiB free
    timer = g.Timer(g.torch.device("cpu"), 1, 60.0)
    cases = g.embedding(replace(g.QUICK, poolings=(1,)), g.torch.device("cpu"), timer)
    assert cases and all(c["rows"] == g.table_rows(10_000, c["dim"], 2**20) for c in cases)
    assert all(c["rows"] < 10_000 for c in cases)


def test_what_was_measured_is_written_before_a_later_section_fails(tmp_path, monkeypatch):
    from benchmarks import gpu_probe as g

    def broken(*args):
        raise RuntimeError("the machine was taken back")

    monkeypatch.setattr(g, "links", broken)  # the last section
    with pytest.raises(RuntimeError, match="taken back"):
        g.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_probe.json").read_text())
    assert saved["complete"] is False and "links" not in saved
    assert all(saved[s] for s in SECTIONS[:-1])  # every one before it, each measured
    # fbgemm_gpu imports here: FBGEMM's TBE was timed, and the constants come from it
    assert saved["embedding_kernel"].startswith("fbgemm TBE")
    tbe = saved["tbe"]
    assert all(c["forward_bytes_per_s"] > 0 and c["bwd_over_fwd"] > 0 for c in tbe)
    rates = [c["forward_bytes_per_s"] for c in tbe]
    consts = g.constants({**saved, "links": []})
    assert min(rates) <= consts["device"]["emb_read_bytes_per_s"] <= max(rates)


@pytest.mark.parametrize(
    "name, memory, kind",
    [
        ("NVIDIA H100 80GB HBM3", 79.6, "h100_80g"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "a100_40g"),
        ("Tesla V100-SXM2-16GB", 15.8, "v100_16g"),
        ("NVIDIA L4", 22.5, "l4_24g"),
        ("NVIDIA L40S", 44.5, None),
        ("NVIDIA H200", 139.8, "h200_141g"),
    ],
)
def test_a_gpu_is_known_by_a_word_of_its_name(name: str, memory: float, kind) -> None:
    """An L40S is no L4: a catalog family must be a whole word of the device's name; a
    device the catalog lacks is named in its style from its own name and memory."""
    from benchmarks import gpu_probe as g

    assert g.device_kind(name, memory) == kind
    assert g.unknown_kind("NVIDIA L40S", 44.5) == "l40s_44g"
