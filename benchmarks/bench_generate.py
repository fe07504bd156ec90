"""Generation throughput: the embedded engine (`EngineCore`) vs `transformers`' `generate`.

Same weights, same prompts, greedy decoding of a fixed number of new tokens (eos ignored), at
several batch sizes; printed side by side with the engine/transformers ratio.

    .venv/bin/python benchmarks/bench_generate.py                       # demo + big, batch 1/16/64
    .venv/bin/python benchmarks/bench_generate.py --sizes big --batches 64 --rounds 5

* engine: `EngineCore` (fp32) over `McoreRLForCausalLM`; all B requests are added at once
  and `step()` is called until they finish (prefill of the batch, then batched decode steps).
* transformers: stock `transformers.Qwen3ForCausalLM` built from `to_stock_hf_config(config)` with
  the same state dict, `generate(input_ids, attention_mask, do_sample=False, max_new_tokens=N,
  min_new_tokens=N)` with eos disabled, its default dynamic KV cache and SDPA attention.

Throughput = B x N output tokens over the wall time from submitting the batch to the last token
(prefill included), median over `--rounds` rounds, and the best round (the least disturbed one:
on a shared machine other processes only ever slow a round down); the two sides alternate within
each round (the order swaps every round) so load from other processes hits both alike. Both
run with `--threads` intra-op threads (default 1). Prompts are `--prompt-len` random token ids, all
the same length (no padding on either side). The column "same tokens" counts the rows whose greedy
continuation is identical on both sides (fp32 rounding can flip a near-tie now and then).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

SIZES: dict[str, dict[str, int]] = {
    "demo": {},  # ModelConfig() defaults: hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 384
    "big": {"hidden_size": 256, "num_layers": 4, "ffn_hidden_size": 1024},  # as benchmarks/bench_sft.py "big"
}


def build_models(size: str, seed: int):
    from transformers import Qwen3ForCausalLM

    from mcore_rl.config.schema import ModelConfig
    from mcore_rl.hf import (
        McoreRLForCausalLM,
        hf_config_from_model_config,
        to_stock_hf_config,
        to_stock_state_dict,
    )

    config = hf_config_from_model_config(ModelConfig.of(**SIZES[size]))
    torch.manual_seed(seed)
    ours = McoreRLForCausalLM(config).eval()
    stock = Qwen3ForCausalLM(to_stock_hf_config(config)).eval()
    missing, unexpected = stock.load_state_dict(to_stock_state_dict(ours.state_dict(), config), strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    stock.generation_config.eos_token_id = None
    stock.generation_config.pad_token_id = 0
    return ours, stock


def run_engine(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rollout.engine.core import EngineCore, Request
    from mcore_rl.rollout.engine.sampling import SamplingParams

    engine = EngineCore(
        model,
        load_tokenizer(None),
        max_running_requests=len(prompts),
        context_length=len(prompts[0]) + new_tokens + 1,
    )
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(
            Request(str(i), p, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        )
    outs = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                outs[int(o.rid)] = o.output_ids
    return time.perf_counter() - t0, [outs[i] for i in range(len(prompts))]


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )
    return time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()


def bench(size: str, batch: int, args) -> dict:
    ours, stock = build_models(size, args.seed)
    g = torch.Generator().manual_seed(args.seed + batch)
    prompts = torch.randint(0, ours.config.vocab_size, (batch, args.prompt_len), generator=g).tolist()
    new_tokens = args.new_tokens
    run_engine(copy.deepcopy(ours), prompts[:2], 4)  # warm up both code paths
    run_hf(stock, prompts[:2], 4)
    times = {"engine": [], "hf": []}
    tokens = {}
    for r in range(args.rounds):
        order = ["engine", "hf"] if r % 2 == 0 else ["hf", "engine"]
        for side in order:
            if side == "engine":
                dt, toks = run_engine(copy.deepcopy(ours), prompts, new_tokens)
            else:
                dt, toks = run_hf(stock, prompts, new_tokens)
            times[side].append(dt)
            tokens[side] = toks
    same = sum(a == b for a, b in zip(tokens["engine"], tokens["hf"]))
    n = batch * new_tokens
    med = {k: n / statistics.median(v) for k, v in times.items()}
    best = {k: n / min(v) for k, v in times.items()}
    return {"size": size, "batch": batch, "med": med, "best": best, "same": f"{same}/{batch}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["demo", "big"], choices=sorted(SIZES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s), "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, fp32, {args.rounds} rounds"
    )
    print(
        "| size | batch | engine tok/s | transformers tok/s | engine / transformers | best-of: engine | best-of: transformers | best-of ratio | same tokens |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in args.sizes:
        for batch in args.batches:
            r = bench(size, batch, args)
            m, b = r["med"], r["best"]
            print(
                f"| {size} | {batch} | {m['engine']:,.0f} | {m['hf']:,.0f} | {m['engine'] / m['hf']:.2f}x "
                f"| {b['engine']:,.0f} | {b['hf']:,.0f} | {b['engine'] / b['hf']:.2f}x | {r['same']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
