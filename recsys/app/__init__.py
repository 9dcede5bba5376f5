"""The commands: every Hydra entry point, config -> plan (`planning`), and the one-line
handling of a user's error. The top layer of the library: nothing below imports it
(tests/unit/test_layers.py; docs/layout.md). Users type the short names, `python -m recsys.train`,
`python -m sharding.plan`, ..., which are entry modules that only call `main` here."""

from recsys import CONF_DIR
from sharding.resources import require_torchrec

require_torchrec()  # every command needs it: a missing one said with its fix

__all__ = ["CONF_DIR"]
