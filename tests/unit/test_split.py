"""A hot/cold split model computes the same function, and trains the same, as the unsplit one."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.config import ModelConfig, SyntheticConfig
from recsys.data.synthetic import SyntheticCriteo
from recsys.models.dlrm import feature_names, table_configs
from recsys.models.split import (
    SplitRemap,
    SplitSparseArch,
    sequence_cold_configs,
    split_configs,
    split_weights,
)
from sharding.row_parts import cold_part_rows, cold_suffixes

ROWS = [50, 40, 100, 30] + [20] * 22


def models(
    hot: dict[str, torch.Tensor],
    sequences: frozenset = frozenset(),
    parts: dict[str, int] | None = None,
) -> tuple[DLRMTrain, DLRMTrain, SplitRemap]:
    """The plain model and its split copy; `sequences`: the tables whose cold parts are
    sequence tables; `parts`: cold row parts per feature."""
    parts = parts or {}
    cfg = ModelConfig(
        num_embeddings_per_feature=ROWS,
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    torch.manual_seed(0)
    tables = table_configs(cfg)
    plain = DLRMTrain(DLRM(EmbeddingBagCollection(tables), 13, [16, 8], [16, 1]))
    hot_rows = {f"t_{f}": len(ids) for f, ids in hot.items()}
    configs = split_configs(tables, hot_rows, {f"t_{f}": k for f, k in parts.items()})
    ec = None
    if sequences:
        configs, cold = sequence_cold_configs(configs, sequences)
        ec = EmbeddingCollection(cold)
    split_ebc = EmbeddingBagCollection(configs)
    split = DLRMTrain(DLRM(EmbeddingBagCollection(tables), 13, [16, 8], [16, 1]))
    split.load_state_dict(plain.state_dict())  # same dense weights
    split.model.sparse_arch = SplitSparseArch(split_ebc, feature_names(cfg), ec)
    bags = plain.model.sparse_arch.embedding_bag_collection.embedding_bags
    new_bags = dict(split_ebc.embedding_bags) | (dict(ec.embeddings) if ec else {})
    for name, bag in bags.items():
        feature = name[2:]
        if feature in hot:
            k = parts.get(feature, 1)
            h, cold = split_weights(bag.weight.data, hot[feature], k)
            if len(hot[feature]):
                new_bags[name + "_hot"].weight.data.copy_(h)
            for suffix, c in zip(cold_suffixes(k), cold, strict=True):
                new_bags[name + suffix].weight.data.copy_(c)
        else:
            new_bags[name].weight.data.copy_(bag.weight.data)
    return plain, split, SplitRemap(hot, parts)


def batch(index: int):
    names = [f"cat_{i}" for i in range(26)]
    return SyntheticCriteo(SyntheticConfig(), ROWS, names, 13, 64).batch("train", index, 0)


HOT = {"cat_0": torch.tensor([3, 7, 1, 49]), "cat_2": torch.tensor([0, 99, 42])}


def test_remap_routes_each_id_to_one_part_in_order() -> None:
    b = batch(0)
    out = SplitRemap(HOT)(b.sparse_features)
    assert "cat_0_hot" in out.keys() and "cat_0_cold" in out.keys() and "cat_1" in out.keys()
    ids = b.sparse_features["cat_0"].values()
    hot_len = out["cat_0_hot"].lengths()
    assert torch.equal(hot_len + out["cat_0_cold"].lengths(), b.sparse_features["cat_0"].lengths())
    is_hot = torch.isin(ids, HOT["cat_0"])
    assert torch.equal(hot_len.bool(), is_hot)
    hot_sorted = HOT["cat_0"].sort().values
    assert torch.equal(hot_sorted[out["cat_0_hot"].values()], ids[is_hot])
    cold = out["cat_0_cold"].values()
    assert int(cold.max()) < 50 - 4 and int(cold.min()) >= 0
    assert torch.equal(out["cat_1"].values(), b.sparse_features["cat_1"].values())


def test_cold_row_parts_take_every_cold_id_once() -> None:
    b = batch(0)
    out = SplitRemap(HOT, {"cat_2": 3})(b.sparse_features)
    ids, lengths = b.sparse_features["cat_2"].values(), b.sparse_features["cat_2"].lengths()
    parts = [out[f"cat_2_cold{j}"] for j in range(3)]
    assert torch.equal(sum(p.lengths() for p in parts) + out["cat_2_hot"].lengths(), lengths)
    hot = HOT["cat_2"].sort().values
    cold_ids = ids[~torch.isin(ids, hot)]
    cold_rows = cold_ids - torch.searchsorted(hot, cold_ids)
    for j, p in enumerate(parts):  # part j holds cold rows c = 3 * row + j, in order
        assert torch.equal(p.values() * 3 + j, cold_rows[cold_rows % 3 == j])
        assert int(p.values().max()) < cold_part_rows(100 - 3, 3)[j]


@pytest.mark.parametrize("bags", ["one id", "0 to 3 ids"])
def test_remap_sends_each_bags_ids_to_their_parts_in_the_bags_order(bags: str) -> None:
    """Every sample's bag, id by id, against the rule itself: hot id -> its hot row; any
    other -> cold row c (c = id - hot ids below it), in part c mod k at row c // k; with one
    id a bag (the remap's shortcut there) and with bags of 0 to 3 ids."""
    gen = torch.Generator().manual_seed(len(bags))
    names, batch = ["x", "y", "z", "w"], 17
    if bags == "one id":
        lengths = torch.ones(len(names) * batch, dtype=torch.int32)
    else:
        lengths = torch.randint(0, 4, (len(names) * batch,), generator=gen, dtype=torch.int32)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
    kjt = KeyedJaggedTensor(keys=names, values=values, lengths=lengths, stride=batch)
    hot = {
        "x": torch.tensor([5, 2]),
        "y": torch.zeros(0, dtype=torch.int64),
        "z": torch.tensor([0, 29, 7]),
    }
    parts = {"y": 2, "z": 3}
    out = SplitRemap(hot, parts)(kjt)
    for f, ids in hot.items():
        k, hot_sorted = parts.get(f, 1), sorted(ids.tolist())
        suffixes = ["_cold"] if k == 1 else cold_suffixes(k)
        for s, bag in enumerate(kjt[f].to_dense()):
            want = {x: [] for x in (["_hot"] if hot_sorted else []) + suffixes}
            for i in bag.tolist():
                if i in hot_sorted:
                    want["_hot"].append(hot_sorted.index(i))
                else:
                    c = i - sum(h < i for h in hot_sorted)
                    want[suffixes[c % k]].append(c // k)
            for x, rows in want.items():
                assert out[f + x].to_dense()[s].tolist() == rows, (f, s, x)
    assert torch.equal(out["w"].values(), kjt["w"].values())  # not split: as it was


def test_a_table_in_row_parts_only_keeps_every_id() -> None:
    b = batch(0)
    out = SplitRemap({"cat_1": torch.zeros(0, dtype=torch.int64)}, {"cat_1": 3})(b.sparse_features)
    assert "cat_1_hot" not in out.keys() and "cat_1" not in out.keys()
    ids = b.sparse_features["cat_1"].values()
    for j in range(3):  # part j holds row r = 3 * row + j of the whole table, in order
        assert torch.equal(out[f"cat_1_cold{j}"].values() * 3 + j, ids[ids % 3 == j])


# cold parts in row parts; and cat_1, a table with no hot rows, in row parts only
PARTS = [{}, {"cat_0": 2, "cat_2": 3}, {"cat_1": 2}]


WHOLE = {"cat_1": torch.zeros(0, dtype=torch.int64)}


# which split tables' cold parts are sequence tables: none, all, one (the other pooled)
SEQUENCES = [frozenset(), frozenset({"t_cat_0", "t_cat_2"}), frozenset({"t_cat_2"})]


@pytest.mark.parametrize("sequences", SEQUENCES)
@pytest.mark.parametrize("parts", PARTS)
def test_split_model_computes_the_same_function(sequences: frozenset, parts) -> None:
    plain, split, remap = models(HOT | WHOLE if "cat_1" in parts else HOT, sequences, parts)
    for index in range(3):
        b = batch(index)
        loss_p, (_, logits_p, _) = plain(b)
        b.sparse_features = remap(b.sparse_features)
        loss_s, (_, logits_s, _) = split(b)
        assert torch.allclose(logits_p, logits_s, atol=1e-6)
        assert torch.allclose(loss_p, loss_s, atol=1e-7)


@pytest.mark.parametrize("sequences", SEQUENCES)
@pytest.mark.parametrize("parts", PARTS)
def test_split_model_trains_the_same_with_sgd(sequences: frozenset, parts) -> None:
    plain, split, remap = models(HOT | WHOLE if "cat_1" in parts else HOT, sequences, parts)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.5)
    opt_s = torch.optim.SGD(split.parameters(), lr=0.5)
    for index in range(5):
        b = batch(index)
        opt_p.zero_grad()
        loss_p, _ = plain(b)
        loss_p.backward()
        opt_p.step()
        b.sparse_features = remap(b.sparse_features)
        opt_s.zero_grad()
        loss_s, _ = split(b)
        loss_s.backward()
        opt_s.step()
        assert torch.allclose(loss_p, loss_s, rtol=1e-5), index


def _backward_nodes(out: torch.Tensor) -> list[str]:
    seen, todo, names = set(), [out.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo += [next_fn for next_fn, _ in node.next_functions]
    return names


@pytest.mark.parametrize("sequences", SEQUENCES)
def test_split_model_reads_its_pooled_bags_with_one_split(sequences: frozenset) -> None:
    """Each key's pooled bag is a view of one split of the collection's output: a slice per
    key would make each key's backward zero a gradient of the whole B x (keys x D) output
    (measured, 2 ranks at 2048 samples on loopback, pooled cold parts: 96.5 ms a step with
    a slice per key, 65.7 with the split)."""
    _, split, remap = models(HOT, sequences)
    b = batch(0)
    b.sparse_features = remap(b.sparse_features)
    nodes = _backward_nodes(split.model.sparse_arch(b.sparse_features))
    assert not [n for n in nodes if n.startswith(("SliceBackward", "NarrowBackward"))], nodes
    assert sum(n.startswith("SplitWithSizesBackward") for n in nodes) == 1, nodes


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("hot", [0, 5])
def test_merge_weights_undoes_split_weights(parts: int, hot: int) -> None:
    """recsys.export's merge: the hot rows and cold parts give back the whole table."""
    from recsys.models.split import merge_weights

    weight = torch.randn(23, 4)
    hot_ids = torch.randperm(23)[:hot]
    hot_rows, cold = split_weights(weight, hot_ids, parts)
    assert torch.equal(merge_weights(hot_rows, hot_ids, cold, 23), weight)
    with pytest.raises(ValueError, match="do not make 24"):
        merge_weights(hot_rows, hot_ids, cold, 24)
