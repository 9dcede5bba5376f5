"""The commands: every Hydra entry point, config -> plan (`planning`), and the one-line
handling of a user's error. The top layer of the library: nothing below imports it
(tests/test_layers.py; docs/layout.md). Users type the short names, `python -m recsys.train`,
`python -m sharding.plan`, ..., which are entry modules that only call `main` here."""

from pathlib import Path

# Absolute: these commands also run as `python -m sharding.plan` etc., where Hydra would
# read a relative config_path against the importing package, not this file
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
