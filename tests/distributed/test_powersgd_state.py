"""The PowerSGD state book without a Trainer: layouts, draws, export and restore.

Buckets are stand-ins (torch's GradBucket cannot be built by hand), except in the last
test, where a one-rank gloo group in this process lets torch's DDP call the hook.
"""

from __future__ import annotations

import gc
import io
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel

from lightning_speedkit.distributed._powersgd_state import (
    _HookState,
    _ParameterBook,
    _speedkit_powersgd_hook,
)


class _Bucket:
    """Stands in for dist.GradBucket: an index, its parameters, a flat buffer."""

    def __init__(self, index: int, params: list[torch.nn.Parameter]) -> None:
        self._index, self._params = index, params
        self._buffer = torch.zeros(sum(p.numel() for p in params))

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_state_follows_parameters_when_ddp_relays_its_buckets() -> None:
    """DDP's first buckets are in reverse order, later ones in gradient-ready order:
    the state of each parameter must move with it, not stay with the bucket index."""
    a, b, c = (torch.nn.Parameter(torch.zeros(8, 6)) for _ in range(3))
    bias = torch.nn.Parameter(torch.zeros(8))
    names = {id(a): "a", id(b): "b", id(c): "c", id(bias): "bias"}
    state = PowerSGDState(
        None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=2
    )
    book = _ParameterBook(state, names)

    book.on_bucket(_Bucket(0, [a, bias]))  # first layout: {a, bias} and {b, c}
    book.on_bucket(_Bucket(1, [b, c]))
    state.error_dict[0] = torch.cat([torch.full((48,), 1.0), torch.full((8,), 4.0)])
    state.error_dict[1] = torch.cat([torch.full((48,), 2.0), torch.full((48,), 3.0)])
    state.p_memory_dict[0], state.q_memory_dict[0] = torch.full((8,), 1.0), torch.full((6,), 1.0)
    state.p_memory_dict[1] = torch.cat([torch.full((8,), 2.0), torch.full((8,), 3.0)])
    state.q_memory_dict[1] = torch.cat([torch.full((6,), 2.0), torch.full((6,), 3.0)])

    book.on_bucket(_Bucket(0, [c, a]))  # re-laid: {c, a} and {bias, b}
    book.on_bucket(_Bucket(1, [bias, b]))
    assert state.error_dict[0].tolist() == [3.0] * 48 + [1.0] * 48
    assert state.error_dict[1].tolist() == [4.0] * 8 + [2.0] * 48
    assert state.p_memory_dict[0].tolist() == [3.0] * 8 + [1.0] * 8
    assert state.q_memory_dict[1].tolist() == [2.0] * 6  # the bias is not compressed

    exported = book.export()
    assert exported["params"]["bias"]["error"].tolist() == [4.0] * 8
    assert set(exported["params"]["a"]) == {"error", "p", "q"}


def test_a_bucket_that_did_not_move_keeps_its_state() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(8, 6)) for _ in range(3))
    names = {id(a): "a", id(b): "b", id(c): "c"}
    state = PowerSGDState(
        None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=2
    )
    book = _ParameterBook(state, names)
    for index, params in enumerate(([a], [b], [c])):
        book.on_bucket(_Bucket(index, params))
        state.error_dict[index] = torch.full((48,), float(index))
    book.on_bucket(_Bucket(0, [b]))  # buckets 0 and 1 swap; bucket 2 stays as it was
    book.on_bucket(_Bucket(1, [a]))
    book.on_bucket(_Bucket(2, [c]))
    assert [state.error_dict[i][0].item() for i in range(3)] == [1.0, 0.0, 2.0]


def test_factors_saved_at_another_rank_start_afresh() -> None:
    """A run resumed with another `rank` (as the Adam warning advises) keeps the error
    feedback and drops the warm-start factors, which no longer fit."""
    a = torch.nn.Parameter(torch.zeros(32, 32))
    state = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2)
    book = _ParameterBook(state, {id(a): "a"})
    rng = _ParameterBook(PowerSGDState(None), {}).export()["rng"]
    at_rank_1 = {"error": torch.full((1024,), 5.0), "p": torch.ones(32), "q": torch.ones(32)}
    saved = {"iter": 7, "rng": rng, "numel_before": 0, "numel_after": 0}
    book.restore({**saved, "params": {"a": at_rank_1}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        book.on_bucket(_Bucket(0, [a]))
    assert state.error_dict[0].tolist() == [5.0] * 1024
    assert 0 not in state.p_memory_dict  # powerSGD_hook draws fresh factors of rank 4
    assert book.rank_changed
    assert any("start afresh" in str(w.message) for w in caught)
    assert state.iter == 7
    # factors of the run's own rank are taken back as they were saved
    same = _ParameterBook(PowerSGDState(None, matrix_approximation_rank=1), {id(a): "a"})
    same.restore({**saved, "params": {"a": at_rank_1}})
    same.on_bucket(_Bucket(0, [a]))
    assert same.state.p_memory_dict[0].tolist() == [1.0] * 32
    assert not same.rank_changed


def _state(rank: int = 1, start: int = 2) -> PowerSGDState:
    return PowerSGDState(
        None, matrix_approximation_rank=rank, start_powerSGD_iter=start, min_compression_rate=2
    )


def test_compressed_matrices_are_laid_out_as_powersgd_hook_lays_them() -> None:
    """Grouped by shape, groups in order of first appearance, bucket order within a group;
    a bias, and a matrix that would shrink less than twofold, are left out."""
    book = _ParameterBook(_state(), {})
    layout = (("a", (8, 6)), ("bias", (8,)), ("b", (16, 4)), ("c", (8, 6)), ("small", (3, 2)),
              ("conv", (4, 2, 3)))  # fmt: skip
    assert book._compressed(layout) == [
        ("a", 8, 6, 1), ("c", 8, 6, 1), ("b", 16, 4, 1), ("conv", 4, 6, 1),
    ]  # fmt: skip
    wide = _ParameterBook(_state(rank=2), {})
    # rank 2: (8 + 6) * 2 * 2 = 56 > 48 elements, no longer worth it; 16x4: 80 > 64 too
    assert wide._compressed(layout) == []
    big = (("w", (32, 32)),)
    assert wide._compressed(big) == [("w", 32, 32, 2)]


def _three_params() -> dict[str, torch.nn.Parameter]:
    shapes = {"a": (8, 6), "bias": (8,), "b": (8, 6)}
    return {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()}


def _filled_book() -> tuple[_ParameterBook, dict[str, torch.nn.Parameter]]:
    params = _three_params()
    state = _state()
    book = _ParameterBook(state, {id(p): name for name, p in params.items()})
    book.on_bucket(_Bucket(0, [params["a"], params["bias"]]))
    book.on_bucket(_Bucket(1, [params["b"]]))
    state.error_dict[0] = torch.cat([torch.arange(48.0), torch.full((8,), -1.0)])
    state.error_dict[1] = torch.arange(100.0, 148.0)
    state.p_memory_dict[0], state.q_memory_dict[0] = torch.arange(8.0), torch.arange(6.0) + 10
    state.p_memory_dict[1], state.q_memory_dict[1] = torch.arange(8.0) + 20, torch.arange(6.0) + 30
    state.iter, state.total_numel_before_compression, state.total_numel_after_compression = (
        9,
        960,
        60,
    )
    state.rng.rand(3)  # the generator moved on: its position must travel too
    return book, params


def test_export_holds_each_parameter_and_loads_with_weights_only() -> None:
    book, _ = _filled_book()
    buffer = io.BytesIO()
    torch.save(book.export(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # what Lightning's checkpoint loading does
    assert (saved["iter"], saved["numel_before"], saved["numel_after"]) == (9, 960, 60)
    assert saved["params"]["a"]["error"].tolist() == list(range(48))
    assert {k: v.tolist() for k, v in saved["params"]["bias"].items()} == {"error": [-1.0] * 8}
    assert saved["params"]["a"]["p"].tolist() == list(range(8))
    assert saved["params"]["a"]["q"].tolist() == [10.0 + i for i in range(6)]
    assert saved["params"]["b"]["error"].tolist() == [100.0 + i for i in range(48)]
    assert saved["params"]["b"]["q"].tolist() == [30.0 + i for i in range(6)]


def test_restore_lays_the_saved_state_out_for_other_buckets() -> None:
    """A new process: other parameter objects, the buckets in another order."""
    saved = _filled_book()[0].export()
    expected_draws = _filled_book()[0].state.rng.rand(4).tolist()
    params = _three_params()
    state = _state()
    book = _ParameterBook(state, {id(p): name for name, p in params.items()})
    book.restore(saved)
    assert (state.iter, state.total_numel_before_compression) == (9, 960)
    assert state.rng.rand(4).tolist() == expected_draws
    book.on_bucket(_Bucket(0, [params["b"], params["a"]]))  # one bucket of both matrices
    book.on_bucket(_Bucket(1, [params["bias"]]))
    assert state.error_dict[0].tolist() == [100.0 + i for i in range(48)] + list(range(48))
    assert state.p_memory_dict[0].tolist() == [20.0 + i for i in range(8)] + list(range(8))
    assert state.q_memory_dict[0].tolist() == [30.0 + i for i in range(6)] + [
        10.0 + i for i in range(6)
    ]
    assert state.error_dict[1].tolist() == [-1.0] * 8
    assert 1 not in state.p_memory_dict  # a bias has no factors
    assert book.pending == {"a": {}, "bias": {}, "b": {}}  # everything was placed
    # and it exports again as it was saved
    again = book.export()
    for name, piece in saved["params"].items():
        assert {k: v.tolist() for k, v in again["params"][name].items()} == {
            k: v.tolist() for k, v in piece.items()
        }


def test_initial_factors_are_drawn_per_parameter_whatever_the_bucket() -> None:
    a, b = torch.nn.Parameter(torch.zeros(8, 6)), torch.nn.Parameter(torch.zeros(16, 4))
    names = {id(a): "a", id(b): "b"}
    apart, together = _ParameterBook(_state(), names), _ParameterBook(_state(), names)
    apart.on_bucket(first := _Bucket(0, [a]))
    apart.on_bucket(second := _Bucket(1, [b]))
    together.on_bucket(both := _Bucket(0, [b, a]))
    apart.draw_if_due(first)
    assert apart.state.q_memory_dict == {}  # iteration 0 of 2: not compressing yet
    for book in (apart, together):
        book.state.iter = 2
    apart.draw_if_due(first)
    apart.draw_if_due(second)
    together.draw_if_due(both)
    q_a, q_b = apart.state.q_memory_dict[0], apart.state.q_memory_dict[1]
    # shapes of different groups: b (16x4) first, then a (8x6), as in the bucket
    assert torch.equal(together.state.q_memory_dict[0], torch.cat([q_b, q_a]))
    assert together.state.p_memory_dict[0].tolist() == [0.0] * 24
    assert (q_a.numel(), q_b.numel()) == (6, 4)
    assert not torch.equal(q_a[:4], q_b)  # each parameter its own draw

    # warm start keeps the factors it has; without it they are drawn anew each iteration
    warm_q = together.state.q_memory_dict[0].clone()
    together.state.iter = 3
    together.draw_if_due(both)
    assert torch.equal(together.state.q_memory_dict[0], warm_q)
    cold = _ParameterBook(_state(), names, warm_start=False)
    cold.on_bucket(both)
    draws = []
    for step in (2, 3, 2):
        cold.state.iter = step
        cold.draw_if_due(both)
        draws.append(cold.state.q_memory_dict[0].clone())
    assert not torch.equal(draws[0], draws[1])
    assert torch.equal(draws[0], draws[2])  # a function of the iteration, not of the call
    assert cold.state.warm_start is True  # torch's hook reuses what the book put there


def test_hook_state_pickles_without_the_book() -> None:
    state = _state()
    hook_state = _HookState(state, _ParameterBook(state, {}), serialize=True)
    assert set(hook_state.__getstate__()) == {"powersgd", "serialize"}


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo process group of one rank in this process (an in-memory store, no port)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    gc.collect()  # DDP's reducer holds the group: finalize it here, not in a later fork


@pytest.mark.usefixtures("one_rank")
def test_the_hook_compresses_real_ddp_buckets_from_start_iter() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    ddp = DistributedDataParallel(model)
    state = _state(start=2)
    names = {id(p): name for name, p in model.named_parameters()}
    book = _ParameterBook(state, names)
    ddp.register_comm_hook(_HookState(state, book, serialize=True), _speedkit_powersgd_hook)
    x = torch.randn(32, 16)
    ranks = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        ddp(x).pow(2).sum().backward()
        ranks.append(int(torch.linalg.matrix_rank(model[0].weight.grad)))
    assert ranks[:2] == [16, 16]  # plain all-reduce for start_iter iterations
    assert ranks[2] == 1  # then the rank-1 approximation
    assert (state.iter, book.calls) == (3, 3)  # one bucket, one call per backward
    # one compressed iteration: 2 matrices of 256 and 2 biases of 16 before;
    # (16 + 16) per matrix and the biases as they are after
    assert (state.total_numel_before_compression, state.total_numel_after_compression) == (544, 96)
    exported = book.export()["params"]
    assert set(exported["0.weight"]) == {"error", "p", "q"}
    assert set(exported["0.bias"]) == {"error"}
    assert exported["0.weight"]["p"].numel() == 16
