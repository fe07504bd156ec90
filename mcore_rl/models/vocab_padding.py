"""Vocabulary padding: the megatron model's embedding and output layer have more rows than the
tokenizer has tokens, so that they split evenly over tensor-parallel ranks.

As in Megatron-LM, the padded size is the true `model.vocab_size` rounded up to a multiple of
`model.make_vocab_size_divisible_by` x TP. Everything outside the megatron model sees the true
size: import appends padded rows (zeros: they are never looked up by a real token id, and the
padded output columns are masked, so their values are never read), export and the weight sync drop
them (`hf.weight_map.megatron_to_hf`), and every normaliser over the vocabulary masks the padded
columns to -inf — the output layer's logits here (the SFT loss reads them), the chunked
vocab-parallel log-probs and entropy (`train/logprobs.py`) and the top-k of distillation
(`train/teachers.py`) — so a padded id is never scored, sampled or chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mcore_rl.config.rules import padded_vocab_size  # noqa: F401  (pure arithmetic, also used without torch)

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

# megatron global names of the tensors with one row per vocabulary entry
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def pad_vocab_rows(name: str, full: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """A full vocabulary tensor (true size) with zero rows appended up to `padded_rows`; other
    tensors, and ones already of that size, unchanged."""
    if name not in VOCAB_TENSORS or full.shape[0] >= padded_rows:
        return full
    return torch.cat([full, full.new_zeros((padded_rows - full.shape[0], *full.shape[1:]))])


def padded_columns_from(vocab_size: int | None, vocab_start: int, local_vocab: int) -> int:
    """The first local index of a vocabulary shard [vocab_start, vocab_start + local_vocab) that is
    padding (local_vocab when none is; 0 when the whole shard is)."""
    if vocab_size is None:
        return local_vocab
    return min(max(vocab_size - vocab_start, 0), local_vocab)


def mask_padded_logits(logits: torch.Tensor, vocab_size: int | None, vocab_start: int) -> torch.Tensor:
    """logits [..., local_vocab] of the shard starting at `vocab_start`, -inf at the padded ids."""
    start = padded_columns_from(vocab_size, vocab_start, logits.shape[-1])
    if start == logits.shape[-1]:
        return logits
    keep = torch.arange(logits.shape[-1], device=logits.device) < start
    return logits.masked_fill(~keep, float("-inf"))


def install_vocab_padding(gpt: GPTModel, vocab_size: int) -> None:
    """Record the true vocabulary size on a GPT chunk (`unpadded_vocab_size`, read by the log-prob
    code) and, when it is padded, mask the padded columns of its output layer's logits."""
    gpt.unpadded_vocab_size = vocab_size
    output_layer = getattr(gpt, "output_layer", None)
    if output_layer is None or gpt.vocab_size == vocab_size:
        return

    def mask(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        from megatron.core import parallel_state as ps

        logits, bias = output
        start = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
        return mask_padded_logits(logits, vocab_size, start), bias

    output_layer.register_forward_hook(mask)
