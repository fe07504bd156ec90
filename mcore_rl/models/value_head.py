"""A value head in place of the output layer: the same megatron-core decoder scores a sequence.

A reward model is the policy's decoder with `num_heads` scalars per position instead of the
vocabulary's logits, like `transformers`' `*ForSequenceClassification` (`score`: a bias-free linear
layer, hidden -> num_labels). `install_value_head` swaps the last stage's `output_layer` for a
`ValueHead`; megatron-core's `GPTModel` calls it where it would compute logits, so the chunk returns
values [b, s, num_heads] and everything else (layouts, schedules, checkpoints) stays the policy's.

The head's weight is tiny and replicated over tensor-parallel ranks. Without sequence parallelism
every TP rank holds the same final hidden states, computes the same values and the same (full)
gradient. With it, each rank scores its slice of the sequence; the values are gathered (the backward
only splits them, each rank's slice gradient being complete), and the weight is marked
`sequence_parallel` so that `finalize_model_grads` sums its partial gradients over the TP group,
as it does for the norms.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_rl.models.param_attrs import megatron_attrs

# The head's parameter under the chunk (the output layer's name: megatron-core's checkpointing of a
# GPT model expects one there), and its Hugging Face name.
HEAD_PARAM = "output_layer.weight"
HF_HEAD_PARAM = "score.weight"


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] -> (values [s, b, num_heads], None): the output layer's call signature."""

    def __init__(self, config: TransformerConfig, num_heads: int, seed: int) -> None:
        super().__init__()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        weight = torch.empty(num_heads, config.hidden_size, dtype=torch.float32)
        # Its own generator: replicated weights must be equal on every rank whatever the RNG tracker did.
        weight.normal_(0.0, config.init_method_std, generator=torch.Generator().manual_seed(seed))
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=config.params_dtype))
        self.sequence_parallel = config.sequence_parallel
        megatron_attrs(self.weight).sequence_parallel = config.sequence_parallel

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        """`weight` and `runtime_gather_output` are the output layer's arguments; a value head has
        its own weight and nothing vocabulary-parallel to gather."""
        values = torch.nn.functional.linear(hidden, self.weight)
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def install_value_head(chunk: GPTModel, num_heads: int, seed: int) -> None:
    """Give a GPT chunk of the last pipeline stage a value head instead of its output layer (before
    it is wrapped in DDP); other stages have no output layer and are left as they are."""
    if not chunk.post_process:
        return
    if chunk.share_embeddings_and_output_weights:
        raise ValueError("a reward model's decoder must be built with untied embeddings (no output layer to tie)")
    chunk.output_layer = ValueHead(chunk.config, num_heads, seed)
