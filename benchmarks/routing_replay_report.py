"""MoE routing replay (R3): the train–inference mismatch of an FP8 engine with and without replay.

An FP8 embedded engine (`rollout.quantization: fp8`; the router gate itself stays full precision,
only the Linear layers around it are e4m3) samples responses and returns its routed experts; the
fp32 trainer's function — the reference model `mcore_rl/hf`, which the megatron-core model matches
to ~1e-6 in every layout (tests/test_parity.py, tests/test_routing_replay.py) — recomputes the log-
probs of the engine's own tokens twice: routing naturally, and replaying the engine's experts (R3).
Printed: K3 = mean(exp(d) - d - 1) and mean |d| over response tokens, d = log π - log μ (the
`mismatch/k3`, `mismatch/abs_logp_diff` the learner logs), and the fraction of (token, layer) pairs
whose expert *set* differs between engine and trainer.

    PYTHONPATH=. python benchmarks/routing_replay_report.py [--prompts 16] [--samples 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from mcore_rl.algos.mismatch import mismatch_metrics
from mcore_rl.config.schema import ModelConfig
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
from mcore_rl.rollout.engine.core import EngineCore, Request
from mcore_rl.rollout.engine.sampling import SamplingParams

MODEL = ModelConfig.of(
    arch="qwen3_moe",
    num_layers=4,
    hidden_size=128,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=128,
)


@torch.no_grad()
def _trainer(model: torch.nn.Module, seq: list[int], forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-probs of seq[1:] and the experts used [len(seq), layers, k] (`forced` rows: replayed)."""
    taps = [layer.mlp.routing for layer in model.model.layers]
    for li, tap in enumerate(taps):
        tap.record, tap.forced = True, None if forced is None else forced[:, li]
    logits = model(torch.tensor([seq])).logits[0].float()
    routed = torch.stack([tap.routed for tap in taps], dim=1)
    for tap in taps:
        tap.record, tap.forced, tap.routed = False, None, None
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    return lp, routed


def measure(
    mc: ModelConfig = MODEL, prompts: int = 16, samples: int = 4, max_new_tokens: int = 24, seed: int = 0
) -> dict[str, float]:
    """Generate with an FP8 engine, score the engine's tokens with the fp32 model without and with R3."""
    torch.manual_seed(seed)
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).float().eval()
    engine = EngineCore(
        copy.deepcopy(model),
        load_tokenizer(None),
        quantization="fp8",
        context_length=256,
        max_running_requests=64,
        random_seed=seed,
    )
    g = torch.Generator().manual_seed(seed)
    reqs = {}
    for p in range(prompts):
        ids = torch.randint(3, mc.vocab_size, (int(torch.randint(4, 16, (1,), generator=g)),), generator=g).tolist()
        for j in range(samples):
            rid = f"{p}:{j}"
            reqs[rid] = ids
            engine.add_request(
                Request(
                    rid,
                    ids,
                    SamplingParams(
                        max_new_tokens=max_new_tokens, temperature=1.0, sampling_seed=seed * 1000 + p * samples + j
                    ),
                    return_logprob=True,
                    return_routed_experts=True,
                )
            )
    outs = {}
    while engine.has_work():
        outs.update({o.rid: o for o in engine.step() if o.finished})
    n = len(outs)
    t = max(len(o.output_ids) for o in outs.values())
    mu, natural, replayed, mask = (torch.zeros(n, t) for _ in range(4))
    flips = pairs = 0
    for i, (rid, o) in enumerate(sorted(outs.items())):
        prompt = reqs[rid]
        seq, k = prompt + o.output_ids, len(o.output_ids)
        engine_routing = torch.from_numpy(o.routed_experts).long()
        forced = torch.cat([engine_routing, torch.full((1, *engine_routing.shape[1:]), -1)])
        lp, routed = _trainer(model, seq, None)
        lp_r3, routed_r3 = _trainer(model, seq, forced)
        assert torch.equal(routed_r3[:-1], engine_routing), "replay did not use the engine's experts"
        same = (routed[:-1].sort(-1).values == engine_routing.sort(-1).values).all(-1)  # [tokens, layers]
        flips += int((~same).sum())
        pairs += same.numel()
        mu[i, :k] = torch.tensor([lp_ for lp_, _ in o.output_token_logprobs])
        natural[i, :k] = lp[len(prompt) - 1 :]
        replayed[i, :k] = lp_r3[len(prompt) - 1 :]
        mask[i, :k] = 1
    none, r3 = mismatch_metrics(natural, mu, mask), mismatch_metrics(replayed, mu, mask)
    return {
        "sequences": float(n),
        "response_tokens": float(mask.sum()),
        "token_layer_pairs": float(pairs),
        "routing_differs_frac": flips / max(pairs, 1),
        "k3_no_replay": float(none["mismatch/k3"]),
        "abs_logp_diff_no_replay": float(none["mismatch/abs_logp_diff"]),
        "k3_r3": float(r3["mismatch/k3"]),
        "abs_logp_diff_r3": float(r3["mismatch/abs_logp_diff"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(
        json.dumps(
            measure(prompts=a.prompts, samples=a.samples, max_new_tokens=a.max_new_tokens, seed=a.seed), indent=1
        )
    )


if __name__ == "__main__":
    main()
