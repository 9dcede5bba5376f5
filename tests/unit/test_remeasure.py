"""`python -m benchmarks.remeasure`: every published result set has the command that made
it, each command's overrides compose, and a set is stale exactly when another stack made it."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from conftest import REPO
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from benchmarks import remeasure
from benchmarks.common import results_dir_for
from recsys import CONF_DIR


def test_every_published_result_set_has_its_command() -> None:
    folders = {p.name for p in remeasure.RESULTS.iterdir() if p.is_dir()}
    kept = remeasure.ACROSS_STACKS | remeasure.BY_HAND  # never re-run from remeasure
    assert folders - kept == {n for n, _, _ in remeasure.PUBLISHED}
    for name, file, _ in remeasure.PUBLISHED:
        assert (remeasure.RESULTS / name / file).exists(), name


@pytest.mark.parametrize("name", [n for n, _, _ in remeasure.PUBLISHED])
def test_each_command_composes_and_publishes_into_its_own_set(name: str) -> None:
    """The command's overrides are valid for its benchmark, and it writes where its results
    are: the folder of `name`, saved."""
    module, *overrides = remeasure.command(name)[2:]
    importlib.import_module(module)  # registers the benchmark's schema
    config = "calibrate" if module == "benchmarks.calibrate" else f"bench_{module.split('.')[1]}"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config, overrides=overrides)
    assert cfg.save is True
    published = json.loads((remeasure.RESULTS / name / _file(name)).read_text())["config"]
    where = cfg.results_dir or results_dir_for(module.split(".")[1], cfg.get("cluster"))
    assert Path(where).name == name
    told = OmegaConf.to_container(cfg)
    for key in (
        "pipelines",
        "overrides",
        "nested_overrides",
        "link_rate",
        "steps",
        "workers",
        "repeats",
        "planners",
        "validation",
    ):
        if key == "link_rate" and told.get("cluster"):
            continue  # the emulated cluster's own link, not link_rate
        if key in published and key in told:  # what the published run was told, told again
            assert told[key] == published[key], (name, key)


def _file(name: str) -> str:
    return next(f for n, f, _ in remeasure.PUBLISHED if n == name)


def test_a_set_is_stale_when_another_stack_measured_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(remeasure, "RESULTS", tmp_path)
    installed = {"torch": "2.14.1", "torchrec": "1.9.2", "fbgemm_gpu": "1.9.0"}
    assert "missing" in remeasure.why_stale("data", installed)
    (tmp_path / "data").mkdir()
    file = tmp_path / "data" / "data.json"
    file.write_text(json.dumps({"environment": {**installed, "date": "2026-12-04"}}))
    assert "the code it measured is unknown" in remeasure.why_stale("data", installed)
    (tmp_path / "data" / "code.json").write_text(json.dumps({"files": {}}))  # nothing changed
    assert remeasure.why_stale("data", installed) is None
    file.write_text(json.dumps({"environment": {**installed, "torchrec": "1.8.0"}}))
    assert remeasure.why_stale("data", installed) == "torchrec 1.8.0 (installed 1.9.2)"


def test_unknown_sets_are_refused_naming_the_known_ones(capsys) -> None:
    with pytest.raises(SystemExit):
        remeasure.main(["pipelines"])
    err = capsys.readouterr().err
    assert "unknown result set(s) ['pipelines']" in err and "pipeline_200mbit" in err


def test_the_tbe_comparison_adds_each_stacks_rows(tmp_path: Path) -> None:
    """`benchmarks.tbe_cpu`: each run adds its stack's rows (another stack's run, in its own
    environment, adds beside them), every figure positive."""
    from benchmarks import tbe_cpu

    rows = tbe_cpu.measure(shapes=((2, 100, 8, 64),), repeats=2)
    assert len(rows) == 1 and rows[0]["forward_ms"] > 0 and rows[0]["forward_backward_ms"] > 0
    runs = [{"stack": {**tbe_cpu.stack(), "torch": t}, "rows": rows} for t in ("2.13", "2.14")]
    lines = tbe_cpu.table(runs).splitlines()
    assert [line.split(" | ")[0] for line in lines[4:]] == ["| 2.13", "| 2.14"]


def test_a_set_runs_after_the_sets_it_reads() -> None:
    order = [name for name, _, _ in remeasure.PUBLISHED]
    for name, reads in remeasure.DEPENDS.items():
        assert all(order.index(r) < order.index(name) for r in reads), name
    scale = (REPO / "benchmarks" / "scale.py").read_text()  # what it reads, as DEPENDS says
    assert all(f'RESULTS / "{r}"' in scale for r in remeasure.DEPENDS["scale"])
