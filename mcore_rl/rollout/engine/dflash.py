"""DSpark's semi-autoregressive drafter: a DFlash-style parallel block plus a low-rank Markov bias head.

"DFlash: Block Diffusion for Flash Speculative Decoding" (ICML 2026) drafts a whole block of k tokens
in one forward of a small network conditioned on the target's hidden features; "DSpark:
Confidence-Scheduled Speculative Decoding with Semi-Autoregressive Generation" (PKU & DeepSeek,
2026) adds a tiny sequential head that restores the dependency between the block's tokens:

    p_j(v | x_0, x_<j) = softmax(U_j + B(x_{j-1}))(v),   B(x_{j-1}, .) = W1[x_{j-1}] W2  (rank r)

with U_1..U_k the block's base logits (one parallel pass from the anchor x_0, the last token, and
the target's final-normed hidden state at the position before it, the one that predicted x_0), and
the draft sampled left to right. W1 = 0 leaves the pure parallel drafter softmax(U_j). The embedding
and output layer are the target's (frozen, not parameters here, as in DSpark's training).

The parallel stage here is small by design (the demo scale): the anchor's embedding and the hidden
state projected to the model width, a learned embedding per block position added, one residual MLP,
a norm, the target's output layer. Not DFlash's denoising transformer over anchor + mask tokens.
Training (`train_block_head`): on the target's own sequences, teacher-forced (the Markov head reads
the sequence's previous token), loss 0.1 CE + 0.9 TV against the target's distribution at each block
position, position weights exp(-(j-1)/k) (DSpark's loss without its confidence term; the confidence
head is `spec_confidence.py`). Exactness does not depend on any of it: the engine verifies the
drafts by rejection sampling against the target with q_j as drawn (`speculative.py`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class BlockHead(nn.Module):
    """U_1..U_k in one pass from (hidden, anchor), and the Markov bias B(prev)."""

    def __init__(self, target: nn.Module, block: int = 4, rank: int = 16) -> None:
        super().__init__()
        config: Any = target.config
        hidden, vocab = int(config.hidden_size), int(config.vocab_size)
        self.block, self.rank, self.vocab_size = block, rank, vocab
        self.inp = nn.Linear(2 * hidden, hidden, bias=False)
        self.pos = nn.Parameter(torch.randn(block, hidden) * 0.02)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.w1 = nn.Embedding(vocab, rank)
        self.w2 = nn.Linear(rank, vocab, bias=False)
        nn.init.zeros_(self.w1.weight)  # W1 = 0: the pure parallel drafter until trained
        tree: Any = target.model
        self._frozen: tuple[Any, Any] = (tree.embed_tokens, target.lm_head)  # the target's, not registered here

    def base_logits(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """[b, block, V] base logits U from the target's hidden state [b, H] before the anchor and the
        anchor token [b]."""
        embed, lm_head = self._frozen
        x = self.inp(torch.cat([hidden.to(self.pos.dtype), embed(anchor).to(self.pos.dtype)], -1))
        z = x[:, None] + self.pos[None]
        z = z + self.down(torch.nn.functional.silu(self.up(z)))
        return lm_head(self.norm(z).to(lm_head.weight.dtype)).float()

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """[b, V] the Markov bias W1[prev] W2 of the previous tokens [b]."""
        return self.w2(self.w1(prev)).float()


def block_loss(
    head: BlockHead, hidden: torch.Tensor, tokens: torch.Tensor, target_logits: torch.Tensor, ce_coeff: float = 0.1
) -> torch.Tensor:
    """DSpark's drafter loss on one sequence, every anchor at once: `hidden` [L, H] the target's
    final-normed states, `tokens` [L], `target_logits` [L, V]. Anchor a (1 <= a <= L - 2) reads
    hidden[a - 1] and tokens[a]; block position j predicts tokens[a + j] against softmax of
    target_logits[a + j - 1], with the Markov bias of tokens[a + j - 1]. Weighted by exp(-(j-1)/k)."""
    length = tokens.shape[0]
    k = head.block
    anchors = torch.arange(1, length - 1)
    base = head.base_logits(hidden[anchors - 1], tokens[anchors])  # [A, k, V]
    total = torch.zeros((), dtype=torch.float32)
    weight_sum = 0.0
    for j in range(1, k + 1):
        rows = anchors + j - 1 < length - 1  # the target's distribution at a + j - 1 predicts a + j
        if not bool(rows.any()):
            break
        a = anchors[rows]
        logq = torch.log_softmax(base[rows, j - 1] + head.bias(tokens[a + j - 1]), -1)
        p = torch.softmax(target_logits[a + j - 1].float(), -1)
        ce = -(p * logq).sum(-1).mean()
        tv = 0.5 * (p - logq.exp()).abs().sum(-1).mean()
        w = math.exp(-(j - 1) / k)
        total = total + w * (ce_coeff * ce + (1 - ce_coeff) * tv)
        weight_sum += w
    return total / max(weight_sum, 1e-9)


def train_block_head(
    head: BlockHead, target: nn.Module, sequences: list[list[int]], steps: int, lr: float = 3e-3, seed: int = 0
) -> list[float]:
    """AdamW on `block_loss` over the target's (frozen) hidden states and logits of `sequences`, one
    sequence per step in a seeded order; the losses per step."""
    tree: Any = target.model
    lm_head: Any = target.lm_head
    with torch.no_grad():
        cached = []
        for seq in sequences:
            ids = torch.tensor([seq])
            hidden = tree(input_ids=ids).last_hidden_state[0]
            cached.append((hidden.float(), torch.tensor(seq), lm_head(hidden).float()))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        hidden, tokens, logits = cached[int(torch.randint(len(cached), (1,), generator=order))]
        loss = block_loss(head, hidden, tokens, logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
