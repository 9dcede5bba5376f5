"""`python -m recsys.data.synth output=<dir> preset=kaggle|criteo_1tb ...`: write synthetic
Criteo files in the real text format (see `recsys.data.synthetic_files`)."""

from __future__ import annotations

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from recsys import CONF_DIR
from recsys.data.atomic import run_cli
from recsys.data.synthetic_files import SynthConfig, cardinalities, synthesize

ConfigStore.instance().store(name="base_synth", node=SynthConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="synth")
def main(cfg: DictConfig) -> None:
    typed: SynthConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_cli(
        lambda: synthesize(typed),
        lambda paths: (
            f"wrote {', '.join(str(p) for p in paths)}; cardinalities {cardinalities(typed)}"
        ),
    )


if __name__ == "__main__":
    main()
