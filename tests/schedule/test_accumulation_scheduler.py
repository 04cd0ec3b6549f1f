"""AccumulationScheduler on one process: windows, loss normalisation, lr scaling, resume, errors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import AccumulationScheduler, SpeedkitConfigError
from lightning_speedkit.schedule import CommShare, accumulation_for

DIM = 6
MICRO = 8


def dataset(samples: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, DIM, generator=g, dtype=torch.float64)
    w = torch.randn(DIM, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(samples, 1, generator=g, dtype=torch.float64))


class Regression(L.LightningModule):
    def __init__(self, lr: float = 0.1, step_lr: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(DIM, 1).double()
        self.lr, self.step_lr = lr, step_lr
        self.batch_losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.batch_losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.step_lr:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def fit(
    callback: L.Callback | None,
    max_steps: int,
    model: Regression | None = None,
    samples: int = 40,
    **trainer_kwargs: Any,
) -> tuple[Regression, L.Trainer]:
    model = model or Regression()
    trainer_kwargs.setdefault("callbacks", [callback] if callback is not None else [])
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    loader = DataLoader(dataset(samples), batch_size=MICRO, shuffle=False)
    trainer.fit(model, loader)
    return model, trainer


def reference(windows: list[list[int]], lrs: list[float] | None = None) -> torch.nn.Linear:
    """Plain SGD: each step's loss is the MSE over all samples of its window's micro-batches."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(DIM, 1).double()
    x, y = dataset().tensors
    for step, window in enumerate(windows):
        idx = torch.cat([torch.arange(b * MICRO, (b + 1) * MICRO) for b in window])
        layer.zero_grad()
        torch.nn.functional.mse_loss(layer(x[idx]), y[idx]).backward()
        lr = lrs[step] if lrs else 0.1
        with torch.no_grad():
            for p in layer.parameters():
                p -= lr * p.grad
    return layer


def assert_same(model: Regression, expected: torch.nn.Linear) -> None:
    torch.testing.assert_close(model.layer.weight, expected.weight, rtol=0, atol=1e-12)
    torch.testing.assert_close(model.layer.bias, expected.bias, rtol=0, atol=1e-12)


def test_accumulation_for_rounds_to_the_nearest_global_batch() -> None:
    assert accumulation_for(256, 8, 4) == 8
    assert accumulation_for(100, 8, 4) == 3  # 96, not 128
    assert accumulation_for(112, 8, 4) == 4  # 3.5: ties go up
    assert accumulation_for(4, 8, 4) == 1  # never below one micro-batch


def test_target_global_batch_is_one_step_over_the_larger_batch() -> None:
    callback = AccumulationScheduler(target_global_batch=32)
    model, _ = fit(callback, max_steps=1)
    assert_same(model, reference([[0, 1, 2, 3]]))
    assert len(model.batch_losses) == 4  # four micro-batches made the one step
    assert [(c.accumulation, c.global_batch) for c in callback.history] == [(4, 32)]
    # Lightning's own accumulation gives the same numbers
    plain, _ = fit(None, max_steps=1, accumulate_grad_batches=4)
    assert_same(plain, reference([[0, 1, 2, 3]]))


def test_step_schedule_changes_mid_epoch_with_exact_windows() -> None:
    # 5 micro-batches an epoch. Steps 0-2 take one; from step 3 on, three: the window
    # starts at batch 3, mid-epoch, and the epoch's end cuts it to two (scaled to their mean).
    callback = AccumulationScheduler(schedule={0: 8, 3: 24})
    model, trainer = fit(callback, max_steps=6)
    assert_same(model, reference([[0], [1], [2], [3, 4], [0, 1, 2], [3, 4]]))
    assert trainer.global_step == 6
    assert [(c.step, c.accumulation) for c in callback.history] == [(0, 1), (3, 3)]


def test_lightning_alone_would_misplace_those_windows() -> None:
    """Why the callback counts windows itself: Lightning's per-epoch modulo goes wrong."""

    class Switch(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                trainer.accumulate_grad_batches = 3

    model, _ = fit(Switch(), max_steps=4)
    with pytest.raises(AssertionError):
        assert_same(model, reference([[0], [1], [2], [3, 4]]))


def test_epoch_schedule() -> None:
    callback = AccumulationScheduler(schedule={1: 16}, schedule_unit="epoch")
    model, _ = fit(callback, max_steps=8)  # epoch 0: 5 steps of one; epoch 1: 2, 2, 1
    assert_same(model, reference([[0], [1], [2], [3], [4], [0, 1], [2, 3], [4]]))


def test_unreachable_target_is_rounded_with_one_warning() -> None:
    callback = AccumulationScheduler(target_global_batch=30)
    with pytest.warns(UserWarning, match="global batch of 32") as record:
        model, _ = fit(callback, max_steps=2)
    assert sum("cannot be made" in str(w.message) for w in record) == 1
    assert_same(model, reference([[0, 1, 2, 3], [4]]))


@pytest.mark.parametrize(("scaling", "factor"), [("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scaling_with_the_global_batch(scaling: str, factor: float) -> None:
    callback = AccumulationScheduler(schedule={0: 8, 2: 32}, lr_scaling=scaling)  # type: ignore[arg-type]
    model, trainer = fit(callback, max_steps=3)
    assert_same(model, reference([[0], [1], [2, 3, 4]], lrs=[0.1, 0.1, 0.1 * factor]))
    # the optimizer keeps its own learning rate between steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1


def test_lr_scaling_composes_with_a_step_scheduler() -> None:
    callback = AccumulationScheduler(schedule={0: 8, 2: 16}, lr_scaling="linear")
    model, trainer = fit(callback, max_steps=4, model=Regression(step_lr=True))
    # StepLR halves every 2 steps: 0.1, 0.1, 0.05, 0.05; doubled from step 2 on
    assert_same(model, reference([[0], [1], [2, 3], [4]], lrs=[0.1, 0.1, 0.1, 0.1]))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)


def test_base_global_batch_sets_the_lr_reference() -> None:
    callback = AccumulationScheduler(target_global_batch=16, lr_scaling="linear",
                                     base_global_batch=8)  # fmt: skip
    model, _ = fit(callback, max_steps=2)
    assert_same(model, reference([[0, 1], [2, 3]], lrs=[0.2, 0.2]))


def test_a_tuners_lr_sweep_accumulates_as_lightnings_own_would(tmp_path: Path) -> None:
    """``Tuner.lr_find`` runs the fit loop with its own callback only: the scheduler's
    hooks do not run. Its windows then said "closed" at every micro-batch (the sweep
    stepped each micro-batch on a loss divided by 4, and recorded a quarter of the
    points); Lightning's own accumulation now decides there, so the sweep is plain
    Lightning's with the same accumulation."""
    from lightning.pytorch.tuner import Tuner

    def sweep(callbacks: list[L.Callback], accumulate: int) -> dict[str, list[float]]:
        model = Regression()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks, accumulate_grad_batches=accumulate,
            default_root_dir=tmp_path,
        )  # fmt: skip
        loader = DataLoader(dataset(320), batch_size=MICRO)
        found = Tuner(trainer).lr_find(model, loader, num_training=8, early_stop_threshold=None)
        assert found is not None
        return found.results

    plain = sweep([], accumulate=4)
    kit = sweep([AccumulationScheduler(target_global_batch=4 * MICRO)], accumulate=1)
    assert len(plain["lr"]) == 8
    assert kit == plain


class SameBatches(TensorDataset):
    """Every micro-batch holds the same samples: a resumed epoch's data is the same data."""

    def __init__(self) -> None:
        x, y = dataset(MICRO).tensors
        super().__init__(x.repeat(5, 1), y.repeat(5, 1))


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
def test_resume_mid_schedule_continues_it(tmp_path: Path) -> None:
    schedule = {0: 8, 3: 16, 7: 24}

    def run(callbacks: list[L.Callback], ckpt_path: Path | None = None) -> Regression:
        model = Regression()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=10, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks, enable_checkpointing=True,
            default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(model, DataLoader(SameBatches(), batch_size=MICRO), ckpt_path=ckpt_path)
        return model

    straight = AccumulationScheduler(schedule=schedule)
    expected = run([straight])
    # A checkpoint at step 3, mid-epoch and between the ramp's first and second change
    first = AccumulationScheduler(schedule=schedule)
    run([first, ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)])
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    state = torch.load(path, weights_only=True)["callbacks"]["AccumulationScheduler"]
    assert (state["accumulation"], state["global_batch"]) == (1, 8)
    resumed = AccumulationScheduler(schedule=schedule)
    model = run([resumed], ckpt_path=path)
    assert_same(model, expected.layer)
    assert resumed.history == straight.history
    assert [(c.step, c.accumulation) for c in resumed.history] == [(0, 1), (3, 2), (7, 3)]


class SaveAfter(L.Callback):
    """Saves a checkpoint after one micro-batch (``val_check_interval`` and a checkpoint
    every n batches save mid-window the same way)."""

    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if args[-1] == self.batch_idx and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
def test_resume_mid_window_keeps_the_windows_places(tmp_path: Path) -> None:
    """A checkpoint after micro-batch 2 at an accumulation of 2 is mid-window (step 1's
    window is micro-batches 2 and 3). The resumed fit opened a fresh window at micro-batch
    3: every later window moved by one, and the run took 6 more micro-batches to reach
    its steps for the uninterrupted run's 4. It now continues the window: micro-batch 3
    closes step 1, whose gradient is the mean over it alone (the checkpoint does not hold
    micro-batch 2's), with a warning."""

    def run(callbacks: list[L.Callback], ckpt_path: Path | None = None) -> Regression:
        model = Regression()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks, enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(model, DataLoader(SameBatches(), batch_size=MICRO), ckpt_path=ckpt_path)
        return model

    expected = run([AccumulationScheduler(target_global_batch=2 * MICRO)])
    assert len(expected.batch_losses) == 7  # epoch 0: [0, 1] [2, 3] [4]; epoch 1: [0, 1]
    path = tmp_path / "mid.ckpt"
    run([AccumulationScheduler(target_global_batch=2 * MICRO), SaveAfter(path, batch_idx=2)])
    state = torch.load(path, weights_only=True)["callbacks"]["AccumulationScheduler"]
    assert state["window"] == {"step": 1, "count": 1, "length": 2}
    with pytest.warns(UserWarning, match=r"resumed mid-window: 1 of the 2 micro-batches of step 1"):
        model = run([AccumulationScheduler(target_global_batch=2 * MICRO)], ckpt_path=path)
    assert len(model.batch_losses) == 4  # 3, then [4], then epoch 1's [0, 1]
    assert_same(model, expected.layer)  # every micro-batch holds the same samples


# What an adaptive run's checkpoint held before the modes became policies (the keys are
# the format: a checkpoint written then must load now, and one written now must read the same).
EARLIER_STATE: dict[str, Any] = {
    "accumulation": 2,
    "global_batch": 16,
    "base_global_batch": 16,
    "probed": True,
    "next_check": 205,
    "history": [
        {"step": 0, "accumulation": 2, "global_batch": 16, "reason": "target global batch 16"}
    ],
    "measurements": [
        {"accumulation": 2, "step_s": 0.5625, "micro_batch_s": 0.03125, "comm_s": 0.5,
         "optimizer_s": 0.0}
    ],
}  # fmt: skip


def test_an_earlier_checkpoint_loads_and_is_written_back_the_same() -> None:
    callback = AccumulationScheduler(target_global_batch=16, adaptive=True, max_global_batch=64)
    callback.load_state_dict(copy.deepcopy(EARLIER_STATE))
    assert callback.comm_share == CommShare(2, 0.5625, 0.03125, 0.5, 0.0)
    model, _ = fit(callback, max_steps=2)
    assert_same(model, reference([[0, 1], [2, 3]]))
    # one process: adaptive holds the target; the probe and the next check are carried over
    assert callback.state_dict() == EARLIER_STATE


@pytest.mark.parametrize("micro_batch_size", [8, None])  # None: the loader passed to fit says 8
def test_estimated_stepping_batches_counts_the_accumulation(micro_batch_size: int | None) -> None:
    class Sized(Regression):
        def configure_optimizers(self) -> Any:
            self.estimated = self.trainer.estimated_stepping_batches
            return super().configure_optimizers()

    model = Sized()
    callback = AccumulationScheduler(target_global_batch=32, micro_batch_size=micro_batch_size)
    fit(callback, max_steps=-1, model=model, max_epochs=2)
    # two epochs of 5 micro-batches: ceil(5 / 4) steps each (10 with no accumulation)
    assert model.estimated == 4


def test_a_micro_batch_size_the_loader_does_not_give_is_said_and_the_loader_counted() -> None:
    callback = AccumulationScheduler(target_global_batch=32, micro_batch_size=16)
    with pytest.warns(UserWarning, match=r"micro_batch_size=16\), but the train loader gives "
                      r"micro-batches of 8 samples: counting 8"):  # fmt: skip
        model, _ = fit(callback, max_steps=1)
    assert_same(model, reference([[0, 1, 2, 3]]))  # 4 batches of 8, not 2: the global batch 32
    assert [(c.accumulation, c.global_batch) for c in callback.history] == [(4, 32)]


def test_fit_leaves_lightning_as_it_was() -> None:
    callback = AccumulationScheduler(target_global_batch=16)
    _, trainer = fit(callback, max_steps=2)
    loop = trainer.fit_loop.epoch_loop
    assert "_accumulated_batches_reached" not in vars(loop)
    assert "_make_zero_grad_fn" not in vars(loop.automatic_optimization)
    assert trainer.accumulate_grad_batches == 1
    # and a second fit with the same callback still accumulates
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[callback])  # fmt: skip
    trainer.fit(model, DataLoader(dataset(), batch_size=MICRO))
    assert_same(model, reference([[0, 1]]))


def test_adaptive_on_one_process_holds_the_target(caplog: pytest.LogCaptureFixture) -> None:
    callback = AccumulationScheduler(target_global_batch=16, adaptive=True, max_global_batch=64)
    model, _ = fit(callback, max_steps=2)
    assert_same(model, reference([[0, 1], [2, 3]]))
    assert [c.accumulation for c in callback.history] == [2]


# -- conflicts and bad input ------------------------------------------------------------------


class Manual(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("model", "trainer_kwargs", "extra", "match"),
    [
        (Regression, {"accumulate_grad_batches": 2}, None, "Remove `accumulate_grad_batches`"),
        (Regression, {}, GradientAccumulationScheduler({0: 2}), "Keep one"),
        (Manual, {}, None, "automatic_optimization = False"),
    ],
)
def test_conflicts_are_refused(
    model: type[Regression], trainer_kwargs: dict[str, Any], extra: Any, match: str
) -> None:
    callbacks: list[L.Callback] = [AccumulationScheduler(target_global_batch=16)]
    if extra is not None:
        callbacks.append(extra)
    with pytest.raises(SpeedkitConfigError, match=match):
        fit(None, max_steps=1, model=model(), callbacks=callbacks, **trainer_kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "needs a mode"),
        ({"target_global_batch": 0}, r"`target_global_batch` must be an integer >= 1, got 0"),
        ({"target_global_batch": 64, "schedule": {0: 8}}, "cannot be combined"),
        ({"schedule": {0: 8}, "adaptive": True, "max_global_batch": 64}, "cannot be combined"),
        ({"schedule": {}}, "non-empty"),
        ({"schedule": {-1: 8}}, "counted from 0"),
        ({"schedule": {0: 0}}, r"schedule\[0\]"),
        ({"schedule": {0: 8}, "schedule_unit": "batch"}, "schedule_unit"),
        ({"adaptive": True}, "needs `max_global_batch"),
        ({"target_global_batch": 64, "max_global_batch": 128}, "ceiling"),
        ({"target_global_batch": 256, "adaptive": True, "max_global_batch": 128}, "above"),
        ({"adaptive": True, "max_global_batch": 64, "comm_threshold": 1.5}, "between 0 and 1"),
        ({"target_global_batch": 64, "lr_scaling": "cubic"}, "lr_scaling"),
        ({"target_global_batch": 64, "micro_batch_size": 0}, "micro_batch_size"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=match):
        AccumulationScheduler(**kwargs)


# -- the adaptive model -----------------------------------------------------------------------


def test_comm_share_prediction() -> None:
    # 1 s of exposed communication against 0.1 s per micro-batch and no optimizer time:
    # at k micro-batches the share is 1 / (0.1 k + 1); 30% needs k >= 23.3 -> 24.
    measured = CommShare(accumulation=2, step_s=1.2, micro_batch_s=0.1, comm_s=1.0, optimizer_s=0)
    assert measured.share == pytest.approx(1 / 1.2)
    assert measured.predicted_share(24) == pytest.approx(1 / 3.4)
    assert measured.smallest_accumulation(0.3, lowest=1, highest=64) == 24
    assert measured.smallest_accumulation(0.3, lowest=1, highest=16) == 16
    cheap = CommShare(accumulation=2, step_s=1.0, micro_batch_s=0.45, comm_s=0.05, optimizer_s=0.05)
    assert cheap.smallest_accumulation(0.3, lowest=1, highest=64) == 1


@given(
    step=st.floats(0.01, 10), comm=st.floats(0, 1), opt=st.floats(0, 0.5),
    k=st.integers(1, 16), threshold=st.floats(0.05, 0.95),
    lowest=st.integers(1, 8), span=st.integers(0, 64),
)  # fmt: skip
def test_smallest_accumulation_is_smallest_and_bounded(
    step: float, comm: float, opt: float, k: int, threshold: float, lowest: int, span: int
) -> None:
    comm, opt = comm * step, opt * step * (1 - comm)
    measured = CommShare(k, step, (step - comm - opt) / k, comm, opt)
    highest = lowest + span
    chosen = measured.smallest_accumulation(threshold, lowest, highest)
    assert lowest <= chosen <= highest
    if chosen < highest:
        assert measured.predicted_share(chosen) <= threshold + 1e-9
    if chosen > lowest:
        assert measured.predicted_share(chosen - 1) > threshold - 1e-9
