"""What an install of the package provides, wherever it is: the project's configs, and
torchrec (not a declared dependency with the CPU kernels; pyproject.toml says why)."""

import importlib.util
from pathlib import Path

# The project's Hydra configs (cluster presets among them): the checkout's conf/, or the copy a
# wheel installs as recsys/conf (pyproject.toml's package-dir). In the lowest layer: the
# planner's library reads the cluster presets too (`sharding.api.load_cluster`).
_ROOT = Path(__file__).resolve().parents[1]
_IN_WHEEL = _ROOT / "recsys" / "conf"
CONF_DIR = _IN_WHEEL if _IN_WHEEL.is_dir() else _ROOT / "conf"


def require_torchrec() -> None:
    """Raise, with the fix, where torchrec is not installed: with the CPU kernels it is not a
    declared dependency (pyproject.toml says why) and must be installed apart."""
    if importlib.util.find_spec("torchrec") is None:
        raise ModuleNotFoundError(
            "torchrec is not installed. With the CPU kernels (recsys-hybrid[cpu]) install it "
            "apart, without its dependencies (they ask for the CUDA fbgemm-gpu): `pip install "
            "--no-deps torchrec==1.9.2 pyre-extensions`; with the CUDA ones "
            "`pip install recsys-hybrid[cuda]` brings it."
        )
