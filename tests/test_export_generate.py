"""Exported checkpoints generate with `transformers`: `AutoModelForCausalLM.from_pretrained(export)
.generate(...)` agrees with the embedded engine serving the same directory.

Greedy: the same tokens. Sampled: transformers' `torch.multinomial` and the engine's inverse-CDF
sampler with its own per-request generator cannot be made to draw the same tokens from one seed,
so the comparison is on what is deterministic: the engine scores the tokens transformers sampled
(its input log-probs) and they equal transformers' own log-softmax of the logits it sampled from;
and the other way round, transformers scores the engine's sampled tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mcore_rl.config.schema import ModelConfig
from mcore_rl.convert.to_hf import REMOTE, write_hf_checkpoint
from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
from mcore_rl.rollout.engine.core import EngineCore, Request
from mcore_rl.rollout.engine.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3], [200, 41, 7, 7, 64, 12]]
NEW = 8

# dense -> stock Qwen3ForCausalLM; AttnRes -> remote code only (the copied mcore_rl/hf modules)
CASES = {"dense": ModelConfig(), "attn_res": ModelConfig.of(attn_res="full")}


def export(mc: ModelConfig, path: str) -> str:
    """A random reference model with peaked distributions, written as an HF export; returns its kind."""
    cfg = hf_config_from_model_config(mc)
    cfg.initializer_range = 0.2  # peaked, input-dependent distributions (greedy ties are unlikely)
    torch.manual_seed(0)
    model = McoreRLForCausalLM(cfg)
    return write_hf_checkpoint(model.state_dict(), mc, path, torch.float32)


def load_export(path: str, kind: str):
    """The export as transformers loads it. Remote code: the class from the export's own copied
    files (what `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` resolves to in a
    process without mcore_rl; here mcore_rl.hf's in-process registration would shadow it)."""
    if kind != REMOTE:
        return AutoModelForCausalLM.from_pretrained(path).eval()
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    cls = get_class_from_dynamic_module("modeling.McoreRLForCausalLM", path)
    assert cls.__module__.startswith("transformers_modules")  # the export's code, not mcore_rl's
    return cls.from_pretrained(path).eval()


def engine_run(engine: EngineCore, reqs: list[Request]) -> dict:
    for r in reqs:
        engine.add_request(r)
    finals = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.rid] = out
    return finals


@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_engine(case: str, tmp_path) -> None:
    kind = export(CASES[case], str(tmp_path))
    assert (kind == REMOTE) == (case == "attn_res")
    hf = load_export(str(tmp_path), kind)
    assert type(hf).__name__ == ("McoreRLForCausalLM" if kind == REMOTE else "Qwen3ForCausalLM")
    engine = EngineCore.from_model_path(str(tmp_path), context_length=64)
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0, return_dict_in_generate=True, output_logits=True)

    # greedy: one prompt at a time (no padding), the same tokens
    greedy = engine_run(
        engine,
        [
            Request(f"g{i}", p, SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)
        ],
    )
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            out = hf.generate(torch.tensor([p]), do_sample=False, **gen)
            assert out.sequences[0, len(p) :].tolist() == greedy[f"g{i}"].output_ids

    # sampled by transformers, scored by the engine
    torch.manual_seed(1)
    with torch.no_grad():
        sampled = [
            hf.generate(torch.tensor([p]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0, **gen) for p in PROMPTS
        ]
    scored = engine_run(
        engine,
        [
            Request(
                f"s{i}",
                out.sequences[0].tolist(),
                SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True),
                return_logprob=True,
                logprob_start_len=len(p) - 1,
            )
            for i, (p, out) in enumerate(zip(PROMPTS, sampled))
        ],
    )
    for i, (p, out) in enumerate(zip(PROMPTS, sampled)):
        tokens = out.sequences[0, len(p) :]
        hf_lp = torch.stack([torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(out.logits, tokens)])
        engine_lp = [lp for lp, _ in scored[f"s{i}"].input_token_logprobs[1:]]
        assert [t for _, t in scored[f"s{i}"].input_token_logprobs[1:]] == tokens.tolist()
        torch.testing.assert_close(torch.tensor(engine_lp), hf_lp, atol=2e-5, rtol=0)

    # sampled by the engine (seeded), scored by transformers
    drawn = engine_run(
        engine,
        [
            Request(f"e{i}", p, SamplingParams(max_new_tokens=NEW, seed=7, ignore_eos=True), return_logprob=True)
            for i, p in enumerate(PROMPTS)
        ],
    )
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([p + drawn[f"e{i}"].output_ids])
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits[0, len(p) - 1 : -1].float(), -1)
        want = lp.gather(-1, ids[0, len(p) :, None])[:, 0]
        got = torch.tensor([x for x, _ in drawn[f"e{i}"].output_token_logprobs])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_forward_takes_transformers_keywords(tmp_path) -> None:
    """The remote-code model's forward: return_dict=False tuples, logits_to_keep, hidden states,
    inputs_embeds, and a left-padded batch through generate equal to each prompt alone."""
    hf = load_export(str(tmp_path), export(CASES["attn_res"], str(tmp_path)))
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        full = hf(ids, output_hidden_states=True)
        assert isinstance(hf(ids, return_dict=False), tuple)
        torch.testing.assert_close(hf(ids, logits_to_keep=1).logits, full.logits[:, -1:])
        torch.testing.assert_close(hf(inputs_embeds=hf.get_input_embeddings()(ids)).logits, full.logits)
        assert full.hidden_states[-1].shape == (1, ids.shape[1], hf.config.hidden_size)
        with pytest.raises(NotImplementedError, match="output_attentions"):
            hf(ids, output_attentions=True)
        # left padding: generate builds position ids from the attention mask
        short, long_ = PROMPTS
        pad = len(long_) - len(short)
        batch = torch.tensor([[0] * pad + short, long_])
        mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long_)])
        both = hf.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=0)
        for row, p in enumerate(PROMPTS):
            alone = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, pad_token_id=0)
            assert both[row, len(long_) :].tolist() == alone[0, len(p) :].tolist()


def test_provenance_is_carried_from_run_to_run(tmp_path) -> None:
    """A converted checkpoint's HF provenance and assets reach every later run's save dir (what
    `mcore-rl sft` and `mcore-rl train` do on load and save), and the null ids stay null."""
    from mcore_rl.convert.hf_checkpoint import ASSETS_DIR
    from mcore_rl.train.checkpoint import LATEST
    from mcore_rl.train.hf_provenance import ASSETS_DIR as CARRIED_DIR
    from mcore_rl.train.hf_provenance import carry_provenance, read_provenance

    assert CARRIED_DIR == ASSETS_DIR
    converted = tmp_path / "mcore"
    (converted / "iter_0000000").mkdir(parents=True)
    (converted / LATEST).write_text("iter_0000000")
    (converted / ASSETS_DIR).mkdir()
    (converted / ASSETS_DIR / "generation_config.json").write_text('{"eos_token_id": 2}')
    common = {
        "hf_config": {"bos_token_id": None, "eos_token_id": 2},
        "hf_dtype": "bfloat16",
        "hf_source": "/src",
        "model": {},
        "iteration": 0,
    }
    provenance = read_provenance(common, str(converted / "iter_0000000"))
    for run in ("sft", "rl"):
        saved = carry_provenance(provenance, {"model": {}, "data": run}, str(tmp_path / run))
        assert {k: saved[k] for k in ("hf_config", "hf_dtype", "hf_source")} == {
            k: common[k] for k in ("hf_config", "hf_dtype", "hf_source")
        }
        assert saved["data"] == run and "hf_assets_from" not in saved
        assert (tmp_path / run / ASSETS_DIR / "generation_config.json").read_text() == '{"eos_token_id": 2}'
        (tmp_path / run / "iter_0000001").mkdir()
        (tmp_path / run / LATEST).write_text("iter_0000001")
        provenance = read_provenance(saved, str(tmp_path / run / "iter_0000001"))  # the next run starts here
    assert read_provenance({}, str(tmp_path / "nothing")) == {}


def test_generate_with_a_sliding_window_and_latent_attention_equals_full_forwards() -> None:
    """`generate`'s own `DynamicCache(config=...)` keeps only a windowed layer's last W - 1 keys
    (Mistral) and MLA's latents (DeepSeek-V3): greedy decoding through it must equal re-running
    the whole sequence each step, past the window."""
    import dataclasses

    from mcore_rl.config.schema import ModelConfig
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    base = ModelConfig(
        vocab_size=96, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2
    )
    cases = [
        dataclasses.replace(base, qk_layernorm=False, sliding_window=4),
        ModelConfig.of(
            arch="deepseek_v3",
            vocab_size=96,
            hidden_size=32,
            ffn_hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            num_query_groups=4,
            num_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=16,
            moe_shared_expert_intermediate_size=16,
            moe_layer_pattern=[0, 1],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=2,
            moe_router_group_topk=1,
            multi_latent_attention=True,
            kv_lora_rank=16,
            qk_head_dim=8,
            qk_pos_emb_head_dim=4,
            v_head_dim=8,
        ),
    ]
    for mc in cases:
        torch.manual_seed(0)
        model = McoreRLForCausalLM(hf_config_from_model_config(mc)).eval()
        ids = torch.randint(0, mc.vocab_size, (1, 5))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
            seq = ids
            for _ in range(10):
                seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert out.tolist() == seq.tolist(), mc.arch
