"""A synthetic image-caption corpus the example VLM can actually learn.

Each image shows one to four shapes (circle, square, triangle, diamond) in six
colours and two sizes, placed in the cells of a 3 x 3 grid, on a dark background
of random tint. Its caption says exactly what is drawn, in reading order::

    two shapes: a large red circle at the top left and a small blue square in the center.

So the count, colours, shapes and positions can only be predicted by looking at
the image, and the loss keeps falling as the model learns to. Images come at a
random resolution per sample and are stored as JPEG, so a data loader has real
decoding and resizing to do; captions vary in length with the number of shapes.

Samples are written as WebDataset-style tar shards: one ``{key}.jpg``,
``{key}.txt`` (caption) and ``{key}.json`` (what was drawn) per sample, in
``train-000000.tar``, ``val-000000.tar``, ... with a ``manifest.json`` written
last. The whole corpus is built in a temporary directory and renamed into place,
so an interrupted run never leaves a half-written corpus behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw
from tqdm.auto import tqdm

from .vocabulary import COLORS, COUNT_WORDS, MAX_SHAPES, POSITIONS, SHAPES, SIZES

#: Bumped whenever the generator's output changes, so cached corpora are rebuilt.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


class DataDirectoryError(RuntimeError):
    """The corpus directory cannot be created or written."""


@dataclass(frozen=True)
class CorpusConfig:
    """What the generator writes. The defaults make the embedded demo corpus."""

    train_samples: int = 4096
    """Training samples. The default (about 13 MB of JPEG) is built in a few seconds."""
    val_samples: int = 512
    """Held-out samples, drawn with different seeds from the training ones."""
    samples_per_shard: int = 512
    """Samples per tar shard; shards are the unit a streaming reader would distribute."""
    min_resolution: int = 48
    """Smallest image side in pixels; each side is drawn uniformly in [min, max]."""
    max_resolution: int = 160
    """Largest image side in pixels."""
    jpeg_quality: tuple[int, int] = (70, 95)
    """Range of JPEG qualities, drawn per image."""
    seed: int = 0
    """Seed of the whole corpus; sample i depends only on (seed, split, i)."""

    def __post_init__(self) -> None:
        for name in ("train_samples", "val_samples", "samples_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be at least 1, got {getattr(self, name)}.")
        if not 24 <= self.min_resolution <= self.max_resolution:
            raise ValueError(
                f"Need 24 <= `min_resolution` <= `max_resolution`, got "
                f"{self.min_resolution} and {self.max_resolution}."
            )
        lo, hi = self.jpeg_quality
        if not 1 <= lo <= hi <= 100:
            raise ValueError(
                f"`jpeg_quality` must be a range within [1, 100], got {self.jpeg_quality}."
            )

    def samples(self, split: str) -> int:
        return self.train_samples if split == "train" else self.val_samples

    def fingerprint(self) -> str:
        blob = json.dumps({"format": FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class DrawnShape:
    """One drawn shape; ``center`` and ``half`` (half-extent) are in pixels."""

    shape: str
    color: str
    size: str
    cell: tuple[int, int]
    center: tuple[float, float] = (0.0, 0.0)
    half: float = 0.0


def caption_for(shapes: list[DrawnShape]) -> str:
    """The caption of an image: count, then each shape in reading order."""
    phrases = [f"a {s.size} {s.color} {s.shape} {POSITIONS[s.cell]}" for s in shapes]
    listed = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    noun = "shape" if len(shapes) == 1 else "shapes"
    return f"{COUNT_WORDS[len(shapes) - 1]} {noun}: {listed}."


def draw_sample(rng: random.Random, cfg: CorpusConfig) -> tuple[bytes, str, list[DrawnShape]]:
    """Draw one image; returns its JPEG bytes, caption and the shapes drawn."""
    width = rng.randint(cfg.min_resolution, cfg.max_resolution)
    height = rng.randint(cfg.min_resolution, cfg.max_resolution)
    background = tuple(rng.randint(10, 70) for _ in range(3))
    image = Image.new("RGB", (width, height), background)
    canvas = ImageDraw.Draw(image)

    cells = sorted(rng.sample(sorted(POSITIONS), rng.randint(1, MAX_SHAPES)))
    cell_w, cell_h = width / 3, height / 3
    shapes = []
    for row, col in cells:
        shape, color, size = rng.choice(SHAPES), rng.choice(sorted(COLORS)), rng.choice(SIZES)
        # Half-extent as a share of the cell: large shapes nearly fill it, small ones do not;
        # the jitter keeps every shape inside its own cell.
        half = min(cell_w, cell_h) * (0.42 if size == "large" else 0.2)
        jitter = min(cell_w, cell_h) / 2 - half
        cx = (col + 0.5) * cell_w + rng.uniform(-jitter, jitter)
        cy = (row + 0.5) * cell_h + rng.uniform(-jitter, jitter)
        shapes.append(DrawnShape(shape, color, size, (row, col), (cx, cy), half))
    for s in shapes:
        (cx, cy), half, fill = s.center, s.half, COLORS[s.color]
        if s.shape == "circle":
            canvas.ellipse((cx - half, cy - half, cx + half, cy + half), fill=fill)
        elif s.shape == "square":
            canvas.rectangle((cx - half, cy - half, cx + half, cy + half), fill=fill)
        elif s.shape == "triangle":
            canvas.polygon(
                [(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill
            )
        else:  # diamond
            canvas.polygon(
                [(cx, cy - half), (cx + half, cy), (cx, cy + half), (cx - half, cy)], fill=fill
            )

    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=rng.randint(*cfg.jpeg_quality))
    return buffer.getvalue(), caption_for(shapes), shapes


def _sample_rng(cfg: CorpusConfig, split: str, index: int) -> random.Random:
    return random.Random(f"{cfg.seed}/{split}/{index}")


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # deterministic shards: the same config gives the same bytes
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _iter_shard_ranges(total: int, per_shard: int) -> Iterator[tuple[int, range]]:
    for shard, start in enumerate(range(0, total, per_shard)):
        yield shard, range(start, min(start + per_shard, total))


def write_corpus(root: str | os.PathLike[str], cfg: CorpusConfig, *, progress: bool = True) -> Path:
    """Write the corpus to ``root`` (which must not exist yet) and return it."""
    root = Path(root)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.partial-", dir=root.parent))
    try:
        total = cfg.train_samples + cfg.val_samples
        shard_counts: dict[str, int] = {}
        with tqdm(
            total=total, desc="Writing example corpus", unit="img", disable=not progress
        ) as bar:
            for split in SPLITS:
                shards = 0
                for shard, indices in _iter_shard_ranges(cfg.samples(split), cfg.samples_per_shard):
                    with tarfile.open(staging / f"{split}-{shard:06d}.tar", "w") as tar:
                        for i in indices:
                            jpeg, caption, shapes = draw_sample(_sample_rng(cfg, split, i), cfg)
                            meta = json.dumps([dataclasses.asdict(s) for s in shapes]).encode()
                            key = f"{split}{i:07d}"
                            _add_member(tar, f"{key}.jpg", jpeg)
                            _add_member(tar, f"{key}.txt", caption.encode())
                            _add_member(tar, f"{key}.json", meta)
                            bar.update(1)
                    shards += 1
                shard_counts[split] = shards
        manifest = {
            "format": FORMAT_VERSION,
            "fingerprint": cfg.fingerprint(),
            "config": dataclasses.asdict(cfg),
            "shards": shard_counts,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        try:
            staging.rename(root)
        except OSError:
            if not (root / MANIFEST).exists():  # someone else finished first: theirs is as good
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def default_data_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_speedkit/vlm`` (``~/.cache/...`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "lightning_speedkit" / "vlm"


def ensure_corpus(
    data_dir: str | os.PathLike[str] | None = None,
    cfg: CorpusConfig | None = None,
    *,
    progress: bool = True,
) -> Path:
    """Return the corpus directory for ``cfg`` under ``data_dir``, writing it on first use.

    The corpus lives in ``data_dir/corpus-<fingerprint>``, so different configs
    never collide and a finished corpus is reused as it is.

    Raises:
        DataDirectoryError: ``data_dir`` cannot be created or written.
    """
    cfg = cfg or CorpusConfig()
    base = Path(data_dir) if data_dir is not None else default_data_dir()
    root = base / f"corpus-{cfg.fingerprint()}"
    if (root / MANIFEST).exists():
        return root
    try:
        base.mkdir(parents=True, exist_ok=True)
        if not os.access(base, os.W_OK):
            raise PermissionError(13, "Permission denied", str(base))
        return write_corpus(root, cfg, progress=progress)
    except OSError as exc:
        raise DataDirectoryError(
            f"Cannot write the example corpus under `data_dir`={str(base)!r}: "
            f"{exc.strerror or exc}. Pass a writable directory: `speedkit demo --data-dir DIR` "
            f"or `VLMDataModule(data_dir=DIR)`."
        ) from exc


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((Path(root) / MANIFEST).read_text())
    return result
