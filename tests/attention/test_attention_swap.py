"""AttentionSwap: swaps in setup, checks on the first real step, resumes with its picks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import AttentionSwap, SpeedkitConfigError
from lightning_speedkit.attention.swap import swapped_modules
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

from ..conftest import SMALL_CORPUS
from ..helpers.multiprocess import run_script
from .test_auto_keeps_own import rig_auto_timing
from .test_traced import Block, CrossAttention

ATTENTION = [
    "model.vision.blocks.0.attn",
    "model.vision.blocks.1.attn",
    "model.language_model.blocks.0.attn",
    "model.language_model.blocks.1.attn",
]


def _task() -> VLMTask:
    L.seed_everything(0, verbose=False)
    tokenizer = CaptionTokenizer()
    return VLMTask(VLMConfig.preset("tiny", tokenizer.vocab_size), pad_id=tokenizer.pad_id)


def _fit(
    data_dir: Path,
    callbacks: list[Any],
    steps: int = 4,
    task: VLMTask | None = None,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, VLMTask]:
    task = task or _task()
    datamodule = VLMDataModule(data_dir, batch_size=8, corpus=SMALL_CORPUS, progress=False)
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer, task


def test_fit_swaps_checks_on_the_first_step_and_trains_like_plain(
    small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig_auto_timing(monkeypatch, own=2.0, fused=1.0)  # auto swaps: tiny blocks, no noise
    swap = AttentionSwap("auto", verbose=False)
    trainer, task = _fit(small_corpus, [swap])
    _, plain = _fit(small_corpus, [])
    assert swap.report is not None
    assert swap.report.swapped == ATTENTION
    for m in swap.report.modules:  # sanity validation checked forward; the first step, backward
        assert m.checked == "forward+backward"
        assert m.status == "active"
        assert m.speedup is not None
        assert m.parity_error is not None
        assert m.parity_error < 1e-5
    assert trainer.callback_metrics["attention/swapped"] == 4.0
    assert trainer.callback_metrics["attention/reverted"] == 0.0
    for (name, p), ref in zip(task.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-4, atol=1e-5, msg=name)


def test_report_is_printed_after_the_first_batch(
    small_corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO"):
        _fit(small_corpus, [AttentionSwap("sdpa")], steps=1)
    assert "| model.vision.blocks.0.attn | structural | sdpa | active |" in caplog.text


def test_resume_keeps_autos_picks_and_reverts(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig_auto_timing(monkeypatch, own=2.0, fused=1.0)  # auto swaps every module
    swap = AttentionSwap("auto", verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _fit(small_corpus, [swap, checkpoint], steps=2, enable_checkpointing=True)
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["AttentionSwap"]
    picks = {name: saved["backend"] for name, saved in state["modules"].items()}
    assert sorted(picks) == sorted(ATTENTION)
    # Pretend the first run had reverted one module: the resumed run must keep it reverted.
    state["modules"][ATTENTION[0]] = {"status": "reverted", "reason": "parity error 1e+00"}
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    ckpt["callbacks"]["AttentionSwap"] = state
    torch.save(ckpt, tmp_path / "edited.ckpt")

    resumed = AttentionSwap("auto", verbose=False)
    with pytest.warns(UserWarning, match="reverted in the run this one resumes"):
        _fit(small_corpus, [resumed], steps=3, ckpt_path=str(tmp_path / "edited.ckpt"))
    assert resumed.report is not None
    assert resumed.report.reverted[0][0] == ATTENTION[0]
    for m in resumed.report.modules[1:]:
        assert m.backend == picks[m.name]  # pinned: not timed again


@pytest.mark.own_timing  # the virtual clock decides: the margin is real
def test_resume_keeps_autos_own_forward_and_the_backend_for_packed_batches(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig_auto_timing(monkeypatch, own=1.0, fused=2.0)  # auto keeps every own forward
    swap = AttentionSwap("auto", verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    with pytest.warns(UserWarning, match="packed batches still run"):
        _fit(small_corpus, [swap, checkpoint], steps=2, enable_checkpointing=True)
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["AttentionSwap"]
    kept = {name: saved["packed_backend"] for name, saved in state["modules"].items()}
    assert sorted(kept) == sorted(ATTENTION)
    assert all(saved["status"] == "reverted" for saved in state["modules"].values())

    resumed = AttentionSwap("auto", verbose=False)
    with pytest.warns(UserWarning, match="reverted in the run this one resumes"):
        _, task = _fit(small_corpus, [resumed], steps=3, ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.report is not None
    assert {m.name: m.packed_backend for m in resumed.report.modules} == kept
    for name, swapped in swapped_modules(task).items():  # own forward, but for packed batches
        assert swapped.packed_only, name


def test_second_fit_keeps_the_swaps(small_corpus: Path) -> None:
    swap = AttentionSwap("sdpa", verbose=False)
    trainer, task = _fit(small_corpus, [swap], steps=1)
    report = swap.report
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(task, datamodule=trainer.datamodule)
    assert swap.report is report
    assert list(swapped_modules(task)) == ATTENTION


class _TracedTask(L.LightningModule):
    """Blocks whose attention only a trace finds (diffusers' old CrossAttention)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.Sequential(Block(CrossAttention()), Block(CrossAttention()))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x)).squeeze(-1)  # type: ignore[no-any-return]

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val", torch.nn.functional.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_traced(
    callbacks: list[Any],
    steps: int,
    ckpt_path: str | None = None,
    compile_backend: str | None = None,
    **kwargs: Any,
) -> _TracedTask:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(32, 6, 32, generator=generator), torch.randn(32, 6, generator=generator)
    )
    task = _TracedTask()
    kwargs.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=1,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    loader = DataLoader(data, batch_size=8)
    fitted = task if compile_backend is None else torch.compile(task, backend=compile_backend)
    trainer.fit(fitted, loader, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)  # type: ignore[arg-type]
    return task


def test_fit_finds_attention_by_tracing_and_trains_like_plain(tmp_path: Path) -> None:
    swap = AttentionSwap("sdpa", verbose=False)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    task = _fit_traced([swap, checkpoint], steps=3, enable_checkpointing=True)
    plain = _fit_traced([], steps=3)
    assert swap.report is not None
    assert swap.report.swapped == ["blocks.0.attention", "blocks.1.attention"]
    for m in swap.report.modules:  # found in the sanity check, backward checked in step one
        assert (m.family, m.status, m.checked) == ("traced", "active", "forward+backward")
    for (name, p), ref in zip(task.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6, msg=name)
    # A resumed run applies the saved decisions when its trace finds the modules again.
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    saved = ckpt["callbacks"]["AttentionSwap"]["modules"]
    assert sorted(saved) == ["blocks.0.attention", "blocks.1.attention"]
    saved["blocks.0.attention"] = {"status": "reverted", "reason": "parity error 1e+00"}
    torch.save(ckpt, tmp_path / "edited.ckpt")
    resumed = AttentionSwap("sdpa", verbose=False)
    with pytest.warns(UserWarning, match="reverted in the run this one resumes"):
        _fit_traced([resumed], steps=4, ckpt_path=str(tmp_path / "edited.ckpt"))
    assert resumed.report is not None
    assert resumed.report.swapped == ["blocks.1.attention"]
    assert resumed.report.reverted[0][0] == "blocks.0.attention"


def test_a_compiled_task_with_speed_monitor_finds_attention_in_its_eager_counted_step() -> None:
    """SpeedMonitor counts FLOPs on the first step under a dispatch mode, so dynamo runs the
    compiled ``training_step`` eagerly: discovery traced it and asked for the ``force_eager``
    stance inside torch.compile's frame evaluation, which raised ``attempted to set_stance
    in a torch.compile region``."""
    from lightning_speedkit import SpeedMonitor

    torch._dynamo.reset()
    swap = AttentionSwap("sdpa", verbose=False)
    monitor = SpeedMonitor(log_every_n_steps=1)
    task = _fit_traced([swap, monitor], steps=3, compile_backend="eager")
    plain = _fit_traced([], steps=3)
    assert swap.report is not None
    assert swap.report.swapped == ["blocks.0.attention", "blocks.1.attention"]
    assert all(m.checked == "forward+backward" for m in swap.report.modules)
    for (name, p), ref in zip(task.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6, msg=name)


def test_an_averaged_copy_made_in_setup_finds_its_own_attention_apart_from_the_report() -> None:
    """Lightning's WeightAveraging deep-copies the module in ``setup``, after AttentionSwap
    swapped it and before its first call: the copy's probes are its own, and what the
    copy finds is swapped in the copy and never lands in the callback's report (nor in
    its checkpoints)."""
    from lightning.pytorch.callbacks import WeightAveraging

    swap = AttentionSwap("sdpa", verbose=False)
    averaging = WeightAveraging()
    _fit_traced([swap, averaging], steps=3)
    assert swap.report is not None
    assert swap.report.swapped == ["blocks.0.attention", "blocks.1.attention"]
    entries, saved = list(swap.report.modules), swap.state_dict()
    averaged = averaging._average_model  # the callback keeps it private
    assert averaged is not None
    assert swapped_modules(averaged) == {}  # not called during fit: still probed
    plain = _TracedTask()  # unswapped, with the averaged weights
    plain.load_state_dict(averaged.module.state_dict())
    x = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(averaged(x), plain(x), rtol=1e-5, atol=1e-5)
    copied = swapped_modules(averaged.module)
    assert list(copied) == ["blocks.0.attention", "blocks.1.attention"]
    for swap_forward in copied.values():
        assert (swap_forward.entry.status, swap_forward.entry.checked) == (
            "active",
            "forward+backward",
        )
    torch.testing.assert_close(averaged(x), plain(x), rtol=1e-5, atol=1e-5)  # fused now
    assert len(swap.report.modules) == 2
    assert all(m is e for m, e in zip(swap.report.modules, entries, strict=True))
    assert swap.state_dict() == saved


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SpeedkitConfigError, match="`backend='flash2'`"):
        AttentionSwap("flash2")  # type: ignore[arg-type]
    with pytest.raises(
        SpeedkitConfigError, match=r"`tolerance` must be a positive number, got -1\.0"
    ):
        AttentionSwap(tolerance=-1.0)


@pytest.mark.multiprocess
def test_ddp_ranks_swap_and_train_like_unswapped_ddp(small_corpus: Path, tmp_path: Path) -> None:
    swapped = run_script(
        "attention_swap_ddp.py", tmp_path / "swap", "--data-dir", str(small_corpus), "--swap"
    )
    plain = run_script("attention_swap_ddp.py", tmp_path / "plain", "--data-dir", str(small_corpus))
    for rank in swapped:
        modules = rank["report"]["modules"]
        assert [m["name"] for m in modules] == ATTENTION
        assert all(m["checked"] == "forward+backward" for m in modules)
    assert swapped[0]["params"] == pytest.approx(swapped[1]["params"], rel=1e-12)  # ranks agree
    assert swapped[0]["params"] == pytest.approx(plain[0]["params"], rel=1e-4, abs=1e-4)


@pytest.mark.multiprocess
def test_ddp_ranks_that_decide_differently_all_run_rank_0s_decisions(
    small_corpus: Path, tmp_path: Path
) -> None:
    """Rank 1 picks `math` (all it may time) and fails one module's check; rank 0 picks
    `sdpa` or `flash` and passes them all. After the first batch both run rank 0's choices,
    and rank 0's report says what rank 1 had decided."""
    target = ATTENTION[2]
    ranks = run_script(
        "attention_swap_ddp.py",
        tmp_path,
        "--data-dir",
        str(small_corpus),
        "--swap",
        "--backend",
        "auto",
        "--disagree",
        "--revert-on-rank-1",
        target,
    )
    backends = [
        {m["name"]: (m["status"], m["backend"]) for m in r["report"]["modules"]} for r in ranks
    ]
    assert backends[0] == backends[1]
    assert {status for status, _ in backends[0].values()} == {"active"}
    assert {backend for _, backend in backends[0].values()} <= {"sdpa", "flash"}
    assert ranks[0]["running"] == ranks[1]["running"] == sorted(ATTENTION)  # rank 1 swapped it back
    notes = {m["name"]: m["ranks"] for m in ranks[0]["report"]["modules"]}
    assert notes[target].startswith("rank 1 reverted it (parity error")
    for name in ATTENTION:
        if name != target:
            assert notes[name] == "rank 1 picked 'math'"
    assert ranks[0]["params"] == pytest.approx(ranks[1]["params"], rel=1e-12)
