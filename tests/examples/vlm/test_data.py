from __future__ import annotations

import io
import shutil
import tarfile
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from speedkit_examples.vlm import (
    CaptionCollate,
    CaptionShardDataset,
    CaptionTokenizer,
    VLMConfig,
    VLMDataModule,
    VLMTask,
)

from ...conftest import SMALL_CORPUS


def _shards(data_dir: Path, split: str = "train") -> list[Path]:
    (root,) = data_dir.glob("corpus-*")
    return sorted(root.glob(f"{split}-*.tar"))


def _dataset(shards: list[Path]) -> CaptionShardDataset:
    return CaptionShardDataset(shards, CaptionTokenizer(), image_size=32, max_text_len=40)


def _rewrite_with(src: Path, dst: Path, replace: dict[int, bytes]) -> None:
    """Copy a shard, replacing the bytes of the n-th .jpg member for each n in ``replace``."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        jpg = 0
        for info in tin:
            f = tin.extractfile(info)
            assert f is not None
            data = f.read()
            if info.name.endswith(".jpg"):
                data = replace.get(jpg, data)
                jpg += 1
            new = tarfile.TarInfo(info.name)
            new.size = len(data)
            tout.addfile(new, io.BytesIO(data))


def test_samples_are_decoded_resized_and_tokenized(small_corpus: Path) -> None:
    ds = _dataset(_shards(small_corpus))
    assert len(ds) == SMALL_CORPUS.train_samples
    sample = ds[5]
    assert sample is not None
    assert sample["images"].shape == (3, 32, 32)
    assert sample["images"].dtype == torch.float32
    assert -1.0 <= sample["images"].min() < sample["images"].max() <= 1.0
    assert CaptionTokenizer().decode(sample["input_ids"].tolist()).endswith(".")


def test_collate_pads_to_the_longest_caption(small_corpus: Path) -> None:
    ds = _dataset(_shards(small_corpus))
    samples = [ds[i] for i in range(8)]
    batch = CaptionCollate(pad_id=0)(samples)
    lengths = [len(s["input_ids"]) for s in samples if s is not None]
    assert batch["input_ids"].shape == (8, max(lengths))
    assert batch["num_skipped"] == 0
    for row, n in enumerate(lengths):
        assert (batch["input_ids"][row, n:] == 0).all()
        assert (batch["input_ids"][row, :n] != 0).all()


def test_dataset_survives_pickling_to_workers(small_corpus: Path) -> None:
    dm = VLMDataModule(
        small_corpus, batch_size=8, num_workers=2, corpus=SMALL_CORPUS, progress=False
    )
    dm.setup("fit")
    dm.datasets["train"][0]  # opens a file handle in this process
    seen = sum(len(b["input_ids"]) for b in dm.train_dataloader())
    assert seen == SMALL_CORPUS.train_samples  # 96 = 12 full batches, nothing lost


def test_truncated_shard_is_indexed_up_to_its_last_whole_sample(
    small_corpus: Path, tmp_path: Path
) -> None:
    shards = _shards(small_corpus)
    broken = tmp_path / shards[0].name
    data = shards[0].read_bytes()
    broken.write_bytes(data[: len(data) // 2])
    ds = _dataset([broken, *shards[1:]])
    per_shard = SMALL_CORPUS.samples_per_shard
    assert per_shard * 2 < len(ds) < per_shard * 3
    assert ds.index_report.skipped_samples >= 1
    assert "truncated" in " ".join(ds.index_report.problems or [])
    assert all(ds[i] is not None for i in range(len(ds)))  # what remains is readable


def test_truncated_shard_warns_once_with_a_count(small_corpus: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    shutil.copytree(small_corpus, data_dir)
    (victim,) = [p for p in _shards(data_dir) if p.name == "train-000001.tar"]
    victim.write_bytes(victim.read_bytes()[:20_000])
    dm = VLMDataModule(data_dir, corpus=SMALL_CORPUS, progress=False)
    with pytest.warns(
        UserWarning, match=r"Skipped \d+ train sample\(s\) in damaged shards"
    ) as record:
        dm.setup("fit")
    assert len([w for w in record if "damaged shards" in str(w.message)]) == 1


def test_corrupt_jpegs_are_skipped_and_counted_in_one_warning(
    small_corpus: Path, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    shutil.copytree(small_corpus, data_dir)
    shard = _shards(data_dir)[0]
    original = shard.read_bytes()
    with tarfile.open(shard) as tar:
        first_jpg = next(m for m in tar if m.name.endswith(".jpg"))
        f = tar.extractfile(first_jpg)
        assert f is not None
        good = f.read()
    _rewrite_with(
        shard, tmp_path / "tmp.tar", {0: b"not a jpeg at all", 3: good[: len(good) // 3]}
    )  # garbage; truncated
    shutil.move(tmp_path / "tmp.tar", shard)
    assert shard.read_bytes() != original

    ds = _dataset([shard])
    assert ds[0] is None
    assert ds[3] is None
    assert ds[1] is not None

    tokenizer = CaptionTokenizer()
    task = VLMTask(VLMConfig.preset("tiny", tokenizer.vocab_size), pad_id=tokenizer.pad_id)
    dm = VLMDataModule(data_dir, batch_size=8, corpus=SMALL_CORPUS, progress=False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(task, datamodule=dm)
    skipped = [str(w.message) for w in record if "could not be decoded" in str(w.message)]
    assert skipped == [
        "Skipped 2 sample(s) whose image or caption could not be decoded "
        "(corrupt JPEG or bad text)."
    ]
    assert trainer.global_step == SMALL_CORPUS.train_samples // 8  # every batch still trained


def test_a_batch_with_no_decodable_sample_is_skipped_by_the_task() -> None:
    tokenizer = CaptionTokenizer()
    task = VLMTask(VLMConfig.preset("tiny", tokenizer.vocab_size), pad_id=tokenizer.pad_id)
    empty = CaptionCollate(tokenizer.pad_id)([None, None])
    assert empty["num_skipped"] == 2
    assert task.training_step(empty, 0) is None


@pytest.mark.parametrize(("kwarg", "value"), [("batch_size", 0), ("num_workers", -1)])
def test_bad_loader_settings_are_refused(kwarg: str, value: int) -> None:
    with pytest.raises(ValueError, match=kwarg):
        VLMDataModule(**{kwarg: value})  # type: ignore[arg-type]


class _Order(L.LightningModule):
    """Records each training batch's caption ids; trains nothing that matters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["input_ids"][:, 1].tolist())
        return self.weight * 0.0 + self.weight.square()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _epochs_seen(data_dir: Path, num_workers: int) -> list[list[int]]:
    L.seed_everything(0, verbose=False)
    module = _Order()
    dm = VLMDataModule(data_dir, batch_size=8, num_workers=num_workers, corpus=SMALL_CORPUS,
                       progress=False)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", max_epochs=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)  # fmt: skip
    trainer.fit(module, datamodule=dm)
    return module.seen


def test_training_order_is_the_seeds_whatever_loads_the_data(small_corpus: Path) -> None:
    """With torch's RandomSampler, persistent loader workers shuffle the second epoch on in
    another order than loading in the training process (the loader keeps its iterator and
    draws from torch's generator once less per epoch). The example's order is (seed, epoch)'s."""
    in_process = _epochs_seen(small_corpus, num_workers=0)
    workers = _epochs_seen(small_corpus, num_workers=2)
    assert len(in_process) == 3 * 12
    assert workers == in_process
    assert in_process[:12] != in_process[12:24]  # every epoch shuffled anew


def test_for_model_fits_the_loaders_to_the_model(small_corpus: Path) -> None:
    class Mine(VLMDataModule):
        pass

    config = VLMConfig.preset("small", CaptionTokenizer().vocab_size)  # not the defaults
    dm = Mine.for_model(config, small_corpus, batch_size=4, corpus=SMALL_CORPUS, progress=False)
    assert type(dm) is Mine
    assert (dm.image_size, dm.max_text_len) == (config.image_size, config.max_text_len)
    assert (dm.image_size, dm.max_text_len) != (
        VLMDataModule().image_size,
        VLMDataModule().max_text_len,
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape == (4, 3, config.image_size, config.image_size)
    assert batch["input_ids"].shape[1] <= config.max_text_len
