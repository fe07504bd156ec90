"""The prepared GPU check of speculative decoding (docs/speculative.md), for a session lent one NVIDIA GPU.

    .venv/bin/python tools/gpu_spec_check.py             # the table; CPU: every row says why it is skipped
    .venv/bin/python -m pytest -m gpu tests/test_gpu_spec.py

Rows (each fails soft, as tools/gpu_check.py's, whose helpers it uses; under 5 minutes in all):
  1. the embedded engine on CUDA (bf16, a random Qwen3 checkpoint): greedy tokens with prompt lookup
     and with a layer-skip draft model, fixed k and DSpark's schedule, equal plain decoding's; and
     tokens/s of plain, fixed and dspark at batch 1 and 64 (one round each: a first look, not a figure);
  2. if `sglang` imports: an SGLang server started with the flags `config/speculative.py` makes of
     `rollout.speculative_algorithm: standalone` (the same checkpoint's first layers as the draft) —
     its greedy tokens against a plain SGLang server's on the same prompt.
EAGLE / EAGLE3 and NEXTN need trained drafts or MTP checkpoints that this machine cannot download:
not checked here.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from types import ModuleType, SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def _gpu_check() -> ModuleType:
    """tools/gpu_check.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "tools", "gpu_check.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gc = _gpu_check()


def _layer_skip(model, layers: int):
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    return draft


def _qwen3_checkpoint(path: str, layers: int = 4) -> None:
    """A random stock Qwen3 checkpoint, bf16, without a tokenizer (requests send token ids)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def embedded_on_cuda(ctx) -> str:
    """Row 1: exactness of the speculative engine on CUDA, and a first look at its speed."""
    import torch

    from mcore_rl.config.schema import ModelConfig
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.rollout.engine.core import EngineCore, Request
    from mcore_rl.rollout.engine.sampling import SamplingParams
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings

    torch.manual_seed(0)
    model = McoreRLForCausalLM(
        hf_config_from_model_config(ModelConfig(num_layers=8, hidden_size=512, ffn_hidden_size=1536))
    )
    tok = load_tokenizer(None)
    prompt = list(range(5, 37)) * 2  # repeats: prompt lookup finds something

    def run(batch: int, spec, temperature: float) -> tuple[dict[str, list[int]], float, dict]:
        engine = EngineCore(
            copy.deepcopy(model),
            tok,
            dtype="bfloat16",
            device="cuda",
            max_running_requests=batch,
            context_length=256,
            max_total_tokens=batch * 256,
            speculative=spec,
            draft_model=_layer_skip(model, 1) if spec is not None and spec.algorithm == "STANDALONE" else None,
        )
        for i in range(batch):
            sp = SamplingParams(temperature=temperature, max_new_tokens=48, ignore_eos=True, seed=i)
            engine.add_request(Request(str(i), prompt, sp))
        outs: dict[str, list[int]] = {}
        start = time.perf_counter()
        while engine.has_work():
            for o in engine.step():
                if o.finished:
                    outs[o.rid] = o.output_ids
        return outs, batch * 48 / (time.perf_counter() - start), dict(engine.spec_stats)

    plain, _, _ = run(4, None, 0.0)
    bad = []
    for algo in ("NGRAM", "STANDALONE"):
        for schedule in ("fixed", "dspark"):
            got, _, stats = run(4, SpeculativeSettings(algo, num_steps=4, schedule=schedule), 0.0)
            if got != plain or not stats["verify_passes"]:
                bad.append(f"{algo}/{schedule}")
    speeds = []
    for batch in (1, 64):
        row = [f"plain {run(batch, None, 1.0)[1]:.0f}"]
        for schedule in ("fixed", "dspark"):
            _, rate, stats = run(batch, SpeculativeSettings("STANDALONE", num_steps=4, schedule=schedule), 1.0)
            row.append(f"{schedule} {rate:.0f} (accept {stats['accepted'] / max(1, stats['drafted']):.2f})")
        speeds.append(f"batch {batch}: " + ", ".join(row) + " tok/s")
    verdict = "greedy = plain for ngram and standalone, fixed and dspark" if not bad else f"DIFFER: {bad}"
    return verdict + "; " + "; ".join(speeds)


def sglang_with_our_flags(ctx) -> str:
    """Row 2: SGLang started with config/speculative.py's flags serves plain greedy tokens."""
    if importlib.util.find_spec("sglang") is None:
        raise gc.Skip("sglang is not installed")
    from mcore_rl.config.speculative import sglang_speculative_flags

    path = os.path.join(ctx.workdir, "tiny_qwen3")
    draft_path = os.path.join(ctx.workdir, "tiny_qwen3_draft")
    _qwen3_checkpoint(path)
    _qwen3_checkpoint(draft_path, layers=1)  # a random 1-layer draft of the same vocabulary: the check is the tokens
    rollout = SimpleNamespace(
        speculative_algorithm="standalone",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=None,
        speculative_draft_model_path=draft_path,
    )
    flags = sglang_speculative_flags(rollout)
    ids = list(range(5, 37)) * 2
    results = {}
    for name, extra in (("plain", []), ("speculative", flags)):
        port = gc._free_port()
        proc = subprocess.Popen(
            [PY, "-m", "sglang.launch_server", "--model-path", path, "--port", str(port), "--dtype", "bfloat16"]
            + ["--mem-fraction-static", "0.2", "--skip-tokenizer-init", *extra],
            cwd=REPO,
            env=gc._env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            gc._wait_healthy(url, proc, max(ctx.seconds_left(), 1))
            gc._generate(url, ids, 4)
            results[name] = gc._generate(url, ids, 48)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    (a, _, a_s), (b, _, b_s) = results["plain"], results["speculative"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return (
        f"flags {' '.join(flags)}: greedy tokens agree for {same}/{len(a)}; "
        f"48 tokens in {a_s * 1e3:.0f} ms (plain) vs {b_s * 1e3:.0f} ms (speculative)"
    )


ROWS = [
    gc.Row("embedded engine on CUDA: speculative greedy = plain, tokens/s", embedded_on_cuda),
    gc.Row("SGLang with config/speculative.py's flags: greedy = plain", sglang_with_our_flags),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=int, default=150, help="seconds per server start")
    ap.add_argument("--deadline-s", type=float, default=280, help="seconds for all rows; later rows are skipped")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = gc.Context(tmp, args.timeout, gc._cuda_available(), time.monotonic() + args.deadline_s)
        results = gc.run_rows(ROWS, ctx, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(gc.format_table(results, f"GPU check of speculative decoding on {gc._machine()}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
