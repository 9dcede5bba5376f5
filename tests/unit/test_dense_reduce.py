"""The dense reduction every pipeline shares (`pipelines/dense_reduce.py`): its fixed bucket
layout, buckets started in order during the backward, and gradients left averaged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipelines.dense_reduce import MIB, BucketedReduce

WORLD = 2


class _Done:
    def wait(self) -> None:
        pass


@pytest.fixture
def collectives(monkeypatch) -> list:
    """A 2-rank group whose other rank holds the same gradients: all_reduce doubles."""
    calls: list = []

    def all_reduce(t, group=None, async_op=False):
        calls.append(("all_reduce", t.numel()))
        t.mul_(WORLD)
        return _Done()

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


def _params(*numels: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]


def test_buckets_take_parameters_in_reverse_order_under_ddps_caps(collectives) -> None:
    quarter = MIB // 4 // 4  # float32 elements in a quarter MiB
    params = _params(quarter, quarter, quarter, 3 * quarter, 5 * quarter, quarter)
    r = BucketedReduce(params, cap_bytes=2 * MIB, first_bytes=MIB)
    # reversed: 1, 5, 3, 1, 1, 1 quarters; the first bucket holds up to 1 MiB
    assert r.buckets == [[0], [1, 2], [3, 4, 5]]
    assert BucketedReduce(params, cap_bytes=0, first_bytes=0).buckets == [[i] for i in range(6)]
    mixed = _params(4, 4) + _params(4, dtype=torch.float64)
    assert BucketedReduce(mixed).buckets == [[0], [1, 2]]  # one dtype per bucket


def test_a_backward_starts_each_bucket_in_order_and_leaves_the_average(collectives) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    unused = torch.nn.Parameter(torch.ones(3))
    params = [*model.parameters(), unused]
    r = BucketedReduce(params, cap_bytes=1024, first_bytes=0)  # about one tensor a bucket
    r.attach()
    x = torch.randn(16, 8)
    model(x).sum().backward()
    expected = torch.func.grad(lambda ps: torch.func.functional_call(model, ps, (x,)).sum())(
        dict(model.named_parameters())
    )
    assert len(collectives) == len(r.buckets) > 2  # every bucket once, the unused one too
    sizes = [sum(r.params[i].numel() for i in b) for b in r.buckets]
    assert [n for _, n in collectives] == sizes  # in bucket order
    for name, p in model.named_parameters():  # two equal ranks: the average is the gradient
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0)
    assert torch.equal(unused.grad, torch.zeros(3))  # missed by the backward: zeros, reduced

    collectives.clear()  # the next backward starts over
    for p in params:
        p.grad = None
    model(x).sum().backward()
    assert len(collectives) == len(r.buckets)


def test_buckets_start_during_the_backward(collectives) -> None:
    """The first bucket's all-reduce starts before the backward reaches the first layer."""
    seen: list = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    r = BucketedReduce(list(model.parameters()), cap_bytes=0, first_bytes=0)
    r.attach()
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(len(collectives)))
    model(torch.randn(2, 4)).sum().backward()
    assert seen and seen[0] > 0 and len(collectives) == 4


def test_start_reduces_the_same_buckets_at_once(collectives) -> None:
    params = _params(5, 7, 9)
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i))
    r = BucketedReduce(params, cap_bytes=0, first_bytes=0)
    finish = r.start()
    finish()
    assert [n for _, n in collectives] == [9, 7, 5]
    assert [float(p.grad[0]) for p in params] == [0.0, 1.0, 2.0]
