"""`mcore-rl convert`: Hugging Face <-> megatron-core checkpoints.

Tiny stock checkpoints (Qwen3, Qwen3-MoE, Llama; random init, `save_pretrained`) go to megatron in one
layout and back; the round trip must be bit-exact, and the exported model's logits (loaded with
`AutoModelForCausalLM`) must match the megatron model's in another layout (fp32, atol 1e-4).
Models that stock `transformers` cannot express export as our remote-code model, which must load
with `trust_remote_code=True` in a process where neither `mcore_rl` nor megatron-core can be imported
(tests/test_remote_code.py checks every remote-code module that way too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
from mcore_rl.config.schema import ModelConfig
from tests.helpers import (
    _reference_state,
    CONVERT_DENSE as DENSE,
    MOE,
    REMOTE_CASES,
    VOCAB,
    _assert_same_checkpoint,
    _check_export,
    _load_tensors,
    _randomize,
    _round_trip_world,
    _tokens,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# tiny stock checkpoints
# ---------------------------------------------------------------------------------------------


def _stock_config(kind: str, vocab: int = VOCAB, tie: bool = False):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=50000.0,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "qwen3":
        return Qwen3Config(**common)
    if kind == "llama":
        return LlamaConfig(**common)
    return Qwen3MoeConfig(
        **common,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        router_aux_loss_coef=0.01,
    )


def _save_stock(kind: str, path, dtype=torch.float32, tie: bool = False, vocab: int = VOCAB, seed: int = 0) -> None:
    """A random stock checkpoint, weights scaled so that every path moves the logits (`_randomize`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_stock_config(kind, vocab, tie))
    _randomize(model)
    model.to(dtype).save_pretrained(path)


# ---------------------------------------------------------------------------------------------
# configs and export kinds (no megatron)
# ---------------------------------------------------------------------------------------------


def test_model_configs_of_stock_checkpoints() -> None:
    from mcore_rl.convert import model_config_from_hf

    qwen3 = model_config_from_hf(_stock_config("qwen3"))
    llama = model_config_from_hf(_stock_config("llama", tie=True))
    moe = model_config_from_hf(_stock_config("qwen3_moe"))
    assert (qwen3.arch, qwen3.qk_layernorm, qwen3.head_dim, qwen3.rotary_base) == ("qwen3", True, 16, 50000.0)
    assert (llama.arch, llama.qk_layernorm, llama.tie_word_embeddings) == ("qwen3", False, True)
    assert (
        moe.arch,
        moe.section(MoEKeys).num_experts,
        moe.section(MoEKeys).moe_router_topk,
        moe.section(MoEKeys).moe_ffn_hidden_size,
    ) == ("qwen3_moe", 4, 2, 32)
    assert moe.section(MoEKeys).moe_norm_topk_prob is False and moe.section(MoEKeys).moe_aux_loss_coeff == 0.01


def test_reference_without_qk_norm_is_stock_llama() -> None:
    """The reference model (embedded engine, remote-code export) runs Llama checkpoints too."""
    from transformers import LlamaForCausalLM

    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config, to_stock_hf_config
    from mcore_rl.convert import model_config_from_hf

    torch.manual_seed(0)
    stock = LlamaForCausalLM(_stock_config("llama")).eval()
    cfg = hf_config_from_model_config(model_config_from_hf(stock.config))
    assert cfg.use_qk_norm is False and type(to_stock_hf_config(cfg)).__name__ == "LlamaConfig"
    ref = McoreRLForCausalLM(cfg).eval()
    ref.load_state_dict(stock.state_dict(), strict=True)  # same names, no q_norm / k_norm
    with torch.no_grad():
        torch.testing.assert_close(ref(_tokens()).logits, stock(_tokens()).logits, atol=1e-5, rtol=0)


def test_unsupported_checkpoints_name_the_field() -> None:
    from transformers import LlamaConfig

    from mcore_rl.convert import model_config_from_hf

    scaled = LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0})
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        model_config_from_hf(scaled)
    with pytest.raises(ValueError, match="attention_bias=true"):
        model_config_from_hf(LlamaConfig(attention_bias=True))
    # mixed dense/MoE layers (mlp_only_layers) convert now: tests/test_deepseek_v3.py
    from transformers import DeepseekV3Config

    with pytest.raises(ValueError, match="n_shared_experts=0"):  # norm_topk_prob=false converts now
        model_config_from_hf(DeepseekV3Config(n_shared_experts=0))


@pytest.mark.parametrize(
    "mc, kind",
    [
        (DENSE, "qwen3"),
        (dataclasses.replace(DENSE, qk_layernorm=False), "llama"),
        (MOE, "qwen3_moe"),
        (MOE.replace(moe_shared_expert_intermediate_size=48), "remote"),
        (dataclasses.replace(MOE, qk_layernorm=False), "remote"),
        (MOE.replace(moe_latent_size=16), "remote"),
        (DENSE.replace(attn_res="block", attn_res_num_blocks=2), "remote"),
        (DENSE.replace(ngram=NgramEmbeddingConfig(orders=[2], table_size=97)), "remote"),
    ],
    ids=["qwen3", "llama", "qwen3_moe", "shared_expert", "moe_no_qk_norm", "latent_moe", "attn_res", "ngram"],
)
def test_export_kind(mc: ModelConfig, kind: str) -> None:
    from mcore_rl.convert import export_kind

    assert export_kind(mc) == kind


def test_remote_code_files_need_no_mcore_rl() -> None:
    """The shipped files are the relative-import closure transformers itself will follow."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from mcore_rl.convert import remote_code_files

    files = remote_code_files()  # raises if a file imports mcore_rl where transformers checks
    names = {os.path.basename(f) for f in files}
    assert {"configuration.py", "modeling.py"} <= names
    modeling = next(f for f in files if f.endswith("modeling.py"))
    assert {os.path.basename(f) for f in get_relative_import_files(modeling)} <= names


def test_sharded_safetensors_read_lazily(tmp_path) -> None:
    from mcore_rl.convert import HFCheckpoint, save_safetensors

    tensors = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(8, 4) for i in range(3)}
    tensors["model.embed_tokens.weight"] = torch.randn(16, 4).bfloat16()
    files = save_safetensors(tensors, str(tmp_path), max_shard_bytes=200)
    assert "model.safetensors.index.json" in files and len(files) == 5
    ckpt = HFCheckpoint(str(tmp_path), wanted=lambda name: ".layers.1." in name)
    assert set(ckpt) == set(tensors) and ckpt.dtype() == torch.bfloat16
    assert torch.equal(ckpt["model.layers.1.mlp.down_proj.weight"], tensors["model.layers.1.mlp.down_proj.weight"])
    lazy = ckpt["model.layers.2.mlp.down_proj.weight"]
    assert lazy.is_meta and lazy.shape == (8, 4)
    with pytest.raises(KeyError, match="no tensor"):
        ckpt["lm_head.weight"]


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_rejects_bad_input_before_any_worker(tmp_path, capsys) -> None:
    from mcore_rl.cli import main

    assert main(["convert", "hf-to-mcore", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err
    _stock_config("qwen3").save_pretrained(tmp_path / "q")
    assert (
        main(["convert", "hf-to-mcore", "--input", str(tmp_path / "q"), "--output", str(tmp_path / "o"), "--tp", "3"])
        == 2
    )
    err = capsys.readouterr().err
    assert "--tp 3" in err and "model.num_attention_heads" in err
    assert main(["convert", "hf-to-mcore", "--input", str(tmp_path / "q"), "--output", str(tmp_path / "o")]) == 2
    assert "no model.safetensors" in capsys.readouterr().err
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["convert", "hf-to-mcore", "--input", str(tmp_path / "g"), "--output", str(tmp_path / "o")]) == 2
    assert "model_type 'gpt2' is not supported" in capsys.readouterr().err
    assert main(["convert", "mcore-to-hf", "--input", str(tmp_path / "q"), "--output", str(tmp_path / "o")]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# remote-code export, loaded where mcore_rl cannot be imported
# ---------------------------------------------------------------------------------------------

# Runs in a fresh interpreter outside the repo, with every `mcore_rl` and `megatron` import failing
# as if the packages were not installed; loads the export with trust_remote_code, saves its logits.
_LOAD_WITHOUT_MCORE_RL = textwrap.dedent(
    """
    import importlib.abc, sys
    class _NoMcoreRL(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("mcore_rl", "megatron"):
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, _NoMcoreRL())
    import torch
    from transformers import AutoModelForCausalLM
    export, tokens, out = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "McoreRLForCausalLM", type(model)
    assert not [m for m in sys.modules if m.split(".")[0] in ("mcore_rl", "megatron")]
    with torch.no_grad():
        torch.save(model(torch.load(tokens)).logits, out)
    """
)


def _remote_logits(export, tokens: torch.Tensor, tmp_path) -> torch.Tensor:
    torch.save(tokens, tmp_path / "tokens.pt")
    env = dict(
        os.environ,
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
        PYTHONPATH="",
    )
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD_WITHOUT_MCORE_RL,
            str(export),
            str(tmp_path / "tokens.pt"),
            str(tmp_path / "logits.pt"),
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(tmp_path / "logits.pt")


# the HF config field that shows the reference model knows the architecture yet
_REFERENCE_FIELD = {
    "latent_moe": "moe_latent_size",
    "attn_res_block": "attn_res",
    "attn_res_full": "attn_res",
    "ngram": "ngram_orders",
    "qwen2_features": "shared_expert_gate",
}


def _reference_supports(case: str) -> bool:
    from mcore_rl.hf import hf_config_from_model_config

    field = _REFERENCE_FIELD.get(case)
    return not field or hasattr(hf_config_from_model_config(REMOTE_CASES[case]), field)


@pytest.mark.slow
def test_remote_code_export_loads_without_mcore_rl(tmp_path) -> None:
    """Export from HF-named weights (no megatron): config, auto_map, code files, logits."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.convert import write_hf_checkpoint

    mc = REMOTE_CASES["shared_expert_no_qk_norm"]
    state = _reference_state(mc)
    assert write_hf_checkpoint(state, mc, str(tmp_path / "export")) == "remote"
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "mcore_rl" and config["use_qk_norm"] is False
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling.McoreRLForCausalLM"
    assert config["auto_map"]["AutoModel"] == "modeling.McoreRLModel"
    assert (tmp_path / "export" / "modeling.py").exists()
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).eval()
    model.load_state_dict(state)
    x = _tokens()
    with torch.no_grad():
        want = model(x).logits
    torch.testing.assert_close(_remote_logits(tmp_path / "export", x, tmp_path), want, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# through megatron: round trips and logits in other layouts
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stock_checkpoints_round_trip_and_logits(tmp_path) -> None:
    from mcore_rl.convert import parallel_config as P

    _save_stock("qwen3", tmp_path / "qwen3" / "hf")
    _save_stock("qwen3_moe", tmp_path / "qwen3_moe" / "hf")
    _save_stock("llama", tmp_path / "llama" / "hf", dtype=torch.bfloat16, tie=True)
    cases = [
        ("qwen3", P(tp=2), P(pp=2)),
        ("qwen3_moe", P(ep=2), P(tp=2)),  # TP=2 with sequence parallelism
        ("llama", P(pp=2), P(tp=2)),  # bf16 source, tied embeddings split over two stages
    ]
    from tests.world import run_world

    run_world(2, _round_trip_world, str(tmp_path), cases)
    _check_export(tmp_path / "qwen3", "Qwen3ForCausalLM")
    _check_export(tmp_path / "qwen3_moe", "Qwen3MoeForCausalLM")
    _check_export(tmp_path / "llama", "LlamaForCausalLM")
    recipe = (tmp_path / "llama" / "mcore" / "recipe.yaml").read_text()
    assert "qk_layernorm: false" in recipe and "tie_word_embeddings: true" in recipe
    assert (tmp_path / "llama" / "export" / "generation_config.json").exists()  # assets came along


@pytest.mark.slow
def test_remote_code_architectures_round_trip_and_logits(tmp_path) -> None:
    """Our remote-code checkpoints -> megatron (EP=2 / TP=2) -> remote-code checkpoint; logits in
    another layout (TP=2 / PP=2) equal those of the export loaded without mcore_rl. One world for all."""
    from mcore_rl.convert import parallel_config as P
    from mcore_rl.convert import write_hf_checkpoint
    from tests.world import run_world

    cases = [case for case in REMOTE_CASES if _reference_supports(case)]
    assert "shared_expert_no_qk_norm" in cases
    layouts = []
    for case in cases:
        mc = REMOTE_CASES[case]
        assert write_hf_checkpoint(_reference_state(mc), mc, str(tmp_path / case / "hf")) == "remote"
        layouts.append((case, *((P(ep=2), P(tp=2)) if mc.is_moe else (P(tp=2), P(pp=2)))))
    run_world(2, _round_trip_world, str(tmp_path), layouts)
    for case in cases:
        _assert_same_checkpoint(tmp_path / case / "hf", tmp_path / case / "export")
        logits = _remote_logits(tmp_path / case / "export", _tokens(REMOTE_CASES[case].vocab_size), tmp_path / case)
        megatron = torch.load(tmp_path / case / "megatron_logits.pt")
        torch.testing.assert_close(megatron, logits, atol=1e-4, rtol=0, msg=lambda m, c=case: f"{c}: {m}")
    missing = sorted(set(REMOTE_CASES) - set(cases))
    if missing:
        pytest.skip(f"reference model lacks {missing} (checked the others)")


@pytest.mark.slow
def test_cli_hf_to_sft_to_hf(tmp_path) -> None:
    """The commands a user runs: convert under torchrun (TP=2), train from it with `mcore-rl sft`
    (PP=2, learning rate 0), export the SFT checkpoint: the weights come back bit for bit, and the
    source's metadata with them without extra flags (train/hf_provenance.py): its dtype (bf16), its
    special-token ids (Llama's null bos stays null), its tokenizer and generation_config.json."""
    import shutil

    from mcore_rl.data.tokenizer import BUNDLED_DIR, TOKENIZER_FILE

    _save_stock("llama", tmp_path / "hf", dtype=torch.bfloat16, vocab=384)  # the byte tokenizer's vocabulary
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    source.update(bos_token_id=None, eos_token_id=2, pad_token_id=0)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(source))
    bundled = os.path.join(BUNDLED_DIR, TOKENIZER_FILE)
    shutil.copyfile(bundled, tmp_path / "hf" / TOKENIZER_FILE)
    run = _cli(
        "convert", "hf-to-mcore", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mcore"), "--tp", "2"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mcore-rl sft" in run.stdout and os.path.exists(tmp_path / "mcore" / "latest")
    run = _cli(
        "sft",
        str(tmp_path / "mcore" / "recipe.yaml"),
        f"run_dir={tmp_path}/run",
        f"checkpoint.save_dir={tmp_path}/sft",
        "train.train_iters=1",
        "optimizer.lr=0",
        "optimizer.min_lr=0",
        "parallel.pipeline_model_parallel_size=2",
        "--nproc-per-node",
        "2",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from" in run.stdout
    run = _cli("convert", "mcore-to-hf", "--input", str(tmp_path / "sft"), "--output", str(tmp_path / "export"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "stock LlamaForCausalLM" in run.stdout
    ta, tb = _load_tensors(tmp_path / "hf"), _load_tensors(tmp_path / "export")
    assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) and tb[k].dtype == torch.bfloat16 for k in ta)
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["dtype"] == "bfloat16"
    assert {k: exported[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
        "bos_token_id": None,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    assert (tmp_path / "export" / TOKENIZER_FILE).exists() and (tmp_path / "export" / "generation_config.json").exists()


# ---------------------------------------------------------------------------------------------
# streaming: bounded memory, shard files, progress bars
# ---------------------------------------------------------------------------------------------


def _streaming_world(rank: int, world_size: int, tmp: str) -> None:
    """Import in TP=2 / EP=2 (in the source dtype), export across two stages (PP=2) and gathering
    TP/ETP shards (TP=2) with small shards; each rank records its streaming counters."""
    import torch.distributed as dist

    from mcore_rl.convert import hf_to_mcore, mcore_to_hf
    from mcore_rl.convert import parallel_config as P
    from mcore_rl.convert.streaming import StreamStats

    record = {}
    cases = [("tall", "bf16", P(tp=2), {"pp2": P(pp=2)}), ("moe", "fp32", P(ep=2), {"tp2": P(tp=2)})]
    for name, precision, into, outs in cases:
        stats = StreamStats()
        hf_to_mcore(f"{tmp}/{name}/hf", f"{tmp}/{name}/mcore", into, precision, stats=stats)
        record[f"{name}/import"] = dataclasses.asdict(stats)
        for out, layout in outs.items():
            stats = StreamStats()
            mcore_to_hf(f"{tmp}/{name}/mcore", f"{tmp}/{name}/{out}", layout, max_shard_bytes=_SHARD_BYTES, stats=stats)
            record[f"{name}/{out}"] = dataclasses.asdict(stats)
        dist.barrier()
    with open(f"{tmp}/stats{rank}.json", "w") as f:
        json.dump(record, f)


_SHARD_BYTES = 100_000


def _tall_config():
    from transformers import Qwen3Config

    # 12 layers of small matrices: the model is ~40x its largest tensor, so holding it shows
    return Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


@pytest.mark.slow
def test_streaming_conversion_holds_a_few_tensors_and_writes_shards(tmp_path, capfd, monkeypatch) -> None:
    """Import reads only owned slices (peak <= the largest full tensor per rank, with TP=2), export
    holds a few tensors at a time on the writer (<= 3x the largest) whatever the layout, writes shard
    files of at most --max-shard-size, round-trips bit for bit, and draws progress bars on stderr."""
    from transformers import AutoModelForCausalLM

    from mcore_rl.convert import HFCheckpoint
    from tests.world import run_world

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tall_config()).to(torch.bfloat16).save_pretrained(tmp_path / "tall" / "hf")
    _save_stock("qwen3_moe", tmp_path / "moe" / "hf")
    monkeypatch.setenv("MCORE_RL_PROGRESS", "1")
    run_world(2, _streaming_world, str(tmp_path))
    err = capfd.readouterr().err
    assert "import (rank 0 shard)" in err and "export" in err and "tensors" in err and "B/s" in err
    stats = [json.loads((tmp_path / f"stats{r}.json").read_text()) for r in range(2)]
    for name in ("tall", "moe"):
        source = HFCheckpoint(str(tmp_path / name / "hf"))
        largest = max(source[k].numel() * source[k].element_size() for k in source)
        model = sum(source[k].numel() * source[k].element_size() for k in source)
        tall = name == "tall"  # (the MoE is 2 layers: its largest tensor is not small next to the model)
        for r in range(2):  # read slices + the fused shard; with TP=2 each rank reads half of each tensor
            bound = largest if tall else 2 * largest
            assert 0 < stats[r][f"{name}/import"]["peak_held_bytes"] <= bound, (name, r, stats[r])
        out = "pp2" if tall else "tp2"
        _assert_same_checkpoint(tmp_path / name / "hf", tmp_path / name / out)
        writer, other = stats[0][f"{name}/{out}"], stats[1][f"{name}/{out}"]
        assert writer["bytes"] == model and writer["tensors"] == len(source)  # all through the writer
        assert writer["largest_tensor_bytes"] <= 2 * largest  # fused QKV / [gate; up] at most
        assert writer["peak_held_bytes"] <= 3 * writer["largest_tensor_bytes"], (name, writer)
        assert writer["peak_held_bytes"] < model / 4 or not tall, writer
        assert other["bytes"] == 0 and other["peak_held_bytes"] <= writer["largest_tensor_bytes"], other
    files = sorted(p.name for p in (tmp_path / "tall" / "pp2").glob("*.safetensors"))
    index = json.loads((tmp_path / "tall" / "pp2" / "model.safetensors.index.json").read_text())
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    for file in files:  # each shard at most the limit (plus its header), the tensors no more than it
        assert os.path.getsize(tmp_path / "tall" / "pp2" / file) <= _SHARD_BYTES + 16_000
