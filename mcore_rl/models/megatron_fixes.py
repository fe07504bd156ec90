"""Corrections to megatron-core 0.16.1 numerics that hold on GPU as on CPU.

MoE aux loss under sequence parallelism with per-token loss scaling: each tensor-parallel rank
computes a partial aux loss over its slice of tokens (the partials sum to the micro-batch's aux
loss) and the router scales it by the *local* token count before `finalize_model_grads` divides by
the global count. The aux gradient therefore shrinks by 1/TP whenever TP > 1 — the gradient of a
model depends on its layout. Scaling by the micro-batch's total token count restores
`T_microbatch * d(aux) / T_global` in every layout (tests/test_parity.py checks it against the
reference model for TP=2 and TP=2 x EP=2).
"""

from __future__ import annotations

from typing import Any

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe import router

    original = router.get_tokens_per_expert_and_token_count

    def tokens_per_expert_and_token_count(*args: Any, **kwargs: Any) -> tuple:
        global_tokens_per_expert, _local, total_num_tokens = original(*args, **kwargs)
        return global_tokens_per_expert, total_num_tokens, total_num_tokens

    router.get_tokens_per_expert_and_token_count = tokens_per_expert_and_token_count
    _applied = True
