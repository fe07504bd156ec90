"""Teacher scoring through an engine vs an in-trainer teacher forward, on the same samples.

    python benchmarks/bench_teacher.py                                   # 64 samples, 32 + 96 tokens
    python benchmarks/bench_teacher.py --hidden 256 --layers 4 --samples 128 --repeats 5 --top-k 8

One teacher model (a Qwen3-style `ModelConfig` of the given size, random weights) scores N
samples (prompt + response token ids; every response token's log-prob), two ways:

* `engine`     -- an `mcore-rl serve` process on an HF checkpoint of the model, reached through
  `EngineTeacher` (SGLang's prompt-scoring request: `max_new_tokens: 0`, `logprob_start_len`,
  optionally `top_logprobs_num`), as a teacher given by URL or started by the trainer is;
* `in-trainer` -- `FrozenTeacher` in this process: megatron-core model chunks of the same
  architecture, a forward of the packed micro-batches (`Learner.token_logprobs`, fp32, chunked
  vocab-parallel log-probs; with `--top-k` a second pass, `token_topk`), as the frozen-copy and
  privileged-context teachers run.

The two sides alternate over `--repeats` (engine first on even repeats, in-trainer first on odd
ones) after one warm-up each; reported: the median and the min-max spread of response tokens
scored per second, and of peak memory: the whole engine process's peak RSS (VmHWM, reset before
each repeat; that process exists only for the teacher) vs the growth of this trainer process's
peak RSS over its RSS before the teacher's chunks were built (the copy's weights plus the
forward's activations). Both sides get `--threads` torch threads and run one at a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_kib(pid: str = "self", field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak(pid: str = "self") -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def model_overrides(args: argparse.Namespace) -> list[str]:
    heads = max(1, args.hidden // 32)
    return [
        f"model.hidden_size={args.hidden}",
        f"model.ffn_hidden_size={args.hidden * 4}",
        f"model.num_layers={args.layers}",
        f"model.num_attention_heads={heads}",
        f"model.num_query_groups={max(1, heads // 2)}",
        f"model.max_position_embeddings={max(256, args.prompt + args.response + 8)}",
    ]


def make_samples(n: int, prompt: int, response: int, seed: int = 0) -> list:
    import torch

    from mcore_rl.data.samples import Prompt, Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 256, (prompt,), generator=g).tolist()
        resp = torch.randint(0, 256, (response,), generator=g).tolist()
        out.append(Sample(Prompt(i, "", ids), i, resp, [0.0] * response, 1, "length"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=96)
    ap.add_argument("--top-k", type=int, default=0, help="both sides also return the teacher's top-k per position")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=8, help="in-trainer rows per micro-batch")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.rollout.teacher import EngineTeacher, start_teacher_engines

    seq = args.prompt + args.response
    cfg = load_config(
        RLConfig,
        None,
        model_overrides(args)
        + [
            f"train.seq_length={seq}",
            f"train.micro_batch_size={args.micro_batch}",
            "rollout.max_new_tokens=8",
            f"rollout.context_length={seq + 8}",
            "data.synthetic_max_digits=1",
            "eval.num_prompts=1",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
        ],
    )
    samples = make_samples(args.samples, args.prompt, args.response)
    tokens = args.samples * args.response
    tmp = tempfile.mkdtemp(prefix="bench_teacher_")

    # the engine side: a checkpoint, one `mcore-rl serve` process, EngineTeacher
    model = McoreRLForCausalLM(hf_config_from_model_config(cfg.model))
    model.save_pretrained(os.path.join(tmp, "teacher"))
    del model
    procs = start_teacher_engines(
        os.path.join(tmp, "teacher"),
        num=1,
        workdir=os.path.join(tmp, "engine"),
        context_length=seq + 8,
        threads=args.threads,
        max_running_requests=max(1, args.samples),
    )
    engine = EngineTeacher(
        "bench",
        procs.urls,
        vocab_size=cfg.model.vocab_size,
        top_k=args.top_k,
        max_concurrency=args.samples,
        processes=procs,
        restart_dead=False,
    )
    pid = str(procs.pids[0])

    # the in-trainer side: the policy world (1 rank, gloo) and a frozen copy of it
    from mcore_rl.config import validate_rl_config
    from mcore_rl.train.policy import build_policy
    from mcore_rl.train.rl_step import Learner
    from mcore_rl.train.teachers import FrozenTeacher, token_topk

    policy = build_policy(cfg, validate_rl_config, 1)
    learner = Learner(cfg, policy.chunks, policy.optimizer, None, policy.tokenizer.pad_id)
    rss_before = _rss_kib()
    frozen = FrozenTeacher("bench", cfg, policy.chunks, top_k=args.top_k)

    def logprobs(ss, t, chunks):
        return learner.token_logprobs(ss, t, chunks=chunks)[0]

    def topk(ss, t, chunks):
        return token_topk(
            chunks, ss, t, args.top_k, seq_length=seq, micro_batch_size=args.micro_batch, pad_id=policy.tokenizer.pad_id
        )

    def run_engine() -> tuple[float, float]:
        for s in samples:
            s.teacher = None
        _reset_peak(pid)
        start = time.perf_counter()
        engine.score(samples)
        dt = time.perf_counter() - start
        assert all(s.teacher.error is None and len(s.teacher.logp) == args.response for s in samples)
        return tokens / dt, _rss_kib(pid, "VmHWM") / 1024

    def run_trainer() -> tuple[float, float]:
        for s in samples:
            s.teacher = None
        _reset_peak()
        start = time.perf_counter()
        with torch.no_grad():
            frozen.score(samples, samples, logprobs, topk if args.top_k else None)
        dt = time.perf_counter() - start
        assert all(len(s.teacher.logp) == args.response for s in samples)
        return tokens / dt, (_rss_kib("self", "VmHWM") - rss_before) / 1024

    results: dict[str, list[tuple[float, float]]] = {"engine": [], "in-trainer": []}
    try:
        run_engine(), run_trainer()  # warm-up
        for r in range(args.repeats):
            order = [("engine", run_engine), ("in-trainer", run_trainer)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                results[name].append(fn())
    finally:
        engine.close()

    def stat(name: str, k: int) -> tuple[float, float, float]:
        vals = [v[k] for v in results[name]]
        return statistics.median(vals), min(vals), max(vals)

    n_params = sum(p.numel() for p in frozen.chunks[0].parameters())
    print(
        f"teacher: hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.2f} M parameters; "
        f"{args.samples} samples x ({args.prompt} prompt + {args.response} response) tokens; "
        f"top-k {args.top_k}; {args.threads} thread(s) each; {args.repeats} repeats, alternating"
    )
    print(f"{'':34}{'engine':>24}{'in-trainer':>24}{'engine / in-trainer':>22}")
    for label, k, unit in (("response tokens / s", 0, ""), ("peak memory (MiB)", 1, "")):
        e, t = stat("engine", k), stat("in-trainer", k)
        print(
            f"{label:34}{e[0]:>10.0f} [{e[1]:.0f}-{e[2]:.0f}]{'':>3}{t[0]:>10.0f} [{t[1]:.0f}-{t[2]:.0f}]{'':>3}"
            f"{e[0] / t[0]:>18.2f}x"
        )
    print(
        "(median [min-max]; engine memory: the whole teacher process's peak RSS; in-trainer: the trainer's "
        "peak RSS growth for the frozen copy and its forward)"
    )


if __name__ == "__main__":
    main()
