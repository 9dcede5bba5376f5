"""The emulated link's units: tc's rates and sizes, and GSO packets that fit tbf's bucket."""

from __future__ import annotations

import pytest

from benchmarks import netns


def test_gso_packets_fit_the_bucket_with_their_headers() -> None:
    for burst in ("8kb", "24kb", "64kb"):
        limit = netns.gso_limit(burst)
        segments = -(-limit // 1448)  # MSS at MTU 1500 with timestamps
        assert limit + 66 * segments <= netns.size_bytes(burst)  # Ethernet + IP + TCP headers
    assert netns.gso_limit("256kb") == netns.GSO_MAX


def test_rate_and_burst_units() -> None:
    assert netns.rate_bits("1200mbit") == 1.2e9 and netns.rate_bits("1gbit") == 1e9
    assert netns.size_bytes("24kb") == 24 * 1024 and netns.size_bytes("1mb") == 2**20
    with pytest.raises(ValueError, match="tc's units"):
        netns.rate_bits("fast")
    with pytest.raises(ValueError, match="tc's units"):
        netns.size_bytes("big")
