"""Config groups: every option composes, and bad input fails naming the key."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import CONF_DIR, compose_config
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from recsys.app.train import to_typed
from recsys.config import GROUPS, validate_model_config
from sharding.cluster import resolve_cluster


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert _options(group), f"conf/{group}/ has no options"


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in _options(g)], ids=lambda x: str(x)
)
def test_every_option_of_every_group_composes(group: str, option: str) -> None:
    cfg = to_typed(compose_config([f"{group}={option}"]))
    validate_model_config(cfg.model)
    assert len(resolve_cluster(cfg.cluster)) >= 1
    assert cfg.trainer.max_steps >= 1


def test_defaults_are_the_documented_names() -> None:
    cfg = compose_config()
    assert cfg.model.name == "dlrm_small"
    assert cfg.pipeline.name == "plain"
    assert cfg.cluster.name == "local_cpu2"
    assert cfg.planner.name == "torchrec"
    assert len(resolve_cluster(to_typed(cfg).cluster)) == 2


def test_unknown_key_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        compose_config(["trainer.max_stepz=3"])
    assert "max_stepz" in str(e.value.__cause__ or e.value)


def test_wrong_type_is_an_error_naming_the_key() -> None:
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose_config(["trainer.max_steps=many"])
    text = str(e.value) + str(e.value.__cause__)
    assert "max_steps" in text and "many" in text


def test_bad_group_choice_lists_the_allowed_options() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        compose_config(["pipeline=nope"])
    assert "plain" in str(e.value) and "sparse_dist" in str(e.value)


def test_bad_enum_value_lists_the_allowed_values() -> None:
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose_config(["trainer.dense_optimizer=rmsprop"])
    text = str(e.value) + str(e.value.__cause__)
    assert "rmsprop" in text and "adagrad" in text


def test_yaml_typo_inside_a_group_file_is_caught(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    subprocess.run(["cp", "-r", str(CONF_DIR), str(conf)], check=True)
    (conf / "model" / "typo.yaml").write_text(
        "defaults:\n  - base_model\n  - _self_\nembeding_dim: 8\n"
    )
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as e:
            compose(config_name="config", overrides=["model=typo"])
    assert "embeding_dim" in str(e.value.__cause__ or e.value)


def test_slurm_launcher_config_composes() -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.nodes == 2 and launcher.tasks_per_node == 8
