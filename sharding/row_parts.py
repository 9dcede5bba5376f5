"""Row parts: a table's (or a cold part's) rows dealt out to k parts, row c to part c mod k,
each part its own table `<name><suffix>` on one rank. Uneven parts are fine: each part is
table-wise, so TorchRec never buckets ids by an even row split."""

from __future__ import annotations


def cold_suffixes(parts: int) -> list[str]:
    """Names of a split table's cold part: `_cold` kept whole, else `_cold0` .. `_cold{k-1}`."""
    return ["_cold"] if parts <= 1 else [f"_cold{j}" for j in range(parts)]


def cold_part_rows(cold_rows: int, parts: int) -> list[int]:
    """Rows of each row part of a cold part when cold row c goes to part c mod `parts`."""
    return [(cold_rows - j + parts - 1) // parts for j in range(max(1, parts))]
