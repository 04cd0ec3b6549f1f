"""``auto`` keeps a module's own forward where it was timed clearly faster than every backend.

The timing runs on exact times: each timed run moves a virtual clock by what the test
says it costs (:func:`rig_auto_timing`), never by wall-clock time.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_speedkit import swap_attention
from lightning_speedkit._surgery import replaced_forward
from lightning_speedkit.attention import _auto_timing, _swapped_forward, packed_documents
from lightning_speedkit.attention._parity import Run
from lightning_speedkit.attention.backends import BACKENDS
from lightning_speedkit.data import PackingCollate
from tests.helpers.clock import VirtualClock


def rig_auto_timing(monkeypatch: pytest.MonkeyPatch, *, own: float, fused: float) -> list[str]:
    """Time every check on a virtual clock: the module's own forward(+backward) costs
    ``own`` seconds a run, each backend ``fused``; the real :func:`pick_fastest` decides.

    Returns the backends picked, one per timing.
    """
    clock, real, picked = VirtualClock(), _swapped_forward.pick_fastest, []

    def costs(run: Run, seconds: float) -> None:
        again = run.again

        def timed() -> None:
            again()
            clock.sleep(seconds)

        monkeypatch.setattr(run, "again", timed)

    def pick(own_run: Run, passing: Any, **_: Any) -> tuple[str, float, float | None]:
        costs(own_run, own)
        for _backend, _error, run in passing:
            costs(run, fused)
        result = real(own_run, passing, clock=clock)
        picked.append(result[0])
        return result

    monkeypatch.setattr(_swapped_forward, "pick_fastest", pick)
    return picked


pytestmark = pytest.mark.own_timing  # these tests drive the clock: the margin is real


class EagerAttention(nn.Module):
    """Attention written out, CLIP-text-encoder style: q @ k^T, softmax, @ v over heads;
    named so that no family claims it (found by a trace: the ``traced`` family)."""

    def __init__(self, dim: int = 16, groups: int = 2) -> None:
        super().__init__()
        self.groups = groups
        self.inwards, self.outwards = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.reshape(B, T, self.groups, C // self.groups).transpose(1, 2)
            for t in self.inwards(x).chunk(3, dim=-1)
        )
        scores = (q @ k.transpose(-2, -1)) * (C // self.groups) ** -0.5
        out = scores.softmax(dim=-1) @ v
        return self.outwards(out.transpose(1, 2).reshape(B, T, C))


class Encoder(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.attn, self.head = nn.LayerNorm(dim), EagerAttention(dim), nn.Linear(dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x + self.attn(self.norm(x)))


def _clip_text() -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    config = CLIPTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16, attention_dropout=0.0,
        dropout=0.0, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    )  # fmt: skip
    return CLIPTextModel(config).eval()


def _encoder_case() -> tuple[nn.Module, tuple[Tensor, ...]]:
    return Encoder(), (torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1)),)


def _clip_case() -> tuple[nn.Module, tuple[Tensor, ...]]:
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return _clip_text(), (ids,)


CASES = {"eager encoder (traced)": _encoder_case, "transformers CLIPTextModel": _clip_case}


def _outputs(model: nn.Module, inputs: tuple[Tensor, ...]) -> list[Tensor]:
    out = model(*inputs)
    out = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
    out.sum().backward()
    return [out.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize("case", list(CASES))
def test_own_forward_clearly_faster_is_kept_with_the_ratio_in_the_report(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, inputs = CASES[case]()
    plain = copy.deepcopy(model)
    rig_auto_timing(monkeypatch, own=1.0, fused=2.0)  # every backend 0.50x
    with pytest.warns(
        UserWarning, match=r"own forward faster: .* ran at 0\.50x the own forward's speed"
    ):
        report = swap_attention(model, "auto", sample=inputs)
    (entry,) = report.modules
    assert entry.status == "reverted"
    assert entry.speedup == pytest.approx(0.5)
    assert "own forward faster" in entry.reason
    assert "0.50x" in entry.reason
    assert report.reverted == [(entry.name, entry.reason)]
    assert report.swapped == []
    assert "| reverted | - | 0.50x | own forward faster" in report.to_markdown()
    assert entry.packed_backend in BACKENDS  # the passing backend stays, for packed batches
    module = model.get_submodule(entry.name)
    assert replaced_forward(module).packed_only
    # Bit for bit the module that was never swapped: outputs and every gradient.
    for ours, theirs in zip(_outputs(model, inputs), _outputs(plain, inputs), strict=True):
        assert torch.equal(ours, theirs)


def test_auto_times_against_its_own_forward_even_with_one_backend_and_no_measure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One passing backend used to be kept untimed unless `measure`: own is a candidate too.
    monkeypatch.setattr(_swapped_forward, "auto_candidates", lambda device: ("sdpa",))
    rig_auto_timing(monkeypatch, own=1.0, fused=2.0)
    model, inputs = _encoder_case()
    with pytest.warns(UserWarning, match="own forward faster"):
        report = swap_attention(model, "auto", sample=inputs, measure=False)
    (entry,) = report.modules
    assert (entry.status, entry.speedup) == ("reverted", pytest.approx(0.5))


def test_the_modules_of_a_kind_keep_their_own_forward_alike_said_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(EagerAttention(), nn.LayerNorm(16), EagerAttention())
    picked = rig_auto_timing(monkeypatch, own=1.0, fused=1.6)
    with pytest.warns(UserWarning, match="own forward faster") as caught:
        report = swap_attention(model, "auto", sample=torch.randn(2, 8, 16))
    assert [m.status for m in report.modules] == ["reverted", "reverted"]
    assert len(picked) == 1  # one timing for the kind, its verdict shared
    assert sum("own forward faster" in str(w.message) for w in caught) == 1
    assert "the modules of its kind called later keep theirs too" in str(caught[0].message)


@pytest.mark.parametrize("case", list(CASES))
def test_a_faster_backend_is_swapped_in_as_before(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, inputs = CASES[case]()
    rig_auto_timing(monkeypatch, own=2.0, fused=1.0)
    report = swap_attention(model, "auto", sample=inputs)
    (entry,) = report.modules
    assert (entry.status, entry.reason) == ("active", "")
    assert entry.speedup == pytest.approx(2.0)
    assert replaced_forward(model.get_submodule(entry.name)) is not None


@pytest.mark.parametrize("ratio", [0.95, 0.875])
def test_own_forward_faster_within_the_margin_stays_swapped(
    ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At the margin itself stays swapped: 0.875 (a binary fraction, so the virtual clock's
    # sums and differences are exact) stands for it.
    monkeypatch.setattr(_auto_timing, "OWN_FASTER_BELOW", 0.875)
    model, inputs = _encoder_case()
    rig_auto_timing(monkeypatch, own=ratio, fused=1.0)  # noise, not a verdict
    report = swap_attention(model, "auto", sample=inputs)
    (entry,) = report.modules
    assert entry.status == "active"
    assert entry.speedup == pytest.approx(ratio)


def test_a_packed_batch_keeps_the_swap_even_where_own_is_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Only the swapped attention keeps packed documents apart: the module's own forward
    # would let the tokens of one document attend to those of the next.
    rig_auto_timing(monkeypatch, own=1.0, fused=2.0)
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    plain = copy.deepcopy(model)
    report = swap_attention(model, "auto")
    samples = [{"input_ids": torch.arange(3)}, {"input_ids": torch.arange(5)}]
    batch = PackingCollate(max_tokens=8)(samples)
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(2))
    with packed_documents(batch):
        out = model(x)  # the first real call: checked and timed with the documents active
    (entry,) = report.modules
    assert entry.status == "active", entry.reason
    assert entry.speedup == pytest.approx(0.5)
    apart = torch.cat([plain(x[:, :3]), plain(x[:, 3:])], dim=1)  # each document alone
    torch.testing.assert_close(out, apart, rtol=1e-5, atol=1e-5)
    assert (plain(x) - apart).abs().max() > 1e-3  # the own forward would have mixed them


def test_own_forward_kept_on_an_unpacked_call_still_keeps_later_packed_documents_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The verdict is made on the first training call; where that call is unpacked and the
    module keeps its own forward, a later packed batch runs the checked backend: the own
    forward would let the tokens of one document attend to the next's (it did, before)."""
    rig_auto_timing(monkeypatch, own=1.0, fused=2.0)
    model, inputs = _encoder_case()
    plain = copy.deepcopy(model)
    report = swap_attention(model, "auto")
    with pytest.warns(UserWarning, match="packed batches still run"):
        model(*inputs).sum().backward()  # the first training call: unpacked, own kept
    (entry,) = report.modules
    assert entry.status == "reverted"
    assert entry.packed_backend in BACKENDS
    model.zero_grad()
    samples = [{"input_ids": torch.arange(3)}, {"input_ids": torch.arange(5)}]
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(2))
    with packed_documents(PackingCollate(max_tokens=8)(samples)):
        out = model(x)
        out.sum().backward()
    apart = torch.cat([plain(x[:, :3]), plain(x[:, 3:])], dim=1)  # each document alone
    apart.sum().backward()
    torch.testing.assert_close(out, apart, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)
    assert (plain(x) - apart).abs().max() > 1e-3  # the own forward would have mixed them
    torch.testing.assert_close(model(*inputs), plain(*inputs), rtol=0, atol=0)  # unpacked: own


def test_a_named_backend_slower_than_own_stays_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = _encoder_case()
    rig_auto_timing(monkeypatch, own=1.0, fused=2.0)
    report = swap_attention(model, "sdpa", sample=inputs)  # the user's explicit choice
    (entry,) = report.modules
    assert entry.status == "active"
    assert entry.speedup == pytest.approx(0.5)  # measured and reported, not acted on


def test_a_first_call_without_gradients_settles_nothing_the_training_call_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The validation sanity check comes first in a fit: no gradients, and its batch may
    be unpacked where the training batches are packed. Settled there, the verdict kept
    the module's own forward, and the packed training batches mixed their documents."""
    rig_auto_timing(monkeypatch, own=1.0, fused=2.0)
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    plain = copy.deepcopy(model)
    report = swap_attention(model, "auto")
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # (in eval mode this layer runs its fused path, not the module)
        model(x)  # as the sanity check: unpacked, no gradients
    (entry,) = report.modules
    assert entry.status == "active"  # nothing settled
    samples = [{"input_ids": torch.arange(3)}, {"input_ids": torch.arange(5)}]
    with packed_documents(PackingCollate(max_tokens=8)(samples)):
        out = model(x.requires_grad_())  # the first training call: packed
    assert entry.status == "active"
    apart = torch.cat([plain(x[:, :3]), plain(x[:, 3:])], dim=1)
    torch.testing.assert_close(out, apart, rtol=1e-5, atol=1e-5)
    again = copy.deepcopy(plain)  # unpacked training: the verdict is made, and kept
    swapped = swap_attention(again, "auto")
    with pytest.warns(UserWarning, match="own forward faster"):
        again(x)
    assert swapped.modules[0].status == "reverted"
