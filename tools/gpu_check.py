"""The prepared GPU check: one table of what only a GPU can show, for a session lent one NVIDIA GPU.

    bash tools/gpu_check.sh                 # installs from the project's files, then runs this
    .venv/bin/python tools/gpu_check.py     # the rows alone (CPU: every GPU row says why it is skipped)

Rows (each fails soft: its own error or "skipped: <why>" in the table, never a crash of the check):
  1. the transformer-engine spec vs the reference model (TP=1), fp32 and bf16: logits' max |diff|;
  2. a bf16 training step of a ~1B dense and of a small MoE model: tokens/s and MFU per device
     (`mcore-rl sft`'s perf/* metrics, median over the steps after the warm-up);
  3. the NCCL weight sync vs a raw NCCL broadcast of the same bytes (needs 2 GPUs: NCCL does not
     run two ranks of one group on one device);
  4. the FP8 embedded engine's mismatch K3 against the trainer (`mcore-rl parity`);
  5. if `sglang` imports: the same greedy `/generate` against a real SGLang server and against the
     embedded engine (`mcore-rl serve`) on the same checkpoint, side by side.
Each row has a time limit, so the whole check stays under 8 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from dataclasses import dataclass
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


class Skip(Exception):
    """A row that cannot run here; its message is the reason."""


@dataclass
class Row:
    name: str
    run: Callable[[Context], str]
    needs_cuda: bool = True


@dataclass
class Context:
    workdir: str
    timeout_s: int  # per subprocess, at most (less when the deadline is nearer)
    cuda: bool
    deadline: float = float("inf")  # time.monotonic() by which every row must be done

    def seconds_left(self) -> int:
        return int(min(self.timeout_s, self.deadline - time.monotonic()))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        MCORE_RL_PROGRESS="0",
        PYTHONWARNINGS="ignore",
    )


def _run(args: list[str], ctx: Context, what: str) -> subprocess.CompletedProcess:
    try:
        limit = max(ctx.seconds_left(), 1)
        out = subprocess.run(args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{what}: no result within {limit} s") from err
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{what} exited {out.returncode}: {' / '.join(tail)}")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ 1. TE spec vs reference


def _init_one_rank() -> None:
    from mcore_rl.config import ParallelConfig
    from mcore_rl.parallel import setup

    setup.init_distributed()
    setup.init_model_parallel(ParallelConfig())


def te_parity(precision: str, arch: str = "dense") -> Callable[[Context], str]:
    """The TE spec against the reference model; `arch` "gpt_oss": GPT-OSS's sinks (TE >= 2.8),
    windowed and full layers, biases, the clamped SwiGLU and YaRN."""

    def run(ctx: Context) -> str:
        if importlib.util.find_spec("transformer_engine") is None:
            raise Skip("transformer_engine is not importable (pip install '.[gpu]')")
        if arch == "gpt_oss":
            from megatron.core.utils import is_te_min_version

            if not is_te_min_version("2.8.0"):
                raise Skip("transformer-engine < 2.8 has no attention sinks")
        import torch

        from mcore_rl.config import ModelConfig, ParallelConfig
        from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
        from mcore_rl.models.builder import build_model, transformer_config
        from mcore_rl.parallel.setup import set_seed
        from mcore_rl.train.weight_sync import iter_hf_weights

        _init_one_rank()
        set_seed(1)
        mc = ModelConfig(
            vocab_size=1024,
            hidden_size=256,
            ffn_hidden_size=704,
            num_layers=4,
            num_attention_heads=8,
            num_query_groups=4,
            max_position_embeddings=512,
        )
        if arch == "gpt_oss":
            from mcore_rl.config.schema import RopeScalingConfig

            mc = ModelConfig.of(
                arch="gpt_oss",
                vocab_size=1024,
                hidden_size=256,
                ffn_hidden_size=256,
                num_layers=4,
                num_attention_heads=8,
                num_query_groups=4,
                kv_channels=64,
                max_position_embeddings=512,
                qk_layernorm=False,
                num_experts=4,
                moe_router_topk=2,
                moe_ffn_hidden_size=256,
                sliding_window=32,
                sliding_window_pattern=[1, 0, 1, 0],
                rope_scaling=RopeScalingConfig(
                    type="yarn", factor=4.0, original_max_position_embeddings=128, truncate=False
                ),
                attention_sinks=True,
                linear_biases=True,
                swiglu_limit=7.0,
                init_method_std=0.1,
            )
        pc = ParallelConfig()
        chunks = build_model(mc, pc, config=transformer_config(mc, pc, precision, "none"))
        model = chunks[0].eval()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        ref = McoreRLForCausalLM(hf_config_from_model_config(mc)).cuda().eval()
        ref.load_state_dict({k: v.float() for k, v in iter_hf_weights(chunks, mc)}, strict=True)
        ref = ref.to(dtype)
        gen = torch.Generator("cuda").manual_seed(0)
        tokens = torch.randint(0, mc.vocab_size, (2, 128), device="cuda", generator=gen)
        positions = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
        with torch.no_grad():
            got = model(tokens, positions, None).float()
            want = ref(input_ids=tokens).logits.float()
        diff = (got - want).abs()
        return (
            f"max |Δlogit| {diff.max().item():.2e}, mean {diff.mean().item():.2e} "
            f"(logits' std {want.std().item():.2f}; 4 layers, 2x128 tokens)"
        )

    return run


# ------------------------------------------------------------------ 2. bf16 training steps

DENSE_1B = [
    "model.vocab_size=32768",
    "model.hidden_size=2048",
    "model.ffn_hidden_size=5632",
    "model.num_layers=16",
    "model.num_attention_heads=16",
    "model.num_query_groups=8",
    "model.max_position_embeddings=2048",
]
SMALL_MOE = [
    "model.arch=qwen3_moe",
    "model.vocab_size=32768",
    "model.hidden_size=1024",
    "model.ffn_hidden_size=2816",
    "model.num_layers=8",
    "model.num_attention_heads=16",
    "model.num_query_groups=4",
    "model.num_experts=16",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=704",
    "model.max_position_embeddings=2048",
]


def train_step(model: list[str], label: str) -> Callable[[Context], str]:
    def run(ctx: Context) -> str:
        run_dir = os.path.join(ctx.workdir, f"sft_{label}")
        _run(
            [
                PY,
                "-m",
                "mcore_rl.cli",
                "sft",
                *model,
                f"run_dir={run_dir}",
                "train.precision=bf16",
                "train.seq_length=2048",
                "train.micro_batch_size=4",
                "train.global_batch_size=16",
                "train.train_iters=8",
                "train.eval_interval=0",
                "train.log_interval=4",
                "data.synthetic_num_examples=30000",
            ],
            ctx,
            "mcore-rl sft",
        )
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f][3:]  # after the warm-up steps
        tps = statistics.median(r["perf/tokens_per_s_per_device"] for r in records)
        mfu = statistics.median(r["perf/mfu"] for r in records)
        return f"{tps:,.0f} tokens/s per device, MFU {mfu:.1%} (bf16, seq 2048, 16x2048 tokens/step, median of 5 steps)"

    return run


# ------------------------------------------------------------------ 3. NCCL weight sync


def nccl_weight_sync(ctx: Context) -> str:
    import torch

    if torch.cuda.device_count() < 2:
        raise Skip(
            f"needs 2 GPUs ({torch.cuda.device_count()} visible): NCCL puts no two ranks of a group on one device"
        )
    out = _run(
        [PY, "benchmarks/bench_weight_sync.py", "--repeats", "2", "--only", "broadcast"], ctx, "bench_weight_sync"
    )
    lines = [line for line in out.stdout.splitlines() if "broadcast" in line]
    return " / ".join(" ".join(line.split()) for line in lines) or out.stdout.strip().splitlines()[-1]


# ------------------------------------------------------------------ 4. FP8 mismatch


def fp8_mismatch(ctx: Context) -> str:
    path = os.path.join(ctx.workdir, "parity.json")
    _run(
        [
            PY,
            "-m",
            "mcore_rl.cli",
            "parity",
            "configs/demo.yaml",
            "init.sft_steps=100",
            "--precisions",
            "none",
            "fp8",
            "--no-layers",
            "--prompts",
            "8",
            "--samples",
            "2",
            "--json",
            path,
        ],
        ctx,
        "mcore-rl parity",
    )
    with open(path) as f:
        engines = json.load(f)["engines"]
    return "; ".join(f"{e['engine']}: K3 {e['k3']:.2e}, mean |d| {e['mean_abs']:.2e}" for e in engines)


# ------------------------------------------------------------------ 4b. the RL demo on the GPU


def rl_demo(runtime: str) -> Callable[[Context], str]:
    """The README's demo end to end on the GPU (trainer and embedded engine on one device)."""

    def run(ctx: Context) -> str:
        run_dir = os.path.join(ctx.workdir, f"demo_{runtime}")
        extra = ["rollout.runtime=async", "rollout.max_staleness=1"] if runtime == "async" else []
        start = time.monotonic()
        _run(
            [PY, "-m", "mcore_rl.cli", "train", "configs/demo.yaml", f"run_dir={run_dir}", *extra],
            ctx,
            "mcore-rl train",
        )
        seconds = time.monotonic() - start
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            evals = [r for r in map(json.loads, f) if "eval/avg@4" in r]
        return (
            f"held-out avg@4 {evals[0]['eval/avg@4']:.1%} -> {evals[-1]['eval/avg@4']:.1%}, "
            f"greedy {evals[0]['eval/greedy_pass@1']:.1%} -> {evals[-1]['eval/greedy_pass@1']:.1%} "
            f"({seconds:.0f} s with start-up)"
        )

    return run


# ------------------------------------------------------------------ 5. SGLang vs embedded


def _wait_healthy(url: str, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url}: not healthy within {seconds:.0f} s")


def _generate(url: str, ids: list[int], new_tokens: int) -> tuple[list[int], list[float], float]:
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    seconds = time.perf_counter() - start
    logprobs = out["meta_info"]["output_token_logprobs"]
    return [int(t[1]) for t in logprobs], [float(t[0]) for t in logprobs], seconds


def _tiny_checkpoint(path: str) -> None:
    """A random Qwen3 checkpoint in the stock `transformers` format, with a byte-level tokenizer in
    the stock `tokenizer.json` format (SGLang loads it with `AutoTokenizer`; the project's own
    `mcore_rl_tokenizer.json` is not a `tokenizers` file)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    # one token per byte (ByteLevel's 256 printable stand-ins), no merges, then the specials
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    hf.save_pretrained(path)


def sglang_vs_embedded(ctx: Context) -> str:
    if importlib.util.find_spec("sglang") is None:
        raise Skip("sglang is not installed (pip install sglang did not succeed here)")
    path = os.path.join(ctx.workdir, "tiny_qwen3")
    _tiny_checkpoint(path)
    servers = {
        "sglang": [PY, "-m", "sglang.launch_server", "--mem-fraction-static", "0.2"],
        "embedded": [PY, "-m", "mcore_rl.cli", "serve"],
    }
    procs, results = [], {}
    ids = list(range(5, 69))
    try:
        for name, cmd in servers.items():
            port = _free_port()
            proc = subprocess.Popen(
                [*cmd, "--model-path", path, "--port", str(port), "--dtype", "bfloat16"],
                cwd=REPO,
                env=_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, proc, max(ctx.seconds_left(), 1))
            _generate(url, ids, 4)  # warm-up
            results[name] = _generate(url, ids, 32)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    (a_tok, a_lp, a_s), (b_tok, b_lp, b_s) = results["sglang"], results["embedded"]
    same = next((i for i, (x, y) in enumerate(zip(a_tok, b_tok)) if x != y), len(a_tok))
    dlp = statistics.mean(abs(x - y) for x, y in zip(a_lp[:same], b_lp[:same])) if same else float("nan")
    return (
        f"greedy tokens agree for {same}/{len(a_tok)}, mean |Δlogprob| {dlp:.2e} over them; "
        f"32 tokens in {a_s * 1e3:.0f} ms (SGLang) vs {b_s * 1e3:.0f} ms (embedded)"
    )


ROWS = [
    Row("TE spec vs reference, fp32 (TP=1)", te_parity("fp32")),
    Row("TE spec vs reference, bf16 (TP=1)", te_parity("bf16")),
    Row("TE spec vs reference, GPT-OSS sinks, fp32 (TP=1)", te_parity("fp32", "gpt_oss")),
    Row("bf16 train step, ~1B dense", train_step(DENSE_1B, "dense_1b")),
    Row("bf16 train step, small MoE (16 experts, top-2)", train_step(SMALL_MOE, "moe")),
    Row("NCCL weight sync vs raw NCCL broadcast", nccl_weight_sync),
    Row("FP8 engine mismatch K3 (mcore-rl parity)", fp8_mismatch),
    Row("RL demo, synchronous (configs/demo.yaml)", rl_demo("sync")),
    Row("RL demo, asynchronous (max_staleness 1)", rl_demo("async")),
    Row("SGLang server vs embedded engine, /generate", sglang_vs_embedded),
]


def run_rows(rows: list[Row], ctx: Context, log: Callable[[str], None] | None = None) -> list[tuple[str, str]]:
    """(name, result) per row; a row that raises gets its error as its result."""
    results = []
    for row in rows:
        start = time.perf_counter()
        try:
            if row.needs_cuda and not ctx.cuda:
                raise Skip("no CUDA device")
            if ctx.seconds_left() < 20:
                raise Skip("out of time (the check's budget is spent)")
            result = row.run(ctx)
        except Skip as why:
            result = f"skipped: {why}"
        except Exception as err:
            if log is not None:
                log(traceback.format_exc())
            result = f"error: {type(err).__name__}: {err}"
        results.append((row.name, f"{result} [{time.perf_counter() - start:.0f} s]"))
        if log is not None:
            log(f"{row.name}: {results[-1][1]}")
    return results


def format_table(results: list[tuple[str, str]], header: str) -> str:
    lines = [header, "", "| check | result |", "| --- | --- |"]
    lines += [f"| {name} | {result.replace('|', '/')} |" for name, result in results]
    return "\n".join(lines)


def _machine() -> str:
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        return f"{gpu}, torch {torch.__version__}, {os.cpu_count()} CPUs"
    except Exception as err:
        return f"torch not importable ({err})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=int, default=150, help="seconds per subprocess of a row")
    ap.add_argument("--only", default="", help="run only the rows whose name contains this")
    ap.add_argument("--workdir", default="", help="where rows write (default: a temporary directory)")
    ap.add_argument("--deadline-s", type=float, default=450, help="seconds for all rows; later rows are skipped")
    args = ap.parse_args()
    rows = [r for r in ROWS if args.only.lower() in r.name.lower()]
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(args.workdir or tmp, args.timeout, _cuda_available(), time.monotonic() + args.deadline_s)
        results = run_rows(rows, ctx, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(results, f"GPU check on {_machine()}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
