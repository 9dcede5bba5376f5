"""The MovieLens benchmark's baselines see DLRM's own inputs (benchmarks/movielens.py)."""

from __future__ import annotations

import numpy as np

from benchmarks.movielens import one_hot, tree_features


def test_logistic_regression_sees_every_id_of_every_table_as_a_column() -> None:
    dense = np.array([[0.5], [1.5]])
    ids = [
        [np.array([1]), np.array([2])],  # a one-id table of 3 rows
        [np.array([0, 3]), np.array([], dtype=np.int64)],
    ]  # a bag table of 4 rows
    x = one_hot(dense, ids, [3, 4]).toarray()
    assert x.tolist() == [[0, 1, 0, 1, 0, 0, 1, 0.5], [0, 0, 1, 0, 0, 0, 0, 1.5]]


def test_the_trees_keep_the_kept_ids_as_categories_and_pool_the_rest() -> None:
    dense = np.array([[7.0], [8.0], [9.0]])
    ids = [
        [np.array([5]), np.array([6]), np.array([9])],
        [np.array([1, 2]), np.array([2]), np.array([3])],
    ]
    keep = [np.array([6, 5]), np.array([2, 1])]  # by count in training; 9 and 3 were not kept
    x = tree_features(dense, ids, keep)
    assert x.tolist() == [[1, 1, 1, 7.0], [0, 1, 0, 8.0], [254, 0, 0, 9.0]]
