"""The example VLM that lightning_speedkit's features are measured on.

Plain PyTorch and Lightning only: no lightning_speedkit code inside (the command-line
script ``cli.py`` imports it, for its strategy names alone). In the
repository it lives in ``examples/vlm``; installed, it is ``speedkit_examples.vlm``.
"""

from .corpus import CorpusConfig, DataDirectoryError, ensure_corpus, write_corpus
from .data import CaptionCollate, CaptionShardDataset, EpochShuffle, VLMDataModule
from .model import VLM, VLMConfig
from .task import VLMTask
from .tokenizer import CaptionTokenizer

__all__ = [
    "VLM",
    "CaptionCollate",
    "CaptionShardDataset",
    "CaptionTokenizer",
    "CorpusConfig",
    "DataDirectoryError",
    "EpochShuffle",
    "VLMConfig",
    "VLMDataModule",
    "VLMTask",
    "ensure_corpus",
    "write_corpus",
]
