"""The ML side: config schemas, data, models, metrics, the per-rank train job, launching
and supervising ranks. The commands sit above, in `recsys.app`."""

from sharding.resources import CONF_DIR as _CONF_DIR

# Absolute, for every command's `hydra.main`: Hydra reads a relative config_path against the
# importing package when the command's module is imported rather than run as __main__
# (`python -m sharding.plan` imports recsys.app.plan; tests call the commands in-process)
CONF_DIR = str(_CONF_DIR)
