"""SmolLM2-135M on this CPU: generation and training-step tokens/s, fp32 vs bf16, side by side.

Generation (`--part generate`): the embedded engine (`EngineCore.from_model_path`) vs
`transformers`' `LlamaForCausalLM.generate` on the same checkpoint, the same prompts (`--prompt-len`
random token ids, all one length: no padding on either side) and greedy decoding of `--new-tokens`
tokens with eos ignored, at batch 1/16/64, in fp32 and bf16. Throughput = batch x new tokens over
the wall time from submitting the batch to the last token (prefill included). The four sides
(engine/transformers x fp32/bf16) alternate within each round, the order rotating every round,
so load from other processes hits all alike; median and best round are printed.

Training (`--part train`): one optimizer step of the real trainer (`mcore_rl.train.sft`:
megatron-core GPTModel, its schedule, AdamW) on rows of `--seq-length` tokens, `--rows` rows a
step, `train.precision` fp32 vs bf16 (bf16 weights and activations, fp32 main weights in the
optimizer). Each precision runs in its own subprocess (a trainer owns the process's parallel
state); they alternate, `--rounds` times, each timing `--steps` steps after one warm-up step.

On the 2-core AVX2 development machine the bf16 sides are slow: the batch-64 rows take minutes a
round, and `--part train` did not finish within 12 minutes (docs/real_model.md).

    .venv/bin/python benchmarks/bench_real_model.py --model-path runs/smollm2/hf              # both parts
    .venv/bin/python benchmarks/bench_real_model.py --model-path runs/smollm2/hf --part generate --batches 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def engine_generate(path: str, dtype: str, prompts: list[list[int]], new_tokens: int) -> float:
    from mcore_rl.rollout.engine import EngineCore, Request, SamplingParams

    engine = EngineCore.from_model_path(
        path, dtype=dtype, max_running_requests=len(prompts), context_length=len(prompts[0]) + new_tokens + 1
    )
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(
            Request(str(i), p, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        )
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )
    return time.perf_counter() - t0


def bench_generate(args) -> None:
    from transformers import AutoModelForCausalLM

    hf = {}
    for name in args.dtypes:
        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=DTYPES[name]).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        hf[name] = model
    vocab = hf[args.dtypes[0]].config.vocab_size
    print(
        f"generation: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds (tok/s: median, best)"
    )
    print(
        "| batch | dtype | engine tok/s | transformers tok/s | engine / transformers | best: engine | best: transformers |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=g).tolist()
        sides = [(kind, d) for d in args.dtypes for kind in ("engine", "hf")]
        times: dict[tuple[str, str], list[float]] = {s: [] for s in sides}
        for kind, d in sides:  # warm-up: every code path once
            engine_generate(args.model_path, d, prompts[:1], 2) if kind == "engine" else hf_generate(
                hf[d], prompts[:1], 2
            )
        for r in range(args.rounds):
            for kind, d in sides[r % len(sides) :] + sides[: r % len(sides)]:
                if kind == "engine":
                    times[(kind, d)].append(engine_generate(args.model_path, d, prompts, args.new_tokens))
                else:
                    times[(kind, d)].append(hf_generate(hf[d], prompts, args.new_tokens))
        n = batch * args.new_tokens
        for d in args.dtypes:
            e, h = n / statistics.median(times[("engine", d)]), n / statistics.median(times[("hf", d)])
            eb, hb = n / min(times[("engine", d)]), n / min(times[("hf", d)])
            print(f"| {batch} | {d} | {e:,.1f} | {h:,.1f} | {e / h:.2f}x | {eb:,.1f} | {hb:,.1f} |", flush=True)


# ------------------------------------------------------------------------------ training step


def train_worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from mcore_rl.config import SFTConfig, load_config
    from mcore_rl.parallel import setup
    from mcore_rl.train.sft import build_trainer, train_step

    recipe = os.path.join(args.mcore_path, "recipe.yaml")
    cfg = load_config(
        SFTConfig,
        recipe,
        [
            f"train.precision={args.precision}",
            f"train.seq_length={args.seq_length}",
            "train.micro_batch_size=1",
            f"train.global_batch_size={args.rows}",
            f"train.train_iters={args.steps + 1}",
            "train.eval_interval=0",
            f"data.tokenizer_path={args.model_path}",
            "data.synthetic_task=addition",
            "data.synthetic_num_examples=4096",
            f"run_dir={tempfile.mkdtemp(prefix='bench_real_')}",
            "checkpoint.load_dir=null",
            "optimizer.lr=1e-6",
        ],
    )
    trainer = build_trainer(cfg)
    times = []
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        train_step(trainer)
        if i:
            times.append(time.perf_counter() - t0)
    setup.destroy()
    with open(args.result_file, "w") as f:
        json.dump({"times": times, "tokens": args.rows * args.seq_length}, f)


def bench_train(args) -> None:
    results: dict[str, list[float]] = {p: [] for p in args.dtypes}
    tokens = args.rows * args.seq_length
    for r in range(args.rounds):
        for precision in args.dtypes if r % 2 == 0 else args.dtypes[::-1]:
            fd, out = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--model-path",
                args.model_path,
                "--mcore-path",
                args.mcore_path,
                "--worker-precision",
                precision,
                "--result-file",
                out,
                "--steps",
                str(args.steps),
                "--rows",
                str(args.rows),
                "--seq-length",
                str(args.seq_length),
            ]
            env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{precision} worker failed:\n{proc.stderr[-3000:]}")
            with open(out) as f:
                results[precision] += json.load(f)["times"]
            os.unlink(out)
    print(
        f"\ntraining step: {args.rows} rows x {args.seq_length} tokens = {tokens} tokens, forward + backward + "
        f"AdamW, {args.rounds} rounds x {args.steps} steps"
    )
    print("| precision | step s (median) | tok/s (median) | tok/s (best) | vs fp32 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = tokens / statistics.median(results[args.dtypes[0]])
    for p in args.dtypes:
        med = statistics.median(results[p])
        print(
            f"| {p} | {med:.2f} | {tokens / med:,.0f} | {tokens / min(results[p]):,.0f} | {tokens / med / base:.2f}x |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="runs/smollm2/hf", help="the HF checkpoint (tools/fetch_smollm2.py)")
    ap.add_argument(
        "--mcore-path", default="runs/smollm2/mcore", help="its megatron conversion (recipe.yaml: the model)"
    )
    ap.add_argument("--part", choices=["generate", "train", "both"], default="both")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--worker-precision", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_precision:
        args.precision = args.worker_precision
        return train_worker(args)
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"
    )
    if args.part in ("generate", "both"):
        bench_generate(args)
    if args.part in ("train", "both"):
        bench_train(args)


if __name__ == "__main__":
    main()
