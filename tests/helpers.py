"""Helpers shared by several test modules: tiny recipes, spawned engines and judges, reference
batches and layout checks. A test module imports them from here, never from another test module.

Each section names the test module the helpers were written for; their definitions are that
module's, moved here unchanged (names two modules used for different things carry a prefix).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml
import gguf

from mcore_rl.config import (
    ConfigError,
    RLConfig,
    load_config,
    validate_rl_config,
)
from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
from mcore_rl.config.schema import ModelConfig
from mcore_rl.config.schema import ParallelConfig
from mcore_rl.data.prompts import PromptSource, task_pool
from mcore_rl.data.samples import Sample
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.parallel.lifetime import preexec_die_with_parent
from mcore_rl.hf import McoreRLConfig, McoreRLForCausalLM, hf_config_from_model_config
from mcore_rl.rollout.engine.core import EngineCore, Request, RequestOutput
from mcore_rl.rollout.engine.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- from test_rl_loop.py ----------------------------------------------------------------------


# a tiny RL run's model, train, rollout, algorithm, optimizer, eval and logging keys
TINY_RUN = [
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.max_position_embeddings=64",
    "train.num_steps=3",
    "train.seq_length=32",
    "train.micro_batch_size=4",
    "rollout.quantization=fp8",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=4",
    "rollout.context_length=64",
    "algorithm.num_minibatches=2",
    "algorithm.mismatch.name=tis",
    "optimizer.lr=1e-3",
    "optimizer.lr_decay_style=constant",
    "eval.interval=2",
    "eval.num_prompts=4",
    "eval.k=2",
    "logging.progress_bar=false",
    "logging.tensorboard=true",
    "logging.plot=true",
]
TINY = TINY_RUN + [
    "data.synthetic_max_digits=1",
    "data.synthetic_num_prompts=500",
    "init.sft_steps=3",
    "init.sft_num_examples=64",
    "init.sft_seq_length=32",
    "init.sft_micro_batch_size=4",
]


def save_tiny_hf_model(path: str, max_position_embeddings: int) -> str:
    """An HF-format directory at `path`: a 2-layer model (hidden 32) with the byte tokenizer's vocabulary."""
    torch.manual_seed(0)
    mc = ModelConfig(
        vocab_size=384,
        hidden_size=32,
        ffn_hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        max_position_embeddings=max_position_embeddings,
    )
    McoreRLForCausalLM(hf_config_from_model_config(mc)).float().save_pretrained(path, safe_serialization=True)
    return path


def tiny(*overrides: str) -> RLConfig:
    return load_config(RLConfig, None, TINY + list(overrides))


def _samples() -> list[Sample]:
    tok = load_tokenizer(None)
    src = PromptSource(task_pool("addition", 50, 0, 2), tok, seed=0)
    out = []
    for g, p in enumerate(src.take(5)):
        for j in range(3):
            rsp = tok.encode(str(g * 10 + j)[: 1 + j]) + ([tok.eos_id] if j != 1 else [])
            out.append(
                Sample(
                    p,
                    p.index,
                    rsp,
                    [-0.1 * (k + 1) for k in range(len(rsp))],
                    policy_version=7,
                    finish_reason="stop",
                    reward=float(j == 0),
                )
            )
    return out


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---- from test_async_runtime.py ------------------------------------------------------------------


# the engines serve the default model (ModelConfig()), so the trainer's model keeps the defaults
SMALL = [
    "train.num_steps=3",
    "train.seq_length=64",
    "train.micro_batch_size=8",
    "data.synthetic_max_digits=1",
    "data.synthetic_num_prompts=500",
    "rollout.quantization=none",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=12",
    "rollout.request_timeout_s=20",
    "algorithm.num_minibatches=2",
    "algorithm.mismatch.name=tis",
    "optimizer.lr=1e-3",
    "optimizer.lr_decay_style=constant",
    "reward.name=tests.reward_fns:digit_count",
    "eval.interval=0",
    "eval.at_start=false",
    "eval.num_prompts=4",
    "eval.k=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
]


# ---- from test_checkpoint.py ---------------------------------------------------------------------


TINY_SFT = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "train.seq_length=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "data.synthetic_num_examples=64",
    "train.log_interval=1000",
]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _start_trainer(tmp_path, *args: str) -> tuple[subprocess.Popen, str]:
    log = str(tmp_path / "trainer.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mcore_rl.cli", *args], cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT
        )
    return proc, log


def _latest_step(save_dir: str) -> int:
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            return int(f.read().strip().removeprefix("iter_"))
    except (OSError, ValueError):
        return -1


# ---- from test_config.py ----------------------------------------------------------------------


RL_SMALL = [
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.max_position_embeddings=64",
    "train.seq_length=32",
    "data.synthetic_max_digits=1",
    "data.synthetic_num_prompts=500",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=4",
    "rollout.context_length=64",
    "algorithm.num_minibatches=2",
    "eval.num_prompts=4",
    "eval.k=2",
    "init.sft_steps=3",
    "init.sft_seq_length=32",
    "init.sft_micro_batch_size=4",
]


def rl(*overrides: str) -> RLConfig:
    return load_config(RLConfig, None, RL_SMALL + list(overrides))


def rl_errors(cfg: RLConfig, world_size: int = 2) -> list[str]:
    """The lines of the one ConfigError that validation raises."""
    with pytest.raises(ConfigError) as e:
        validate_rl_config(cfg, world_size)
    head, *lines = str(e.value).splitlines()
    assert head == "invalid config:"
    return [line.strip() for line in lines]


# ---- from test_domains.py ----------------------------------------------------------------------


def write_sum_file(path: str, n: int = 60) -> str:
    """2-digit addition prompts (the file domain), one line with its own response budget."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.integers(0, 100, 2)
            line = {"prompt": f"{a:02d}+{b:02d}=", "label": None}
            if i == 0:
                line["max_new_tokens"] = 2
            f.write(json.dumps(line) + "\n")
    return path


def recipe(tmp: str) -> dict:
    """The 2-domain recipe of these tests (configs/domains.yaml has the same shape)."""
    return {
        "data": {
            "domains": [
                {
                    "name": "sum2",
                    "path": write_sum_file(os.path.join(tmp, "sum2.jsonl")),
                    "template": "Q:{prompt}",
                    "rewards": [{"name": "addition"}],
                    "group_size": 4,
                    "weight": 1.0,
                },
                {
                    "name": "fmt",
                    "task": "formatting",
                    "options": {"max_length": 3},
                    "num_prompts": 200,
                    "group_size": 2,
                    "top_k": 20,
                    "max_new_tokens": 3,
                    "weight": 1.0,
                    "eval": {"num_prompts": 3, "seed": 99},
                    "rewards": [
                        {"name": "formatting", "weight": 1.0, "options": {"pattern": "[0-9]{1,3}"}},
                        {"name": "tests.reward_fns:digit_count", "weight": 0.25},
                    ],
                },
            ],
            "mixture": {
                "stages": [
                    {"start_step": 0},
                    {"start_step": 2, "weights": {"fmt": 1.0}, "max_new_tokens": 2, "temperature": 1.2},
                ]
            },
        }
    }


def cfg_of(tmp: str, data: dict, *overrides: str, name: str = "r.yaml") -> RLConfig:
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    # the domains bring their own data, and no SFT warm start
    return load_config(RLConfig, path, TINY_RUN + list(overrides))


def errors_of(cfg: RLConfig) -> str:
    with pytest.raises(ConfigError) as err:
        validate_rl_config(cfg, 1)
    return str(err.value)


# ---- from test_gguf.py ----------------------------------------------------------------------


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


MERGES = ["h e", "l l", "he ll", "Ġ w"]


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for every byte (the alphabet of byte-level BPE)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _gguf_tokens() -> list[str]:
    return SPECIALS + _byte_chars() + [m.replace(" ", "") for m in MERGES]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k (the inverse of what transformers undoes when reading)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(_gguf_tokens()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a wrong norm mapping shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def write_gguf(model, path: str, arch: str = "llama", quantize_ffn: bool = False) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(_gguf_tokens())
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(_gguf_tokens()) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], h))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], kv))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            t = sd[p + f"mlp.{theirs}.weight"]
            if quantize_ffn:
                q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
                w.add_tensor(f"blk.{i}.{ours}.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(f"blk.{i}.{ours}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- from test_judges.py ----------------------------------------------------------------------


class ScriptedJudge:
    """tests/sglang_script_server.py as a process on an ephemeral loopback port."""

    def __init__(self, tmp: pathlib.Path, rules: list, *args: str) -> None:
        self.script = tmp / f"script_{time.monotonic_ns()}.json"
        self.script.write_text(json.dumps(rules))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "sglang_script_server.py"), str(self.script), *args],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_die_with_parent(),
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]  # started with stdout=PIPE, so stdout is set
        assert line.startswith("PORT "), f"the scripted judge did not start: {line!r}"
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def requests(self) -> list[dict]:
        log = pathlib.Path(str(self.script) + ".log")
        return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# ---- from test_optimizer.py ----------------------------------------------------------------------


class Tiny(torch.nn.Module):
    """Matrices (weight-decayed) plus a bias and a norm weight (not decayed)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(6, 5)
        self.norm = torch.nn.LayerNorm(5)
        self.out = torch.nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.fc(x)))


def _backward(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=g)
    loss = model(x.to(next(model.parameters()).dtype)).float().pow(2).sum() * scale
    loss.backward()


# ---- from test_server.py ----------------------------------------------------------------------


CONTEXT = 1024


LONG = 900  # tokens: at least 0.9 s (see `throttled`), long enough to act on a request while it runs


def throttled(core: EngineCore, delay: float = 0.001) -> EngineCore:
    """The real engine, with every step also sleeping `delay` seconds: tests that act on a request
    while it runs (abort, pause, disconnect, weight update) then do not depend on the engine's speed."""
    step = core.step

    def slow_step():
        time.sleep(delay)
        return step()

    core.step = slow_step
    return core


def _core() -> EngineCore:
    return throttled(EngineCore.from_model_path(None, max_running_requests=32, context_length=CONTEXT, random_seed=0))


def _greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- from test_engine_faults.py ------------------------------------------------------------------


ENGINE_FAULTS_CONTEXT = 256


def _engine_main(port: int, ready, delay: float) -> None:
    """An embedded engine server on `port` (each step also sleeps `delay`), until killed."""
    torch.set_num_threads(1)
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.engine.driver import EngineDriver
    from mcore_rl.rollout.server import EngineServer, ServerThread

    core = throttled(
        EngineCore.from_model_path(None, max_running_requests=32, context_length=ENGINE_FAULTS_CONTEXT, random_seed=0),
        delay,
    )
    ServerThread(EngineServer(EngineDriver(core)), port=port, shutdown_timeout=0.5).start()
    ready.set()
    while True:
        time.sleep(3600)


class Engine:
    """One engine process at a fixed URL, so that a restart comes back where the pool expects it."""

    def __init__(self, delay: float = 0.0) -> None:
        self.port, self.delay = _free_port(), delay
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: mp.Process | None = None
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self.proc = ctx.Process(target=_engine_main, args=(self.port, ready, self.delay), daemon=True)
        self.proc.start()
        assert ready.wait(120), "engine did not start"

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.join(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.join(10)


# ---- from test_parity.py ----------------------------------------------------------------------


def P(**kw) -> ParallelConfig:
    names = dict(
        tp="tensor_model_parallel_size",
        pp="pipeline_model_parallel_size",
        vpp="virtual_pipeline_model_parallel_size",
        ep="expert_model_parallel_size",
        sp="sequence_parallel",
        etp="expert_tensor_parallel_size",
    )
    return ParallelConfig(**{names[k]: v for k, v in kw.items()})


DENSE = ModelConfig(arch="qwen3", num_layers=4, hidden_size=64, ffn_hidden_size=128)


SEQ, MBS, NUM_MICROBATCHES = 16, 2, 4


def _global_batch(vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(NUM_MICROBATCHES):
        tokens = torch.randint(0, vocab, (MBS, SEQ + 1), generator=g)
        loss_mask = (torch.rand(MBS, SEQ, generator=g) > 0.25).float()
        batches.append(
            dict(
                tokens=tokens[:, :-1].contiguous(),
                labels=tokens[:, 1:].contiguous(),
                loss_mask=loss_mask,
                position_ids=torch.arange(SEQ).expand(MBS, SEQ).contiguous(),
            )
        )
    return batches


def _check_layout(mc: ModelConfig, pc: ParallelConfig, batches, ref, recompute: str = "none", after=None) -> str:
    """`after(chunks)`, if given, runs once the checks passed (further checks on the same model)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.hf.weight_map import hf_to_megatron
    from mcore_rl.models.shards import gather_full_state_dict, load_full_state_dict
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.forward_backward import forward_backward, prepare_config, wrap_ddp

    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    ref_loss, ref_state, ref_grads = ref
    # megatron-core sizes its per-layer aux-loss log by the first MoE model a process runs; a world
    # that checks models of other depths one after the other starts each with an empty log
    get_moe_layer_wise_logging_tracker().clear()
    layout = init_model_parallel(pc)
    set_seed(1)
    config = transformer_config(mc, pc, recompute=recompute)
    chunks = build_model(mc, pc, config=config)
    load_full_state_dict(chunks, hf_to_megatron(ref_state, mc))
    chunks = wrap_ddp(chunks, config)
    prepare_config(config, chunks)
    per_rank = len(batches) // layout.dp
    dp_rank = ps.get_data_parallel_rank()
    mine = batches[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    result = forward_backward(chunks, mine)

    name = f"{mc.arch} {pc}"
    assert abs(result["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), f"{name}: loss {result['loss']} vs {ref_loss}"
    grads = gather_full_state_dict(chunks, grads=True)
    expected = hf_to_megatron(ref_grads, mc)
    assert set(grads) == set(expected), f"{name}: {sorted(set(grads) ^ set(expected))}"
    for key, want in expected.items():
        got = grads[key]
        scale = float(want.abs().max()) or 1.0
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=2e-6 * scale, msg=lambda m: f"{name} {key}: {m}")
    if after is not None:
        after(chunks)
    return name


def _profile_counts_the_rank(mc: ModelConfig, pc: ParallelConfig, then=None):
    """An `after` for `_check_layout`: `mcore-rl profile`'s tensor list for this rank's layout holds as
    many parameters as the rank's built chunks (TP/EP/ETP/PP shards, MLA's duplicated projections,
    GPT-OSS's sinks and biases); then `then(chunks)`, if given."""

    def check(chunks) -> None:
        from megatron.core import parallel_state as ps

        from mcore_rl.profile.layouts import Layout
        from mcore_rl.profile.memory import param_tensors

        layout = Layout(
            tp=pc.tensor_model_parallel_size,
            pp=pc.pipeline_model_parallel_size,
            vpp=pc.virtual_pipeline_model_parallel_size,
            ep=pc.expert_model_parallel_size,
            etp=pc.expert_tensor_parallel_size,
            sp=pc.sequence_parallel,
        )
        counted = sum(t.numel * t.count for t in param_tensors(mc, layout, ps.get_pipeline_model_parallel_rank()))
        built = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        assert counted == built, f"{mc.arch} {pc}: the profiler counts {counted} parameters, the rank holds {built}"
        if then is not None:
            then(chunks)

    return check


# ---- from test_convert.py ----------------------------------------------------------------------


VOCAB, CONVERT_SEQ = 128, 16


CONVERT_DENSE = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, vocab_size=VOCAB)


MOE = CONVERT_DENSE.replace(arch="qwen3_moe", num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2)


REMOTE_CASES = {
    "shared_expert_no_qk_norm": MOE.replace(
        moe_shared_expert_intermediate_size=48, qk_layernorm=False, moe_norm_topk_prob=False
    ),
    "latent_moe": MOE.replace(
        num_experts=8, moe_router_topk=4, moe_latent_size=16, moe_shared_expert_intermediate_size=48
    ),
    "attn_res_block": CONVERT_DENSE.replace(num_layers=4, attn_res="block", attn_res_num_blocks=2),
    "attn_res_full": CONVERT_DENSE.replace(num_layers=4, attn_res="full"),
    "ngram": CONVERT_DENSE.replace(ngram=NgramEmbeddingConfig(orders=[2, 3], table_size=254, num_slices=2)),
    # Qwen2-style q/k/v biases and gated shared expert, Mistral's window, on a Qwen3-MoE (QK-norm): no stock class
    "qwen2_features": MOE.replace(
        add_qkv_bias=True, moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True, sliding_window=6
    ),
}


# Config fields that are bookkeeping, not the model (may differ after a round trip).
IGNORED_CONFIG_KEYS = {"transformers_version"}


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """Non-trivial norms, a sharp router, and matrices at 1/sqrt(fan-in): with the default
    initializer_range (0.02) the routed experts of a tiny MoE move the logits by ~1e-5, too little
    for an atol-1e-4 comparison to notice a wrong expert path."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.normal_(1.0, 0.2)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.5)
        elif "embed" not in name and "tables" not in name:
            p.normal_(0.0, p.shape[1] ** -0.5)


def _tokens(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, CONVERT_SEQ), generator=torch.Generator().manual_seed(3))


def _load_tensors(path) -> dict[str, torch.Tensor]:
    from mcore_rl.convert import HFCheckpoint

    ckpt = HFCheckpoint(str(path))
    return {k: ckpt[k] for k in ckpt}


def _assert_same_checkpoint(a, b) -> None:
    """Same tensors (bit for bit, same dtype) and the same config.json."""
    ta, tb = _load_tensors(a), _load_tensors(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    diff = {k: (ca.get(k), cb.get(k)) for k in set(ca) | set(cb) - IGNORED_CONFIG_KEYS if ca.get(k) != cb.get(k)}
    assert not diff, diff


def _check_export(case_dir, stock_class: str = None) -> None:
    from transformers import AutoModelForCausalLM

    _assert_same_checkpoint(case_dir / "hf", case_dir / "export")
    model = AutoModelForCausalLM.from_pretrained(case_dir / "export", dtype=torch.float32).eval()
    if stock_class:
        assert type(model).__name__ == stock_class
    x = _tokens(model.config.vocab_size)
    with torch.no_grad():
        logits = model(x).logits
    torch.testing.assert_close(torch.load(case_dir / "megatron_logits.pt"), logits, atol=1e-4, rtol=0)


def _megatron_logits(
    mc: ModelConfig,
    pc,
    ckpt: str,
    tokens: torch.Tensor,
    out: str,
    attention_mask: torch.Tensor = None,
    hf_weights_out: str = None,
) -> None:
    """Forward the converted checkpoint in layout `pc`; the rank with the full logits saves them.
    `attention_mask`: megatron's ([b, 1, s, s], True = masked). `hf_weights_out`: global rank 0 also
    saves the HF-named weights the weight sync (`iter_hf_weights`) gathers in this layout."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.checkpoint import latest_checkpoint, load_checkpoint
    from mcore_rl.train.forward_backward import forward_backward

    init_model_parallel(pc)
    set_seed(1)
    chunks = build_model(mc, pc, config=transformer_config(mc, pc))
    load_checkpoint(latest_checkpoint(ckpt), chunks, None)
    for chunk in chunks:
        chunk.eval()
    got: list[torch.Tensor] = []

    def step(iterator, model):
        batch = next(iterator)
        output = model(batch["tokens"], batch["position_ids"], attention_mask)

        def loss(logits):
            got.append(tensor_parallel.gather_from_tensor_model_parallel_region(logits).detach().clone())
            return logits.sum() * 0, torch.tensor(1), {"lm_loss": torch.zeros(2)}

        return output, loss

    batch = dict(
        tokens=tokens,
        position_ids=torch.arange(CONVERT_SEQ).expand_as(tokens).contiguous(),
        labels=tokens,
        loss_mask=torch.ones_like(tokens, dtype=torch.float),
    )
    with torch.no_grad():
        forward_backward(chunks, [batch], forward_only=True, forward_step=step)
    if got and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(got[0], out)
    if hf_weights_out:
        import torch.distributed as dist

        from mcore_rl.train.weight_sync import iter_hf_weights

        weights = {name: tensor.clone() for name, tensor in iter_hf_weights(chunks, mc)}
        if dist.get_rank() == 0:
            torch.save(weights, hf_weights_out)


def _round_trip_world(rank: int, world_size: int, tmp: str, cases: list) -> None:
    """For each case: HF -> megatron (layout A) -> HF, and megatron logits in layout B."""
    import torch.distributed as dist

    from mcore_rl.convert import hf_to_mcore, mcore_to_hf, model_config_from_hf, read_hf_config

    for name, convert_layout, check_layout in cases:
        src, mcore, export = f"{tmp}/{name}/hf", f"{tmp}/{name}/mcore", f"{tmp}/{name}/export"
        hf_to_mcore(src, mcore, convert_layout)
        mcore_to_hf(mcore, export)
        mc = model_config_from_hf(read_hf_config(src))
        _megatron_logits(mc, check_layout, mcore, _tokens(mc.vocab_size), f"{tmp}/{name}/megatron_logits.pt")
        dist.barrier()


# ---- from test_logprobs.py ----------------------------------------------------------------------


CHUNK = 5  # 32 tokens per micro-batch: uneven chunks


TEMPERATURE = 0.8


def _batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    batches = _global_batch(vocab)
    for b in batches:  # per-token coefficients, so that both outputs get non-trivial gradients
        b["coef_lp"] = torch.randn(MBS, SEQ, generator=g)
        b["coef_ent"] = torch.randn(MBS, SEQ, generator=g)
    return batches


def _inputs(n: int = 13, h: int = 5, vocab: int = 11, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, h, generator=g, dtype=dtype).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (n,), generator=g)


def _loss(batch, stats):
    mask = batch["loss_mask"]
    loss = (mask * (batch["coef_lp"] * stats.logprobs + batch["coef_ent"] * stats.entropy)).sum()
    report = {
        "lm_loss": torch.stack([loss.detach(), mask.sum()]),
        "logprobs": stats.logprobs.detach(),
        "entropy": stats.entropy.detach(),
    }
    return loss, mask.sum().to(torch.int), report


def _naive(hidden: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, temperature: float = 1.0):
    logsm = ((hidden @ weight.t()) / temperature).log_softmax(-1)
    return logsm.gather(1, y[:, None]).squeeze(1), -(logsm.exp() * logsm).sum(-1)


# ---- moved from test_engine_core.py (shared with other test modules) ----

TOK = load_tokenizer(None)


def tiny_model(seed: int = 0, **kw) -> McoreRLForCausalLM:
    base = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    base.update(kw)
    torch.manual_seed(seed)
    # A larger init than the default 0.02 gives peaked, input-dependent distributions, so that
    # greedy/sampled tokens actually exercise the model rather than near-uniform noise.
    return McoreRLForCausalLM(McoreRLConfig(initializer_range=0.2, **base))


def make_engine(model=None, **kw) -> EngineCore:
    kw.setdefault("context_length", 256)
    return EngineCore(model if model is not None else tiny_model(), TOK, **kw)


def run(engine: EngineCore, reqs: list[Request], stagger: int = 0) -> dict[str, RequestOutput]:
    """Run to completion; with stagger > 0, add one request every `stagger` steps (joins mid-batch)."""
    finals: dict[str, RequestOutput] = {}
    pending = list(reqs)
    steps = 0
    if not stagger:
        for r in pending:
            engine.add_request(r)
        pending = []
    while pending or engine.has_work():
        if pending and steps % stagger == 0:
            engine.add_request(pending.pop(0))
        for out in engine.step():
            if out.finished:
                assert out.rid not in finals, f"{out.rid} finished twice"
                finals[out.rid] = out
        steps += 1
    return finals


def req(rid: str, prompt, logprobs: bool = True, **sp) -> Request:
    ids = TOK.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return Request(rid, ids, SamplingParams(**sp), return_logprob=logprobs, top_logprobs_num=3 if logprobs else 0)


@torch.no_grad()
def ref_logprobs(model: McoreRLForCausalLM, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from one full forward of the reference model (no cache)."""
    logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


PROMPTS = ["hello", "the quick brown fox", "1+1=", "a much longer prompt, to make rows of different lengths"]


def lps(pairs) -> torch.Tensor:
    return torch.tensor([lp for lp, _ in pairs])


def assert_matches_reference(ref, reqs: list[Request], outs: dict[str, RequestOutput], atol: float = 1e-5) -> None:
    """Every generated token's log-prob equals one full (cache-free) forward of the reference model."""
    for r in reqs:
        o = outs[r.rid]
        assert [t for _, t in o.output_token_logprobs] == o.output_ids
        expected = ref_logprobs(ref, r.input_ids + o.output_ids)[len(r.input_ids) - 1 :]
        torch.testing.assert_close(lps(o.output_token_logprobs), expected, atol=atol, rtol=0)


# ---- moved from test_parity.py (shared with other test modules) ----


def _parity_reference(mc: ModelConfig, batches: list[dict[str, torch.Tensor]]):
    """Loss and HF-named gradients of the objective megatron-core optimises (see below)."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    torch.manual_seed(1234)
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).float()
    with torch.no_grad():  # non-trivial norm weights so their gradients are tested too
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    total_tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    objective, lm_sum = 0.0, 0.0
    for b in batches:
        out = model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"], loss_mask=b["loss_mask"])
        n = float(b["loss_mask"].sum())
        lm_sum = lm_sum + out.loss.detach() * n
        # megatron-core (calculate_per_token_loss): token-summed LM loss over the global token
        # count, plus each micro-batch's aux loss weighted by its token count over the same count.
        objective = objective + (out.loss * n + out.aux_loss * b["tokens"].numel()) / total_tokens
    objective.backward()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if mc.tie_word_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return float(lm_sum) / total_tokens, state, grads


def _layouts_world(rank: int, world_size: int, cases: list[tuple[ModelConfig, ParallelConfig]]) -> None:
    batches = {}
    refs = {}
    for mc, pc in cases:
        key = repr(mc)
        if key not in refs:
            batches[key] = _global_batch(mc.vocab_size)
            refs[key] = _parity_reference(mc, batches[key])
        _check_layout(mc, pc, batches[key], refs[key])


# ---- moved from test_convert.py (shared with other test modules) ----


def _reference_state(mc: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    torch.manual_seed(seed)
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).float()
    _randomize(model)
    state = model.state_dict()
    if mc.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


# ---- moved from test_logprobs.py (shared with other test modules) ----


def _logprob_reference(mc, batches):
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    torch.manual_seed(1234)
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    total = sum(float(b["loss_mask"].sum()) for b in batches)
    objective, stats = 0.0, []
    for b in batches:
        logits = model(b["tokens"], position_ids=b["position_ids"]).logits / TEMPERATURE
        logsm = logits.float().log_softmax(-1)
        lp = logsm.gather(-1, b["labels"][..., None]).squeeze(-1)
        ent = -(logsm.exp() * logsm).sum(-1)
        objective = objective + (b["loss_mask"] * (b["coef_lp"] * lp + b["coef_ent"] * ent)).sum() / total
        stats.append((lp.detach(), ent.detach()))
    objective.backward()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if mc.tie_word_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return float(objective.detach()), stats, state, grads


# ---- moved from test_engine_faults.py (shared with other test modules) ----


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.config.schema import ModelConfig

    torch.manual_seed(seed)
    return list(McoreRLForCausalLM(hf_config_from_model_config(ModelConfig())).state_dict().items())


# ---- moved from test_async_resume.py (shared with other test modules) ----


def _finish(p: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:  # timed out: leave no trainer behind
            p.kill()
            p.communicate()
    assert p.returncode == 0, out[-3000:]
    return out


def _kill_after_checkpoint(p: subprocess.Popen, save_dir: str, iteration: int, timeout: float = 300) -> None:
    latest = os.path.join(save_dir, "latest")
    end = time.monotonic() + timeout
    while True:
        if p.poll() is not None or time.monotonic() > end:
            p.kill()
            out, _ = p.communicate()
            raise AssertionError(f"no step-{iteration} checkpoint while the run was alive:\n{out[-3000:]}")
        if os.path.exists(latest) and open(latest).read().strip().endswith(f"{iteration:07d}"):
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)
