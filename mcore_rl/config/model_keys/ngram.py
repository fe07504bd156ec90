"""The n-gram embedding's keys (`hf/ngram.py`, `models/ngram_embedding.py`): `model.ngram.*`."""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.config.schema import ModelConfig
from mcore_rl.config.sections import Section


@dataclass
class NgramEmbeddingConfig:
    """Over-Encoding (OverTok, arXiv:2501.16975): hashed n-gram input embeddings added to the 1-gram one."""

    orders: list[int] = field(default_factory=list)  # e.g. [2, 3]; empty = off
    table_size: int = 0  # rows m per order (hashed ids mod m); gcd(m, vocab) != 1 warns
    num_slices: int = 1  # k slices per order, each with its own projection to hidden_size
    shard_over_data_parallel: bool = False  # also split table rows across data-parallel ranks


SECTION = Section(ModelConfig, "ngram", NgramEmbeddingConfig)
