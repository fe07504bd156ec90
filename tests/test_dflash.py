"""DSpark's block drafter (`rollout/engine/dflash.py`, `drafts.BlockDrafter`): a parallel block of k
drafts from the target's hidden state with the low-rank Markov bias head.

DSpark's testable property (W1 = 0 is the pure parallel drafter; the bias of previous token v is row v
of W1 times W2); 2,000 seeded requests drafted by a block head with a random Markov bias give plain
sampling's exact joint; greedy decoding stays plain decoding token for token with requests joining
mid-batch; training on the target's own samples lowers the loss and raises the engine's acceptance.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mcore_rl.rollout.engine.core import Request
from mcore_rl.rollout.engine.dflash import BlockHead, block_loss, train_block_head
from mcore_rl.rollout.engine.sampling import SamplingParams
from mcore_rl.rollout.engine.speculative import SpeculativeSettings
from tests.helpers import make_engine, run, tiny_model
from tests.test_speculative import (
    JOINT_PROMPT,
    JOINT_SP,
    JOINT_TOKENS,
    JOINT_VOCAB,
    _greedy_requests,
    chi_square_pvalue,
    exact_joint,
    plain_greedy,
)

DFLASH = SpeculativeSettings("DFLASH", num_steps=3)


def _head(model, seed: int = 0, markov: float = 0.0, block: int = 3) -> BlockHead:
    torch.manual_seed(seed)
    head = BlockHead(model, block=block, rank=8)
    if markov:
        with torch.no_grad():
            head.w1.weight.normal_(0.0, markov)
    return head


def test_markov_head_properties() -> None:
    model = tiny_model()
    head = _head(model)
    prev = torch.tensor([3, 17, 250])
    assert head.bias(prev).abs().max() == 0  # W1 = 0: softmax(U_j), the pure parallel drafter
    head = _head(model, markov=1.0)
    b = head.bias(prev)
    assert torch.allclose(b[1], head.w1.weight[17] @ head.w2.weight.T, atol=1e-6)
    hidden = torch.randn(2, 64)
    assert head.base_logits(hidden, torch.tensor([1, 2])).shape == (2, 3, 384)


def test_block_drafts_sample_the_exact_joint() -> None:
    """2,000 seeded requests of four tokens (the first from the prefill, then a block of up to three
    per verification): the joint equals plain sampling's exactly computed one."""
    model = tiny_model(vocab_size=JOINT_VOCAB)
    sp = SamplingParams(**JOINT_SP)
    joint = exact_joint(model, JOINT_PROMPT, sp, JOINT_TOKENS)
    head = _head(model, markov=2.0)
    engine = make_engine(copy.deepcopy(model), max_running_requests=64, speculative=copy.copy(DFLASH), draft_model=head)
    n = 2000
    outs = run(engine, [Request(f"r{i}", JOINT_PROMPT, SamplingParams(**JOINT_SP, seed=i)) for i in range(n)])
    stats = engine.spec_stats
    assert stats["drafted"] > n and 0 < stats["accepted"] < stats["drafted"]
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells) + 1)
    for o in outs.values():
        counts[index.get(tuple(o.output_ids), len(cells))] += 1
    assert chi_square_pvalue(counts, torch.tensor([joint[c] for c in cells] + [0.0])) > 1e-3


def _trained(model, steps: int) -> tuple[BlockHead, list[float]]:
    """A block head trained on the target's own greedy and sampled continuations of short prompts."""
    engine = make_engine(copy.deepcopy(model), max_running_requests=16)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(4 + i % 5)] for i in range(16)]
    outs = run(
        engine,
        [
            Request(f"t{i}", p, SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=40, seed=i))
            for i, p in enumerate(prompts)
        ],
    )
    sequences = [prompts[int(rid[1:])] + o.output_ids for rid, o in outs.items()]
    head = _head(model, block=4)
    return head, train_block_head(head, model, sequences, steps=steps)


def test_greedy_block_drafts_are_plain_decoding() -> None:
    model = tiny_model()
    head, _ = _trained(model, steps=150)
    engine = make_engine(copy.deepcopy(model), speculative=SpeculativeSettings("DFLASH", num_steps=4), draft_model=head)
    outs = run(engine, _greedy_requests(), stagger=2)
    assert engine.spec_stats["accepted"] > 0
    for rid, want in plain_greedy().items():
        assert outs[rid].output_ids == want.output_ids and outs[rid].finish_reason == want.finish_reason
        for (a, _), (b, _) in zip(outs[rid].output_token_logprobs, want.output_token_logprobs):
            assert a == pytest.approx(b, abs=1e-5)


def test_training_raises_acceptance() -> None:
    model = tiny_model()
    untrained = _head(model, block=4)
    head, losses = _trained(model, steps=150)
    assert sum(losses[-20:]) / 20 < 0.9 * sum(losses[:20]) / 20

    def acceptance(h: BlockHead) -> float:
        engine = make_engine(
            copy.deepcopy(model), speculative=SpeculativeSettings("DFLASH", num_steps=4), draft_model=h
        )
        reqs = [
            Request(
                f"a{i}",
                [(11 * i + j) % 300 + 1 for j in range(5)],
                SamplingParams(temperature=1.0, max_new_tokens=30, seed=i),
            )
            for i in range(8)
        ]
        run(engine, reqs)
        return engine.spec_stats["accepted"] / max(1, engine.spec_stats["drafted"])

    assert acceptance(head) > 1.4 * acceptance(untrained)  # measured: 0.18 against 0.10


def test_refusals() -> None:
    with pytest.raises(ValueError, match="^speculative_algorithm: DFLASH needs its dflash.BlockHead"):
        make_engine(tiny_model(), speculative=copy.copy(DFLASH))
    with pytest.raises(ValueError, match="^speculative_algorithm: DFLASH needs a dflash.BlockHead of the target's"):
        make_engine(tiny_model(), speculative=copy.copy(DFLASH), draft_model=tiny_model(vocab_size=48))
    hidden, tokens = torch.randn(6, 64), torch.tensor([1, 2, 3, 4, 5, 6])
    model = tiny_model()
    assert float(block_loss(_head(model), hidden, tokens, model.lm_head(hidden)).detach()) > 0
