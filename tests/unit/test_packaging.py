"""The package as a user installs it: what the wheel holds, what it declares, and that its
commands and library run outside the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import import_module
from pathlib import Path

import pytest
import tomllib
from conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_wheel_lists_every_product_package_and_no_benchmark() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for top in ("recsys", "sharding", "pipelines")
        for p in (REPO / top).rglob("__init__.py")
    }
    assert listed - {"recsys.conf"} == found, "pyproject.toml's packages against the tree"
    assert not any(p.split(".")[0] in ("benchmarks", "tests") for p in listed)
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"recsys.conf": "conf"}


def test_the_library_declares_ranges_and_the_application_pins_them() -> None:
    project = PYPROJECT["project"]
    declared = [
        *project["dependencies"],
        *(d for x in project["optional-dependencies"].values() for d in x),
    ]
    assert not [d for d in declared if "==" in d], "a library pins nothing exactly"
    assert any(d.startswith("torchrec") for d in project["optional-dependencies"]["cuda"])
    pins = {
        line.split("==")[0].lower().replace("_", "-"): line.split("==")[1]
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    for d in declared:  # every declared package has the application's exact version
        name = d.split(">")[0].split("<")[0].split("=")[0].strip().lower().replace("_", "-")
        assert name in pins or name == "fbgemm-gpu", f"{name} not pinned in constraints.txt"
    assert {"torchrec", "fbgemm-gpu-cpu", "torch"} <= pins.keys()


def test_every_console_script_names_a_command() -> None:
    for name, target in PYPROJECT["project"]["scripts"].items():
        module, _, function = target.partition(":")
        script = getattr(import_module(module), function)
        command, _, main = script.__name__.rpartition(".")  # what it runs, imported on call
        assert callable(getattr(import_module(command), main)), name


def test_the_public_names_are_one_list_and_each_resolves() -> None:
    import pipelines
    import sharding
    from sharding import api

    assert sharding.__all__ == api.__all__
    assert all(getattr(sharding, n) is getattr(api, n) for n in sharding.__all__)
    assert pipelines.NestedPipeline.__module__ == "pipelines.nested"
    with pytest.raises(AttributeError, match="no attribute 'Planner'"):
        sharding.Planner  # noqa: B018


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_finds_its_configs_and_calibration(tmp_path: Path) -> None:
    """Built as pip builds it, installed into a fresh environment, then the library, a plan
    and a tiny training run from outside the checkout."""
    source = tmp_path / "source"  # a copy: setuptools builds inside the tree it is given
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    for name in ("recsys", "sharding", "pipelines", "conf"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "recsys/conf/config.yaml" in names and "recsys/conf/cluster/emu_mixed4.yaml" in names
    assert "sharding/calibration/local_cpu.json" in names
    assert not [n for n in names if n.startswith(("benchmarks/", "tests/", "conf/"))]

    # a fresh environment with the wheel alone installed; its dependencies seen through a
    # .pth line (this one's site-packages, whose own .pth files, the editable install's
    # among them, Python does not run from there)
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env_dir], check=True)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", python, "install", "--no-deps", wheel], check=True)
    check = (
        "import recsys, sharding; from sharding.calibration import load_calibration; "
        "from sharding.resources import CONF_DIR; load_calibration(); "
        "sharding.load_cluster('emu_mixed4'); print(CONF_DIR)"
    )
    out = subprocess.run([python, "-c", check], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(site / "recsys" / "conf")

    def command(*args: str) -> str:  # a console script, as a user types it
        done = subprocess.run(
            [env_dir / "bin" / args[0], *args[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert "hybrid plan for local_cpu2" in command("recsys-plan", "planner=hybrid")
    assert list((tmp_path / "outputs" / "plan").glob("*/plan.json"))
    assert "eval AUC" in command("recsys-train", "debug=tiny", "trainer.max_steps=2")
    assert list((tmp_path / "outputs" / "runs").glob("*/summary.json"))
