"""Reading the caption shards: a map-style dataset over tar members, and the DataModule.

The dataset indexes each shard once (tar headers only: name, offset, size) and
then reads a sample's bytes straight from its offset, so it supports random
access, samplers and Lightning's DistributedSampler like any map-style dataset,
while the data stays in WebDataset's on-disk format. JPEG decoding and resizing
happen in ``__getitem__``, that is in the DataLoader's worker processes.

Bad data never stops training: a truncated or unreadable shard is indexed up to
its last complete sample, and a sample whose image cannot be decoded is dropped
from its batch. Each kind is reported by one warning that counts the samples.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from PIL import Image
from torch.utils.data import DataLoader, Dataset, RandomSampler

from .corpus import CorpusConfig, ensure_corpus
from .tokenizer import CaptionTokenizer

if TYPE_CHECKING:
    from .model import VLMConfig

_DataModule = TypeVar("_DataModule", bound="VLMDataModule")

log = logging.getLogger(__name__)
Batch = dict[str, Any]


@dataclass(frozen=True)
class _Sample:
    shard: int
    jpg: tuple[int, int]  # (offset, size) in the shard file
    txt: tuple[int, int]


@dataclass
class IndexReport:
    """What indexing found wrong with the shards."""

    skipped_samples: int = 0
    problems: list[str] | None = None

    def add(self, count: int, problem: str) -> None:
        self.skipped_samples += count
        self.problems = [*(self.problems or []), problem]


def _index_shard(path: Path, shard_id: int, report: IndexReport) -> list[_Sample]:
    members: dict[str, dict[str, tuple[int, int]]] = {}
    file_size = path.stat().st_size
    try:
        with tarfile.open(path, mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                if info.offset_data + info.size > file_size:
                    report.add(1, f"{path.name}: member {info.name} is cut off (truncated shard)")
                    break
                # WebDataset convention: the key is the path up to the first dot of the basename.
                directory, _, base = info.name.rpartition("/")
                stem, _, ext = base.partition(".")
                key = f"{directory}/{stem}" if directory else stem
                members.setdefault(key, {})[ext] = (info.offset_data, info.size)
    except (tarfile.TarError, EOFError, OSError) as exc:
        report.add(0, f"{path.name}: unreadable after {len(members)} samples ({exc})")
    samples = []
    for key, parts in members.items():
        if "jpg" in parts and "txt" in parts:
            samples.append(_Sample(shard_id, parts["jpg"], parts["txt"]))
        else:
            report.add(
                1, f"{path.name}: sample {key} lacks {'jpg' if 'jpg' not in parts else 'txt'}"
            )
    return samples


class CaptionShardDataset(Dataset[Batch | None]):
    """Image-caption pairs read from WebDataset-style tar shards.

    Args:
        shards: tar files holding ``{key}.jpg`` and ``{key}.txt`` members.
        tokenizer: turns captions into token ids.
        image_size: images are resized to ``image_size`` x ``image_size``.
        max_text_len: captions are cut to this many tokens (``<bos>`` and ``<eos>`` included).

    ``__getitem__`` returns ``None`` for a sample whose bytes cannot be decoded;
    :class:`CaptionCollate` drops those and counts them.
    """

    def __init__(
        self,
        shards: Sequence[str | os.PathLike[str]],
        tokenizer: CaptionTokenizer,
        image_size: int,
        max_text_len: int,
    ) -> None:
        self.shards = [Path(s) for s in shards]
        self.tokenizer = tokenizer
        self.image_size = image_size
        self.max_text_len = max_text_len
        self.index_report = IndexReport()
        self.samples: list[_Sample] = []
        for shard_id, path in enumerate(self.shards):
            self.samples.extend(_index_shard(path, shard_id, self.index_report))
        self._files: dict[int, int] = {}  # shard -> file descriptor

    def __len__(self) -> int:
        return len(self.samples)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"] = {}  # descriptors stay in the process that opened them
        return state

    def __del__(self) -> None:
        files = vars(self).get("_files", {})  # none when __init__ raised (a bad shard)
        for fd in files.values():
            os.close(fd)
        files.clear()

    def _read(self, shard: int, span: tuple[int, int]) -> bytes:
        fd = self._files.get(shard)
        if fd is None:
            fd = self._files[shard] = os.open(self.shards[shard], os.O_RDONLY)
        offset, size = span
        # pread has no shared file offset, so forked workers that inherit the
        # descriptor can read concurrently without corrupting each other's reads.
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise OSError(f"short read in {self.shards[shard].name}")
        return data

    def caption_lengths(self) -> list[int]:
        """Tokens in each sample's caption (as ``__getitem__`` would cut it), read from the shards.

        Reads only the small caption members, not the images: for length bucketing.
        """
        lengths = []
        for sample in self.samples:
            try:
                text = self._read(sample.shard, sample.txt).decode("utf-8")
            except (OSError, ValueError):
                text = ""
            lengths.append(min(len(self.tokenizer.encode(text)), self.max_text_len))
        return lengths

    def speedkit_getitem(self, index: int, without: frozenset[str]) -> Batch | None:
        """Sample ``index`` with the fields in ``without`` as zeros of their shape: with
        ``"images"``, the JPEG is not read or decoded (lightning_speedkit's
        FrozenFeatureCache asks for this once the vision tower's features are served)."""
        if "images" not in without:
            return self[index]
        sample = self.samples[index]
        try:
            caption = self._read(sample.shard, sample.txt).decode("utf-8")
        except (OSError, ValueError) as exc:
            log.debug("skipping sample %d of %s: %s", index, self.shards[sample.shard].name, exc)
            return None
        ids = self.tokenizer.encode(caption)[: self.max_text_len]
        return {
            "images": torch.zeros(3, self.image_size, self.image_size),
            "input_ids": torch.tensor(ids, dtype=torch.long),
        }

    def __getitem__(self, index: int) -> Batch | None:
        sample = self.samples[index]
        try:
            caption = self._read(sample.shard, sample.txt).decode("utf-8")
            with Image.open(io.BytesIO(self._read(sample.shard, sample.jpg))) as raw:
                image = raw.convert("RGB").resize((self.image_size,) * 2, Image.Resampling.BILINEAR)
        except (
            OSError,
            ValueError,
            SyntaxError,
        ) as exc:  # what PIL and decode() raise on bad bytes
            log.debug("skipping sample %d of %s: %s", index, self.shards[sample.shard].name, exc)
            return None
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        pixels = pixels.view(self.image_size, self.image_size, 3).permute(2, 0, 1)
        ids = self.tokenizer.encode(caption)[: self.max_text_len]
        return {
            "images": pixels.float().div_(127.5).sub_(1.0),  # [-1, 1]
            "input_ids": torch.tensor(ids, dtype=torch.long),
        }


class CaptionCollate:
    """Stacks images, right-pads captions with ``pad_id``, drops undecodable samples.

    The batch carries ``num_skipped``, the number of samples dropped from it.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[Batch | None]) -> Batch:
        good = [s for s in samples if s is not None]
        if not good:
            return {
                "images": torch.empty(0),
                "input_ids": torch.empty(0, 0, dtype=torch.long),
                "num_skipped": len(samples),
            }
        longest = max(len(s["input_ids"]) for s in good)
        ids = torch.full((len(good), longest), self.pad_id, dtype=torch.long)
        for row, s in enumerate(good):
            ids[row, : len(s["input_ids"])] = s["input_ids"]
        return {
            "images": torch.stack([s["images"] for s in good]),
            "input_ids": ids,
            "num_skipped": len(samples) - len(good),
        }


class EpochShuffle(RandomSampler):
    """A shuffle that depends only on ``seed`` and the epoch (Lightning calls ``set_epoch``).

    torch's ``RandomSampler`` draws a fresh seed from torch's global generator every
    epoch, at a moment that depends on the loader: one with persistent workers keeps
    its iterator and draws one number fewer per epoch. Two runs of one seed that differ
    only in ``num_workers`` would see the same first epoch and different ones after.
    Here the order is a function of (seed, epoch), whatever loads the data, and a run
    resumed at an epoch boundary sees the epochs it would have seen. It is still a
    ``RandomSampler``, so under DDP Lightning replaces it with a shuffling
    ``DistributedSampler``.
    """

    def __init__(self, data_source: Sized, seed: int) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed((self.seed + self.epoch) % 2**63)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class VLMDataModule(L.LightningDataModule):
    """The example corpus as train and held-out loaders.

    Args:
        data_dir: where the corpus is cached; written on first use
            (default ``~/.cache/lightning_speedkit/vlm``).
        image_size: side of the square images fed to the model.
        max_text_len: longest caption, in tokens.
        batch_size: samples per batch, per device.
        num_workers: DataLoader worker processes (decoding happens there).
        corpus: what to generate; the default is the small embedded demo corpus.
        progress: show a progress bar while the corpus is written.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        image_size: int = 32,
        max_text_len: int = 40,
        batch_size: int = 32,
        num_workers: int = 0,
        corpus: CorpusConfig | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be at least 1, got {batch_size}.")
        if num_workers < 0:
            raise ValueError(f"`num_workers` must be 0 or more, got {num_workers}.")
        self.data_dir = data_dir
        self.image_size = image_size
        self.max_text_len = max_text_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.corpus = corpus or CorpusConfig()
        self.progress = progress
        self.tokenizer = CaptionTokenizer()
        self.collate = CaptionCollate(self.tokenizer.pad_id)
        self.datasets: dict[str, CaptionShardDataset] = {}
        self.skipped_in_batches = 0

    @classmethod
    def for_model(
        cls: type[_DataModule],
        config: VLMConfig,
        data_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> _DataModule:
        """The loaders a model of ``config`` takes: its image size and caption length.

        ``kwargs`` are the other arguments (``batch_size``, ``num_workers``, ...).
        """
        return cls(
            data_dir, image_size=config.image_size, max_text_len=config.max_text_len, **kwargs
        )

    def prepare_data(self) -> None:
        ensure_corpus(self.data_dir, self.corpus, progress=self.progress)

    def setup(self, stage: str) -> None:
        root = ensure_corpus(self.data_dir, self.corpus, progress=self.progress)
        for split in ("train", "val"):
            if split in self.datasets:
                continue
            shards = sorted(root.glob(f"{split}-*.tar"))
            ds = CaptionShardDataset(shards, self.tokenizer, self.image_size, self.max_text_len)
            report = ds.index_report
            if report.problems:
                shown = "; ".join(report.problems[:3]) + (
                    " ..." if len(report.problems) > 3 else ""
                )
                rank_zero_warn(
                    f"Skipped {report.skipped_samples} {split} sample(s) in damaged shards "
                    f"under {root}: {shown}"
                )
            self.datasets[split] = ds

    def shuffle_sampler(self, dataset: Sized) -> EpochShuffle:
        """The training order: by the run's seed (``torch.initial_seed()``) and the epoch."""
        return EpochShuffle(dataset, seed=torch.initial_seed())

    def _loader(self, split: str, shuffle: bool) -> DataLoader[Any]:
        dataset = self.datasets[split]
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self.shuffle_sampler(dataset) if shuffle else None,
            drop_last=shuffle,
            num_workers=self.num_workers,
            collate_fn=self.collate,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader("val", shuffle=False)

    def on_before_batch_transfer(self, batch: Batch, dataloader_idx: int) -> Batch:
        self.skipped_in_batches += int(batch.pop("num_skipped", 0))  # a Python int: no device sync
        return batch

    def teardown(self, stage: str) -> None:
        if self.skipped_in_batches:
            rank_zero_warn(
                f"Skipped {self.skipped_in_batches} sample(s) whose image or caption could not be "
                f"decoded (corrupt JPEG or bad text)."
            )
            self.skipped_in_batches = 0
