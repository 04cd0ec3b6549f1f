from __future__ import annotations

import hashlib
import io
import json
import random
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from speedkit_examples.vlm import CorpusConfig, DataDirectoryError, ensure_corpus
from speedkit_examples.vlm import corpus as corpus_mod
from speedkit_examples.vlm.corpus import DrawnShape, caption_for, draw_sample
from speedkit_examples.vlm.vocabulary import COLORS

from ...conftest import SMALL_CORPUS


def _members(root: Path) -> dict[str, bytes]:
    out = {}
    for shard in sorted(root.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar:
                f = tar.extractfile(info)
                assert f is not None
                out[f"{shard.name}/{info.name}"] = f.read()
    return out


def test_layout_is_webdataset_style(small_corpus: Path) -> None:
    (root,) = small_corpus.glob("corpus-*")
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["shards"] == {"train": 3, "val": 1}
    members = _members(root)
    keys = {name.split("/")[1].split(".")[0] for name in members}
    assert len(keys) == SMALL_CORPUS.train_samples + SMALL_CORPUS.val_samples
    for key in keys:  # every sample is a .jpg, .txt and .json under one key
        exts = sorted(n.rsplit(".", 1)[1] for n in members if n.split("/")[1].split(".")[0] == key)
        assert exts == ["jpg", "json", "txt"]


def test_captions_describe_what_is_drawn(small_corpus: Path) -> None:
    (root,) = small_corpus.glob("corpus-*")
    members = _members(root)
    checked = 0
    for name, data in members.items():
        if not name.endswith(".json"):
            continue
        stem = name[: -len(".json")]
        shapes = [
            DrawnShape(**{**s, "cell": tuple(s["cell"]), "center": tuple(s["center"])})
            for s in json.loads(data)
        ]
        assert members[stem + ".txt"].decode() == caption_for(shapes)
        image = Image.open(io.BytesIO(members[stem + ".jpg"])).convert("RGB")
        for s in shapes:  # the pixel at each shape's centre has the shape's colour
            pixel = image.getpixel((int(s.center[0]), int(s.center[1])))
            assert isinstance(pixel, tuple)
            assert max(abs(a - b) for a, b in zip(pixel, COLORS[s.color], strict=True)) < 60, (
                name,
                s,
            )
            checked += 1
    assert checked > SMALL_CORPUS.train_samples  # more than one shape per image on average


def test_resolution_and_caption_length_vary() -> None:
    cfg = CorpusConfig()
    sizes, lengths = set(), set()
    for i in range(100):
        jpeg, caption, shapes = draw_sample(random.Random(i), cfg)
        sizes.add(Image.open(io.BytesIO(jpeg)).size)
        lengths.add(len(caption.split()))
        assert caption.startswith(("one shape:", "two shapes:", "three shapes:", "four shapes:"))
        assert len(shapes) == ["one", "two", "three", "four"].index(caption.split()[0]) + 1
    assert len(sizes) > 50
    assert min(w for w, _ in sizes) >= cfg.min_resolution
    assert max(h for _, h in sizes) <= cfg.max_resolution
    assert len(lengths) >= 4


def test_same_config_gives_the_same_bytes(tmp_path: Path) -> None:
    cfg = CorpusConfig(train_samples=20, val_samples=4, samples_per_shard=8)
    a = ensure_corpus(tmp_path / "a", cfg, progress=False)
    b = ensure_corpus(tmp_path / "b", cfg, progress=False)
    digest = lambda root: {k: hashlib.sha256(v).hexdigest() for k, v in _members(root).items()}  # noqa: E731
    assert digest(a) == digest(b)
    other = ensure_corpus(
        tmp_path / "c", CorpusConfig(train_samples=20, val_samples=4, seed=1), progress=False
    )
    assert other.name != a.name  # the seed is part of the fingerprint
    assert digest(other) != digest(a)


def test_second_call_reuses_the_corpus(small_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("corpus regenerated")

    monkeypatch.setattr(corpus_mod, "write_corpus", fail)
    root = ensure_corpus(small_corpus, SMALL_CORPUS, progress=False)
    assert (root / "manifest.json").exists()


def test_interrupted_generation_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = CorpusConfig(train_samples=10, val_samples=2, samples_per_shard=4)
    real_draw, calls = corpus_mod.draw_sample, []

    def crash_after_five(rng: random.Random, c: CorpusConfig) -> object:
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real_draw(rng, c)

    monkeypatch.setattr(corpus_mod, "draw_sample", crash_after_five)
    with pytest.raises(KeyboardInterrupt):
        ensure_corpus(tmp_path, cfg, progress=False)
    assert list(tmp_path.iterdir()) == []  # no partial corpus, no staging directory
    monkeypatch.setattr(corpus_mod, "draw_sample", real_draw)
    root = ensure_corpus(tmp_path, cfg, progress=False)
    assert len(_members(root)) == 3 * 12


def test_progress_bar_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ensure_corpus(tmp_path, CorpusConfig(train_samples=3, val_samples=1), progress=True)
    err = capsys.readouterr().err
    assert "Writing example corpus" in err
    assert "4/4" in err


def test_unwritable_data_dir_names_the_path_and_the_flag(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(DataDirectoryError) as info:
        ensure_corpus(blocker / "cache", SMALL_CORPUS, progress=False)
    message = str(info.value)
    assert str(blocker / "cache") in message
    assert "--data-dir" in message
    assert "data_dir=" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("train_samples", 0),
        ("samples_per_shard", -1),
        ("min_resolution", 8),
        ("jpeg_quality", (90, 80)),
    ],
)
def test_bad_corpus_config_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        CorpusConfig(**{field: value})  # type: ignore[arg-type]
