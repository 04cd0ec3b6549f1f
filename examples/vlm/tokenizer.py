"""A word-level tokenizer for the synthetic caption corpus; nothing is downloaded.

The corpus generator writes captions from a small closed grammar (counts, sizes,
colours, shapes, positions), so a fixed vocabulary covers every caption exactly.
Words outside it map to ``<unk>``, so the tokenizer also accepts free text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from .vocabulary import COLORS, COUNT_WORDS, POSITIONS, SHAPES, SIZES

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
_FUNCTION_WORDS = ("shape", "shapes", "a", "at", "in", "the", "and", ",", ".", ":")
_WORD = re.compile(r"[a-z]+|[^\sa-z]")
_SPACE_BEFORE_PUNCT = re.compile(r" ([,.:])")


def _grammar_words() -> list[str]:
    words: list[str] = []
    for group in (COUNT_WORDS, SIZES, COLORS, SHAPES, _FUNCTION_WORDS):
        words.extend(group)
    for phrase in POSITIONS.values():
        words.extend(phrase.split())
    return list(dict.fromkeys(words))  # de-duplicated, order kept


class CaptionTokenizer:
    """Maps captions to token ids and back.

    Example::

        >>> tok = CaptionTokenizer()
        >>> ids = tok.encode("one shape: a red circle.")
        >>> ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        True
        >>> tok.decode(ids)
        'one shape: a red circle.'
    """

    def __init__(self) -> None:
        self.itos: list[str] = [*SPECIAL_TOKENS, *_grammar_words()]
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(len(SPECIAL_TOKENS))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def tokenize(self, text: str) -> list[str]:
        return _WORD.findall(text.lower())

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        ids = [self.stoi.get(w, self.unk_id) for w in self.tokenize(text)]
        return [self.bos_id, *ids, self.eos_id] if add_special else ids

    def decode(self, ids: Iterable[int] | Sequence[int]) -> str:
        specials = set(range(len(SPECIAL_TOKENS)))
        text = " ".join(self.itos[i] for i in ids if i not in specials)
        return _SPACE_BEFORE_PUNCT.sub(r"\1", text)
