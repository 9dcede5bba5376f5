"""Shared fixtures: compose configs with Hydra's compose API, as the app would."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import io
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hypothesis import settings
from omegaconf import DictConfig

from recsys.app.train import quiet_library_noise, to_typed
from recsys.config import register_configs

# Property tests draw the same examples on every run (`make test`, CI): a red build names a
# change, not a lucky draw. HYPOTHESIS_PROFILE=explore draws new ones, to hunt for bugs.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

register_configs()
quiet_library_noise()
if os.environ.get("PYTEST_XDIST_WORKER"):  # one core per worker (`make test` runs two)
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow (multi-process) tests first, in their order: under `make test`'s two workers
    the long ones start early and short ones fill the gaps at the end. And `--dist
    loadgroup`'s groups (`xdist_group`: the tests that share the machine's network namespaces
    and Slurm run one at a time, in one worker): pytest-xdist 3.8 names a test's group in its
    node id by setting `item._nodeid`, which pytest 9 no longer reads (its id is `item._id`),
    so the groups were silently ignored and those tests ran side by side."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers only
        return
    from _pytest.nodeid import NodeId

    for item in items:
        groups = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        if groups and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The root config with `overrides`, as the app composes it: a copy of this process's
    first composition of the same overrides (Hydra takes a quarter second for each)."""
    return copy.deepcopy(_composed(tuple(overrides or ())))


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# The function each entry module calls (the entry modules of sharding/ call into the app)
_ENTRY = {
    "recsys.train": ("recsys.app.train", "cli"),
    "recsys.evaluate": ("recsys.app.train", "evaluate_cli"),
    "recsys.score": ("recsys.export", "score_main"),
    "sharding.plan": ("recsys.app.plan", "main"),
    "sharding.predict": ("recsys.app.predict", "main"),
    "sharding.profile": ("recsys.app.profile", "main"),
    "sharding.describe": ("recsys.app.describe", "main"),
}


def run_command(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` run in this process: the function its entry module calls,
    with the command line in sys.argv, from the repository root; its exit code and what it
    printed (logging included). No interpreter to start and no torch to import: seconds
    less per command. Each command keeps a test that starts it as a process (its log, its
    signals, its exit code as the shell sees it)."""
    where, name = _ENTRY.get(module, (module, "main"))
    main = getattr(importlib.import_module(where), name)
    root = logging.getLogger()
    handlers, level, argv, cwd = list(root.handlers), root.level, sys.argv, os.getcwd()
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [module, *args]
    os.chdir(CONF_DIR.parent)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:  # what the interpreter makes of it as it ends
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:  # a message: printed, exit 1
            code = 1
            err.write(f"{e.code}\n")
    finally:
        sys.argv = argv
        os.chdir(cwd)
        GlobalHydra.instance().clear()
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    return compose_config


@pytest.fixture
def no_ranks(monkeypatch) -> None:
    """A test that fails if any rank is spawned: what it checks must stop before that."""
    from recsys import launch

    monkeypatch.setattr(launch, "spawn_ranks", lambda *a, **k: pytest.fail("ranks started"))


@pytest.fixture
def typed_cfg() -> Callable:
    return lambda overrides=None: to_typed(compose_config(overrides))


def cluster_of(name: str, overrides: list[str] | None = None):
    """The typed cluster of the preset `name` (with `cluster.` overrides)."""
    return to_typed(compose_config([f"cluster={name}", *(overrides or [])])).cluster


# The prepared-Criteo runs' config: the `criteo` fixture's files, tiny model and batches
# the calibration some tests were written against: a new day's calibration moves hybrid's
# (and, through the topology's costs, TorchRec's) CPU plans, which those tests depend on
CALIBRATION_2026_12_04 = f"planner.calibration={REPO / 'tests/data/local_cpu_2026-12-04.json'}"
CALIBRATION_2026_12_06 = REPO / "tests/data/local_cpu_2026-12-06.json"  # 03:02, before the
# ranks kept their freed memory
CRITEO = ["debug=tiny", "dataset=criteo_kaggle", "dataset.eval_batches=2", "trainer.batch_size=64"]


@pytest.fixture(scope="module")
def criteo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(raw text dir, prepared dir) of 2,000 rows."""
    from recsys.data.prepare import PrepareConfig, prepare
    from recsys.data.synthetic_files import SynthConfig, synthesize

    root = tmp_path_factory.mktemp("criteo")
    synthesize(SynthConfig(output=str(root / "tsv"), rows=2000, scale=1000))
    prepare(
        PrepareConfig(input=str(root / "tsv"), output=str(root / "bin"), workers=1, progress=False)
    )
    return root / "tsv", root / "bin"


@pytest.fixture(scope="module")
def kaggle_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(gzipped text dir, converted dir) of 6,000 train and 300 test rows."""
    from recsys.data.convert import ConvertOptions, convert
    from recsys.data.synthetic_files import SynthConfig, synthesize

    root = tmp_path_factory.mktemp("kaggle")
    cfg = SynthConfig(output=str(root / "tsv"), rows=6000, test_rows=300, gzip=True, scale=1000)
    synthesize(cfg)
    convert(root / "tsv", root / "bin", ConvertOptions(workers=2, chunk_mb=0.2, progress=False))
    return root / "tsv", root / "bin"


def plan_with_splits(cfg, calibration: Path = CALIBRATION_2026_12_06):
    """Our hybrid plan for `cfg` with split tables (`recsys.app.planning.plan_with_splits`),
    across the calibrated 1 Gbit/s link, under a pinned calibration: whether splitting pays
    at all on a tiny model, even with the split work free, turns on a day's constants (the
    link's latency against the bytes a split saves; the calibration of 2026-12-07 09:12
    splits nothing here), and these tests are about training split tables."""
    from recsys.app.planning import plan_with_splits as plan
    from sharding.calibration import load_calibration

    return plan(cfg, load_calibration(calibration), "veth_1gbit")
