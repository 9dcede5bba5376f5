"""`python -m sharding.profile dataset=... model=...`: measure each table's access profile.

Streams `batches` training batches of `batch_size` from the dataset (in-memory synthetic or
prepared Criteo files; ids hashed to the model's table sizes, as training sees them),
measures on the first `distinct_batches` of them how many distinct ids micro-batches of 64,
128, ... samples hold, in data order and after key-centric clustering (what the nested
pipeline's dedup sends; `benchmarks.scale` reads them), and writes `profile.json` and
`profile.png` (frequency curves) into `output` (default: the Hydra run dir). A command
module: the library is `sharding.access_profile`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from hydra.core.config_store import ConfigStore

from recsys.app.entry import hydra_command
from recsys.config import DatasetConfig, ModelConfig, register_configs
from recsys.data.source import build_source
from recsys.models.dlrm import feature_names
from sharding.access_profile import AccessProfile, build_profile
from sharding.errors import UserError


@dataclass
class ProfileAppConfig:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    batches: int = 200
    batch_size: int = 4096
    hot_ids: int = 1000  # hottest ids kept per table
    exact_max_rows: int = 1 << 25  # larger tables use the heavy-hitter sketch
    sketch_capacity: int = 1 << 16  # counters per sketched table
    distinct_batches: int = 8  # batches on which distinct ids per micro-batch are counted
    min_micro_samples: int = 64  # the smallest micro-batch counted (then 128, ... batch_size)
    output: str | None = None  # default: the Hydra run dir


class ProfileConfigError(UserError, ValueError):
    """A `sharding.profile` key out of range."""


def check_profile_config(cfg: ProfileAppConfig) -> None:
    """The keys `profile_dataset` reads, each refused by name before any batch is read."""
    for key, low in (
        ("batches", 1),
        ("batch_size", 1),
        ("hot_ids", 0),
        ("exact_max_rows", 0),
        ("sketch_capacity", 1),
        ("distinct_batches", 0),
        ("min_micro_samples", 1),
    ):
        value = getattr(cfg, key)
        if value < low:
            raise ProfileConfigError(f"{key} must be >= {low}, got {value}")


def profile_dataset(cfg: ProfileAppConfig) -> AccessProfile:
    check_profile_config(cfg)
    source = build_source(cfg.dataset, cfg.model, cfg.batch_size, world_size=1)
    names = feature_names(cfg.model)
    rows = dict(zip((f"t_{n}" for n in names), cfg.model.num_embeddings_per_feature, strict=True))

    sizes = micro_sizes_to_count(cfg.batch_size, cfg.min_micro_samples)
    distinct = MicroBatchDistinct(names, sizes)

    def batches():
        for index in range(cfg.batches):
            kjt = source.batch("train", index, 0).sparse_features
            if index < cfg.distinct_batches:
                distinct.add(kjt)
            yield cfg.batch_size, {f"t_{n}": kjt[n].values().numpy() for n in names}

    profile = build_profile(batches(), rows, cfg.hot_ids, cfg.exact_max_rows, cfg.sketch_capacity)
    distinct.write_into(profile)
    profile.source = {
        "dataset": cfg.dataset.name,
        "model": cfg.model.name,
        "batch_size": cfg.batch_size,
    }
    return profile


def micro_sizes_to_count(batch_size: int, smallest: int) -> list[int]:
    """Micro-batch sizes whose distinct ids are counted: powers of two from `smallest`
    up to the batch, each dividing it into whole micro-batches."""
    sizes, s = [], 1 << max(0, (smallest - 1).bit_length())
    while s <= batch_size:
        if batch_size % s == 0:
            sizes.append(s)
        s *= 2
    return sizes


class MicroBatchDistinct:
    """Mean distinct ids per table in micro-batches of each size: consecutive samples in
    data order, and after `cluster_order` cuts the batch into batch / size micro-batches."""

    def __init__(self, features: list[str], sizes: list[int]) -> None:
        self.features, self.sizes = features, sizes
        self.sums = {(f, s, c): 0.0 for f in features for s in sizes for c in (False, True)}
        self.counts = {(s, c): 0 for s in sizes for c in (False, True)}

    def add(self, kjt) -> None:
        from pipelines.clustering import cluster_order, permute_kjt

        batch = kjt.stride()
        for size in self.sizes:
            n = batch // size
            for clustered in (False, True):
                ordered = permute_kjt(kjt, cluster_order(kjt, n)) if clustered and n > 1 else kjt
                for f in self.features:
                    jt = ordered[f]
                    offsets, values = jt.offsets().numpy(), jt.values().numpy()
                    for k in range(n):
                        ids = values[offsets[k * size] : offsets[(k + 1) * size]]
                        self.sums[(f, size, clustered)] += len(np.unique(ids))
                self.counts[(size, clustered)] += n

    def write_into(self, profile: AccessProfile) -> None:
        for f in self.features:
            t = profile.table(f"t_{f}")
            for clustered in (False, True):
                out = {
                    str(s): self.sums[(f, s, clustered)] / self.counts[(s, clustered)]
                    for s in self.sizes
                    if self.counts[(s, clustered)]
                }
                if clustered:
                    t.distinct_per_samples_clustered = out
                else:
                    t.distinct_per_samples = out


def plot(profile: AccessProfile, path: Path, named: int = 8) -> None:
    """Coverage curves readable for 26 or 1,000 tables: the `named` largest tables in colour,
    the rest as thin grey lines, and all tables together weighted by their lookups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tables = sorted(profile.tables, key=lambda t: -t.rows)
    fig, ax = plt.subplots(figsize=(8, 5))
    for t in tables[named:]:
        ax.plot([k / t.rows for k in t.curve_k], t.curve_share, lw=0.6, color="0.75")
    colors = plt.get_cmap("tab10").colors
    for t, color in zip(tables[:named], colors, strict=False):
        ax.plot(
            [k / t.rows for k in t.curve_k],
            t.curve_share,
            lw=1.4,
            color=color,
            label=f"{t.name}: {t.rows:,} rows",
        )
    if len(tables) > named:
        ax.plot([], [], lw=0.6, color="0.75", label=f"the other {len(tables) - named} tables")
    grid = np.geomspace(min(1 / t.rows for t in tables), 1.0, 200)
    weights = np.array([t.lookups_per_sample for t in tables])
    if weights.sum() > 0:
        curves = [
            np.interp(
                np.log(grid),
                np.log([max(k, 1) / t.rows for k in t.curve_k]),
                t.curve_share,
                left=0.0,
                right=1.0,
            )
            for t in tables
        ]
        ax.plot(
            grid,
            weights @ np.array(curves) / weights.sum(),
            color="k",
            lw=2.2,
            label="all tables, weighted by lookups",
        )
    ax.set_xscale("log")
    ax.set_xlabel("hottest share of a table's rows (kept in fast memory or replicated)")
    ax.set_ylabel("share of its lookups they serve")
    ax.set_title(
        f"Access frequency: {profile.source.get('dataset', '')}, "
        f"{profile.samples:,} samples, {len(tables)} tables"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(
        fontsize=7,
        loc="upper left",
        title=f"the {min(named, len(tables))} largest tables",
        title_fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_table(profile: AccessProfile) -> str:
    lines = [
        f"{'table':10} {'rows':>11} {'lookups/sample':>14} {'distinct/batch':>14} "
        f"{'top 0.1%':>8} {'top 1%':>7} {'top 10%':>7}  counting"
    ]
    for t in profile.tables:
        c = t.coverage
        lines.append(
            f"{t.name:10} {t.rows:>11,} {t.lookups_per_sample:>14.2f} "
            f"{t.distinct_per_batch:>14,.0f} {c['0.1%']:>8.1%} {c['1%']:>7.1%} "
            f"{c['10%']:>7.1%}  {t.counting}"
        )
    return "\n".join(lines)


register_configs()
ConfigStore.instance().store(name="base_profile", node=ProfileAppConfig)


@hydra_command("profile")
def main(typed: ProfileAppConfig, run_dir: Path) -> None:
    out = Path(typed.output) if typed.output else run_dir
    out.mkdir(parents=True, exist_ok=True)
    profile = profile_dataset(typed)
    profile.save(out / "profile.json")
    plot(profile, out / "profile.png")
    print(summary_table(profile))
    print(f"profile: {out / 'profile.json'}, curves: {out / 'profile.png'}")


if __name__ == "__main__":
    main()
