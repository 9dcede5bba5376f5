"""Your own data: the schema-driven converter (recsys.data.tabular), its layout read back by
the loader (variable bags), and NE as TorchRec defines it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from recsys.data.atomic import OutputDirError
from recsys.data.criteo_binary import CriteoBinary
from recsys.data.prepared import CriteoDataError
from recsys.data.tabular import TabularConfig, TabularError, convert_tabular

LOG = """clicked,ts,price,user,item,tags
1,10,3.5,alice,i1,a|b
0,9,,bob,i2,b
1,8,10,alice,i3,
0,1,2,carol,i1,a|c|d
1,2,1,bob,i2,b
"""


def _cfg(tmp: Path, **kw) -> TabularConfig:
    fields = dict(
        input=str(tmp / "logs.csv"),
        output=str(tmp / "out"),
        label="clicked",
        dense=["price"],
        categorical=["user", "item"],
        multi_valued=["tags"],
        sort_by="ts",
        progress=False,
    )
    return TabularConfig(**(fields | kw))


def _load(out: Path, name: str = "logs") -> dict:
    arrays = {k: np.load(out / f"{name}_{k}.npy") for k in ("dense", "sparse", "labels")}
    with np.load(out / f"{name}_sparse_multi_hot.npz") as z:
        arrays["bags"] = [z[str(t)] for t in range(len(z.files))]
    return arrays


def test_a_csv_becomes_the_prepared_layout_in_time_order(tmp_path: Path) -> None:
    (tmp_path / "logs.csv").write_text(LOG)
    summary = convert_tabular(_cfg(tmp_path))
    out = tmp_path / "out"
    a = _load(out)
    # rows by ts (numbers as numbers: 9 before 10): carol, bob, alice(8), bob(9), alice(10)
    assert a["labels"][:, 0].tolist() == [0, 1, 1, 0, 1]
    np.testing.assert_allclose(a["dense"][:, 0], np.log1p([2, 1, 10, 0, 3.5]), rtol=1e-6)
    vocab = {t: (out / "vocab" / f"{t}.txt").read_text().splitlines() for t in range(3)}
    assert vocab[0] == ["alice", "bob", "carol"]  # by count, then by value
    assert vocab[2] == ["b", "a", "c", "d"]
    row = {v: i + 1 for i, v in enumerate(vocab[0])}
    assert a["sparse"][:, 0].tolist() == [row[u] for u in ["carol", "bob", "alice", "bob", "alice"]]
    tags = {v: i + 1 for i, v in enumerate(vocab[2])}
    assert a["bags"][2].tolist() == [
        [tags["a"], tags["c"], tags["d"]],
        [tags["b"], -1, -1],
        [0, -1, -1],  # no tags: the missing row, as a one-value column's
        [tags["b"], -1, -1],
        [tags["a"], tags["b"], -1],
    ]
    override = "model.dense_in_features=1 model.num_embeddings_per_feature=[4,4,5]"
    assert summary["model_override"] == override
    assert (out / "model_override.txt").read_text().strip() == override
    schema = json.loads((out / "schema.json").read_text())
    assert [t["column"] for t in schema["tables"]] == ["user", "item", "tags"] and schema["bags"]


def test_the_loader_reads_variable_bags_and_the_shapes_it_needs(tmp_path: Path) -> None:
    (tmp_path / "logs.csv").write_text(LOG)
    convert_tabular(_cfg(tmp_path))
    source = CriteoBinary(
        tmp_path / "out",
        [4, 4, 5],
        ["cat_0", "cat_1", "cat_2"],
        1,
        1,
        holdout_fraction=0.4,
        dense_features=1,
    )
    batch = source.batch("train", 0, 0)  # the first row: carol's, bag a|c|d
    kjt = batch.sparse_features
    assert kjt["cat_2"].lengths().tolist() == [3] and len(kjt["cat_2"].values()) == 3
    assert kjt["cat_0"].lengths().tolist() == [1]
    with pytest.raises(CriteoDataError, match=r"hold 1 dense and 3 categorical.*model_override"):
        CriteoBinary(tmp_path / "out", [1000] * 26, [f"cat_{i}" for i in range(26)], 1, 1)


def test_hashing_vocab_reuse_and_thresholded_labels(tmp_path: Path) -> None:
    (tmp_path / "logs.csv").write_text(LOG)
    convert_tabular(
        _cfg(
            tmp_path,
            categories="hash",
            hash_buckets=64,
            label="price",
            label_threshold=3.0,
            dense=[],
            categorical=["user", "item", "clicked"],
            skip_bad_rows=True,
        )
    )
    a = _load(tmp_path / "out")
    assert a["labels"][:, 0].tolist() == [0, 0, 1, 1]  # price >= 3; bob's empty price skipped
    assert 0 < a["sparse"][:, :3].min() and a["sparse"].max() < 64  # tags: one row empty
    # new data converted with a saved conversion's schema and vocabularies
    convert_tabular(_cfg(tmp_path, overwrite=True))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "day2.csv").write_text("clicked,ts,price,user,item,tags\n1,3,1,dave,i1,b\n")
    convert_tabular(
        TabularConfig(
            input=str(tmp_path / "new"),
            output=str(tmp_path / "new_out"),
            vocab_from=str(tmp_path / "out"),
            progress=False,
        )
    )
    b = _load(tmp_path / "new_out", "day2")
    assert b["sparse"].tolist() == [[0, 1, 1]]  # dave unseen: row 0; i1 and b as before


def test_bad_rows_are_named_or_skipped_and_nothing_partial_is_left(tmp_path: Path) -> None:
    (tmp_path / "logs.csv").write_text(LOG + "x,3,1,bob,i2,b\n1,4,cheap,bob,i2,b\n")
    with pytest.raises(
        TabularError,
        match=r"logs.csv: row 6: label column 'clicked' is 'x', "
        r"not 0 or 1 \(2 bad rows in all\)",
    ):
        convert_tabular(_cfg(tmp_path))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    summary = convert_tabular(_cfg(tmp_path, skip_bad_rows=True))
    assert summary["rows"] == 5 and summary["bad_lines"] == 2
    with pytest.raises(OutputDirError, match="overwrite=true"):
        convert_tabular(_cfg(tmp_path))
    with pytest.raises(TabularError, match=r"has no column 'price2'.*fix the schema"):
        convert_tabular(_cfg(tmp_path, dense=["price2"], overwrite=True))
    with pytest.raises(TabularError, match="'user' is named twice"):
        convert_tabular(_cfg(tmp_path, dense=["user"], overwrite=True))


def test_parquet_input(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {"y": [1, 0, 1], "n": [1.5, None, 3.0], "u": [7, 8, 7], "g": ["x|y", None, "y"]}
    )
    pq.write_table(table, tmp_path / "t.parquet")
    convert_tabular(
        TabularConfig(
            input=str(tmp_path / "t.parquet"),
            output=str(tmp_path / "o"),
            label="y",
            dense=["n"],
            categorical=["u"],
            multi_valued=["g"],
            progress=False,
        )
    )
    a = _load(tmp_path / "o", "t")
    assert a["labels"][:, 0].tolist() == [1, 0, 1]
    assert a["sparse"][:, 0].tolist() == [1, 2, 1]  # 7 twice: row 1
    assert (a["bags"][1] >= 0).sum(1).tolist() == [2, 1, 1]


def test_ne_is_one_for_the_base_rate_and_lower_for_a_better_predictor() -> None:
    """TorchRec's NE: cross entropy in bits over the base rate's entropy in bits."""
    from recsys.metrics import normalized_entropy

    labels = torch.tensor([1.0, 0, 0, 1, 1, 0, 1, 1])
    n, pos = torch.tensor(8.0, dtype=torch.float64), labels.sum().double()

    def ne(p: torch.Tensor) -> float:
        bce = torch.nn.functional.binary_cross_entropy(p, labels, reduction="sum").double()
        return normalized_entropy(bce, n, pos)

    assert ne(torch.full((8,), 5 / 8)) == pytest.approx(1.0, rel=1e-6)
    assert ne(torch.where(labels > 0, 0.9, 0.1)) < 0.5


@pytest.mark.parametrize("config", ["config", "plan", "predict", "profile"])
def test_the_movielens_preset_brings_its_model_to_every_command(config: str) -> None:
    """`dataset=movielens100k` picks the model sized to the conversion (the sizes its
    model_override.txt holds: tests/commands/test_workflow.py) in every command's config."""
    from conftest import CONF_DIR
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from recsys.app.predict import PredictConfig
    from recsys.app.profile import ProfileAppConfig

    for name, node in (("base_predict", PredictConfig), ("base_profile", ProfileAppConfig)):
        ConfigStore.instance().store(name=name, node=node)  # as their modules do on import
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config, overrides=["dataset=movielens100k"])
    assert list(cfg.model.num_embeddings_per_feature) == [944, 1683, 3, 22, 796, 20]
    assert cfg.model.dense_in_features == 2 and cfg.dataset.name == "movielens100k"


def test_a_schema_without_dense_columns_converts_to_what_its_override_says(tmp_path) -> None:
    """Avazu's natural schema: categorical columns only. One constant dense column stands in,
    as model_override's model.dense_in_features=1 says (tests/ranks/test_faults.py trains it)."""
    (tmp_path / "logs.csv").write_text(LOG)
    summary = convert_tabular(_cfg(tmp_path, dense=[]))
    dense = np.load(tmp_path / "out" / "logs_dense.npy")
    assert dense.shape == (5, 1) and not dense.any()
    assert summary["model_override"].startswith("model.dense_in_features=1 ")


def test_a_numeric_label_names_label_threshold_and_skipping_never_leaves_one_class(
    tmp_path: Path,
) -> None:
    ratings = "rating,user,item\n5,alice,i1\n1,bob,i2\n4,carol,i1\n"
    (tmp_path / "logs.csv").write_text(ratings)
    cfg = _cfg(tmp_path, label="rating", dense=[], multi_valued=[], sort_by=None)
    message = (
        r"row 1: label column 'rating' is '5', not 0 or 1 \(2 bad rows in all\); the "
        r"label column 'rating' holds numbers other than 0 and 1: pass "
        r"label_threshold=<value> to count a click where the label is >= it"
    )
    for skip in (False, True):  # skipping would keep none, or one class: refused alike
        with pytest.raises(TabularError, match=message):
            convert_tabular(replace(cfg, skip_bad_rows=skip))
    summary = convert_tabular(replace(cfg, label_threshold=4))
    assert summary["rows"] == 3 and summary["files"][0]["clicks"] == 2
    # skipping text labels that were the other class: refused, nothing written
    (tmp_path / "logs.csv").write_text("clicked,user,item\n1,a,i1\nno,b,i2\n1,c,i1\nno,d,i3\n")
    with pytest.raises(
        TabularError,
        match=r"skip_bad_rows=true skipped 2 rows and left 2 whose "
        r"labels are all 1: no model can learn from one class",
    ):
        convert_tabular(
            _cfg(
                tmp_path,
                output=str(tmp_path / "o2"),
                dense=[],
                multi_valued=[],
                sort_by=None,
                skip_bad_rows=True,
            )
        )
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("given", ["tab", "\\t", "\t"])
def test_a_tab_separator_can_be_named(tmp_path: Path, given: str) -> None:
    (tmp_path / "logs.csv").write_text(LOG.replace(",", "\t"))
    assert convert_tabular(_cfg(tmp_path, separator=given))["rows"] == 5


def test_a_separator_of_several_characters_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "logs.csv").write_text(LOG)
    with pytest.raises(
        TabularError,
        match=r"separator='::': give one character, or one of tab, "
        r"\\t, comma, semicolon, space, pipe \(e.g. separator=tab\)",
    ):
        convert_tabular(_cfg(tmp_path, separator="::"))
