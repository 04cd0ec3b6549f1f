"""Packed batches into recurrent layers and token convolutions: they carry state from each
document of a row into the next, which no attention swap separates; said once per model.
A token model with neither attention nor such layers mixes nothing: nothing is said."""

from __future__ import annotations

import pytest
from torch import Tensor, nn

from lightning_speedkit import AttentionSwap
from lightning_speedkit.measure._packed_check import MIXED_DOCUMENTS, state_carriers

from .test_speed_monitor_packing import Task, _fit, _monitor
from .test_speed_monitor_tokens import VOCAB, _packed

CARRIED = "a recurrent layer or a 1-D convolution carries state along the row"


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rnn, self.head = (
            nn.Embedding(VOCAB, 8),
            nn.GRU(8, 8, batch_first=True),
            nn.Linear(8, VOCAB),
        )

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


class Convolutional(nn.Module):
    """A causal token convolution (Mamba's, Hyena's short filter), width ``kernel``."""

    def __init__(self, kernel: int) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
        self.conv = nn.Conv1d(8, 8, kernel, padding=kernel - 1, groups=8)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.conv(self.embed(ids).transpose(1, 2))[..., : ids.shape[1]]
        return self.head(x.transpose(1, 2))


def test_the_layers_that_carry_state_along_the_tokens_are_named() -> None:
    assert state_carriers(Recurrent()) == ["rnn"]
    assert state_carriers(Convolutional(kernel=4)) == ["conv"]
    assert state_carriers(Convolutional(kernel=1)) == []  # a per-token projection
    assert state_carriers(nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))) == []


@pytest.mark.parametrize("model", [Recurrent, lambda: Convolutional(kernel=4)], ids=["gru", "conv"])
@pytest.mark.parametrize("with_swap", [False, True], ids=["monitor", "monitor+swap"])
def test_a_packed_fit_through_a_recurrent_or_convolutional_model_is_said_once(
    model: type[nn.Module], with_swap: bool
) -> None:
    callbacks = [_monitor()] + ([AttentionSwap("sdpa", measure=False, verbose=False)] * with_swap)
    said = _fit(Task(model()), _packed(), *callbacks)
    carried = [m for m in said if CARRIED in m]
    assert len(carried) == 1  # by SpeedMonitor or AttentionSwap, whichever comes first
    assert "'model." in carried[0]
    assert MIXED_DOCUMENTS not in said  # no attention: no attention advice
    assert not [m for m in said if "reached attention that AttentionSwap did not swap" in m]


def test_a_token_model_with_nothing_that_mixes_is_not_warned_about() -> None:
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    swap = AttentionSwap("sdpa", measure=False, verbose=False)
    said = _fit(Task(model), _packed(), _monitor(), swap)
    assert not [m for m in said if "packed batch" in m.lower()]
