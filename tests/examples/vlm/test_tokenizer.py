from __future__ import annotations

import random

from speedkit_examples.vlm import CaptionTokenizer, CorpusConfig
from speedkit_examples.vlm.corpus import draw_sample


def test_every_generated_caption_round_trips_without_unknown_words() -> None:
    tok = CaptionTokenizer()
    cfg = CorpusConfig()
    for i in range(200):
        _, caption, _ = draw_sample(random.Random(i), cfg)
        ids = tok.encode(caption)
        assert tok.unk_id not in ids, caption
        assert ids[0] == tok.bos_id
        assert ids[-1] == tok.eos_id
        assert tok.decode(ids) == caption


def test_unknown_words_map_to_unk_and_specials_are_distinct() -> None:
    tok = CaptionTokenizer()
    assert tok.encode("a zebra", add_special=False) == [tok.stoi["a"], tok.unk_id]
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}) == 4
    assert len(set(tok.itos)) == tok.vocab_size  # no word twice
