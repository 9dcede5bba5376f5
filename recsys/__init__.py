"""The ML side: config schemas, data, models, metrics, the per-rank train job, launching
and supervising ranks. The commands sit above, in `recsys.app`."""
