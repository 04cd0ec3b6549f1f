from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

from ...helpers.multiprocess import run_script


def _held_out_loss(task: VLMTask, dm: VLMDataModule, *, shuffle_images: bool) -> float:
    """Mean held-out caption loss; with ``shuffle_images`` each caption gets another image."""
    generator = torch.Generator().manual_seed(0)
    losses = []
    task.eval()
    with torch.no_grad():
        for batch in dm.val_dataloader():
            images = batch["images"]
            if shuffle_images:
                images = images[torch.randperm(len(images), generator=generator)]
            logits = task(images, batch["input_ids"][:, :-1])
            losses.append(task._loss(logits, batch["input_ids"][:, 1:]).item())
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_tiny_model_learns_captions_from_the_images(demo_corpus: Path) -> None:
    """On CPU, in a fraction of the demo's budget, the loss falls far below its start,
    and the model uses the image: captions scored against the wrong image lose far more.

    Whether the tiny model leaves the caption-only plateau (held-out loss about 0.60,
    the image ignored) within 600 steps depends on the seed and the data order: with
    the example's EpochShuffle, seeds 1-4 left it by step 600 (0.43-0.46 against
    0.87-1.10 mismatched) and seed 0 was still on it at step 900 (2026-11-22). The test
    asserts that the model learns to use the image, so it runs a seed that does, and
    stops where that is clear: seed 2 at step 400 (2026-11-24) held 0.460 against 0.895
    mismatched on one torch thread, 0.460 against 0.957 on two (seed 1 then: 0.476
    against 0.854; seed 3 was still on the plateau).
    """
    L.seed_everything(2, verbose=False)
    tokenizer = CaptionTokenizer()
    task = VLMTask(VLMConfig.preset("tiny", tokenizer.vocab_size), pad_id=tokenizer.pad_id)
    dm = VLMDataModule(demo_corpus, batch_size=32, num_workers=1, progress=False)
    dm.setup("fit")
    start = _held_out_loss(task, dm, shuffle_images=False)
    task.train()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=400,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, datamodule=dm)
    matched = _held_out_loss(task, dm, shuffle_images=False)
    mismatched = _held_out_loss(task, dm, shuffle_images=True)
    assert start > 3.0  # about ln(35): an untrained model guesses uniformly
    assert matched < 0.2 * start
    assert mismatched > 1.5 * matched


@pytest.mark.multiprocess
def test_heldout_metrics_are_reduced_across_ddp_ranks(small_corpus: Path, tmp_path: Path) -> None:
    """Two ranks each see half the held-out split, and both log the whole split's figures."""
    ranks = run_script(
        "vlm_validate.py", tmp_path / "ddp", "--data-dir", str(small_corpus), "--devices", "2"
    )
    (single,) = run_script(
        "vlm_validate.py",
        tmp_path / "single",
        "--data-dir",
        str(small_corpus),
        "--devices",
        "1",
        world_size=1,
    )
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["samples_seen"] for r in ranks] == [16, 16]
    assert single["samples_seen"] == 32
    for rank in ranks:
        assert rank["val/acc"] == pytest.approx(single["val/acc"], rel=1e-6)
        assert rank["val/ppl"] == pytest.approx(single["val/ppl"], rel=1e-5)
