"""Over-Encoding n-gram input embeddings (OverTok, arXiv:2501.16975): ids, reference model, megatron parity."""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings

import pytest
import torch

from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config, model_config_from_hf_config
from mcore_rl.hf.configuration import McoreRLConfig, to_stock_hf_config
from mcore_rl.hf.ngram import McoreRLNgramEmbeddings, NgramKVCache, ngram_hash_ids, sliced_lookup

VOCAB = 100


def _py_id(tokens: list[int], t: int, p: int, n: int, vocab: int, m: int) -> int:
    """The documented id with Python integers: missing count as the top base-V digit."""
    have = min(p, n - 1, t)
    digits = [tokens[t - j] if j <= have else 0 for j in range(n)]  # z_1 .. z_n
    f = sum(z * vocab**i for i, z in enumerate(digits)) + (n - 1 - have) * vocab**n
    return f % m


# ---------------------------------------------------------------------------------- n-gram ids


def test_ids_injective_before_modulo():
    """V=5, n=3: all V^n full trigrams get distinct ids in [0, V^n) (m large: no reduction)."""
    v, n = 5, 3
    m = 10**6
    trigrams = torch.tensor(list(itertools.product(range(v), repeat=n)))  # [125, 3] = x_{t-2}, x_{t-1}, x_t
    ids = ngram_hash_ids(trigrams, torch.arange(n).expand(len(trigrams), n), [n], v, m)[0][:, -1]
    assert ids.unique().numel() == v**n and int(ids.min()) == 0 and int(ids.max()) == v**n - 1
    # f = x_t + x_{t-1} V + x_{t-2} V^2 exactly
    expected = trigrams[:, 2] + trigrams[:, 1] * v + trigrams[:, 0] * v * v
    assert torch.equal(ids, expected)
    # partial n-grams (document start) never collide with full ones or each other before the modulo
    partial = ngram_hash_ids(trigrams, torch.zeros(len(trigrams), n, dtype=torch.long), [n], v, m)[0]
    all_ids = torch.cat(
        [
            ids,
            partial[:, -1].unique(),
            ngram_hash_ids(trigrams[:, :2], torch.arange(2).expand(len(trigrams), 2), [n], v, m)[0][:, -1].unique(),
        ]
    )
    assert all_ids.unique().numel() == v**n + v + v * v
    assert int(all_ids.max()) < n * v**n


def test_ids_exact_for_large_vocab():
    """V = 2^40 (V^2 already overflows int64): ids match Python big integers, for n = 2 and 3."""
    v, m = 2**40 + 15, 2**31 - 1  # m prime
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2**62, (3, 9), generator=g) % v
    pos = torch.tensor([list(range(9)), [0, 1, 2, 0, 1, 0, 1, 2, 3], [0] * 9])
    ids2, ids3 = ngram_hash_ids(tokens, pos, [2, 3], v, m)
    for b in range(3):
        toks = tokens[b].tolist()
        for t in range(9):
            p = int(pos[b, t])
            assert int(ids3[b, t]) == _py_id(toks, t, p, 3, v, m)
            assert int(ids2[b, t]) == _py_id(toks, t, p, 2, v, m)
    exact = sum(int(z) * v**i for i, z in enumerate(tokens[0, :3].flip(0).tolist()))
    wrapped = tokens[0, 2] + tokens[0, 1] * v + tokens[0, 0] * v * v  # plain int64 arithmetic
    assert exact > 2**63 and int(wrapped) % m != exact % m  # it would have overflowed
    assert int(ids3[0, 2]) == exact % m
    assert (ids3 >= 0).all() and (ids3 < m).all()


def test_modulus_coprime_with_vocab():
    """The paper's property 2: distinct 2-gram ids for a fixed current token over all previous ones."""
    v = 10
    prev = torch.arange(v)
    pairs = torch.stack([prev, torch.full_like(prev, 3)], dim=1)  # [x_{t-1}, x_t = 3]
    pos = torch.arange(2).expand(v, 2)
    distinct = {m: ngram_hash_ids(pairs, pos, [2], v, m)[0][:, 1].unique().numel() for m in (21, 23, 20, 30)}
    assert distinct == {21: 10, 23: 10, 20: 2, 30: 3}
    cfg = dict(
        vocab_size=v,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        ngram_orders=[2],
        ngram_num_slices=1,
    )
    with pytest.warns(UserWarning, match="ngram_table_size=20 shares the factor 10"):
        McoreRLNgramEmbeddings(McoreRLConfig(**cfg, ngram_table_size=20))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        McoreRLNgramEmbeddings(McoreRLConfig(**cfg, ngram_table_size=21))


def test_ids_never_cross_documents():
    """A packed document's ids equal those of the document alone, and row starts have no context."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, VOCAB, (1, 5), generator=g), torch.randint(0, VOCAB, (1, 4), generator=g)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(5), torch.arange(4)])[None]
    together = ngram_hash_ids(packed, pos, [2, 3], VOCAB, 97)
    alone_a, alone_b = ngram_hash_ids(a, None, [2, 3], VOCAB, 97), ngram_hash_ids(b, None, [2, 3], VOCAB, 97)
    for t, x, y in zip(together, alone_a, alone_b):
        assert torch.equal(t, torch.cat([x, y], dim=1))
    # the first token of a document: missing count n-1, digits 0 -> (n-1) V^n + x_t
    tok = int(b[0, 0])
    assert int(together[1][0, 5]) == (2 * VOCAB**3 + tok) % 97
    # a decoded token with its context from the cache equals the same token in a full row
    full = ngram_hash_ids(packed, None, [3], VOCAB, 97)[0]
    step = ngram_hash_ids(packed[:, 6:7], torch.tensor([[6]]), [3], VOCAB, 97, context=packed[:, 4:6])[0]
    assert int(step) == int(full[0, 6])


def test_sliced_table_identities():
    """The paper's properties 3-4: zero tables give the plain embedding; k=1 with W=I is a plain lookup."""
    ids = torch.randint(0, 50, (2, 7))
    table = torch.nn.Embedding(50, 16)
    eye = torch.nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        eye.weight.copy_(torch.eye(16))
    torch.testing.assert_close(sliced_lookup(ids, [table], [eye]), table(ids))
    model = _model(_hf_config())
    x = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        for t in model.model.ngram_embeddings.tables.parameters():
            t.zero_()
        out = model.model.embed(x)
    assert out.shape == (2, 7, 48)
    torch.testing.assert_close(out, model.model.embed_tokens(x))


# ---------------------------------------------------------------------------------- reference


def _hf_config(**kw) -> McoreRLConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        ngram_orders=[2, 3],
        ngram_table_size=97,
        ngram_num_slices=2,
    )
    base.update(kw)
    return McoreRLConfig(**base)


def _model(cfg: McoreRLConfig, seed: int = 0) -> McoreRLForCausalLM:
    torch.manual_seed(seed)
    model = McoreRLForCausalLM(cfg).eval()
    with torch.no_grad():  # n-gram tables as large as the token embedding, so they matter
        for p in model.model.ngram_embeddings.parameters():
            p.normal_(0.0, 0.3)
    return model


def test_reference_parameters_and_effect():
    model = _model(_hf_config())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if "ngram" in n}
    assert shapes == {
        "model.ngram_embeddings.tables.2.0.weight": (97, 12),
        "model.ngram_embeddings.tables.2.1.weight": (97, 12),
        "model.ngram_embeddings.tables.3.0.weight": (97, 8),
        "model.ngram_embeddings.tables.3.1.weight": (97, 8),
        "model.ngram_embeddings.projections.2.0.weight": (48, 12),
        "model.ngram_embeddings.projections.2.1.weight": (48, 12),
        "model.ngram_embeddings.projections.3.0.weight": (48, 8),
        "model.ngram_embeddings.projections.3.1.weight": (48, 8),
    }
    x = torch.randint(0, VOCAB, (1, 6))
    y = x.clone()
    y[0, 2] = (y[0, 2] + 1) % VOCAB  # changes the 1-gram at 2, the 2-grams at 2-3, the 3-grams at 2-4
    with torch.no_grad():
        ex, ey = model.model.embed(x), model.model.embed(y)
        tx, ty = model.model.embed_tokens(x), model.model.embed_tokens(y)
    changed = ((ex - tx) - (ey - ty)).abs().amax(-1)[0] > 0
    assert changed.tolist() == [False, False, True, True, True, False]


def test_kv_cache_decode_matches_full_forward():
    model = _model(_hf_config())
    x = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :3], use_cache=True)
        assert out.cache.ngram_context.tolist() == x[:, 1:3].tolist()  # a DynamicCache carrying the context
        steps, cache = [out.logits], out.past_key_values
        for t in range(3, 9):
            out = model(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
        # an engine that keeps its own per-request state passes the context explicitly
        plain = [(layer.keys, layer.values) for layer in cache.layers]
        explicit = model(
            x[:, 8:9], past_key_values=[(k[:, :, :8], v[:, :, :8]) for k, v in plain], ngram_context=x[:, 6:8]
        ).logits
        torch.testing.assert_close(explicit, full[:, 8:9], atol=1e-5, rtol=0)
        # a prompt shorter than n-1: the -1 padding of the context is never used
        one = model(x[:, :1], use_cache=True)
        assert one.cache.ngram_context.tolist() == [[-1, int(x[0, 0])], [-1, int(x[1, 0])]]
        two = model(x[:, 1:2], past_key_values=one.cache, use_cache=True).logits
        torch.testing.assert_close(two, full[:, 1:2], atol=1e-5, rtol=0)
        # a legacy list cache comes back as a list that carries the context
        legacy = model(x[:, :1], past_key_values=[], use_cache=True).cache
        assert isinstance(legacy, NgramKVCache) and legacy.ngram_context.tolist() == [
            [-1, int(x[0, 0])],
            [-1, int(x[1, 0])],
        ]
        two = model(x[:, 1:2], past_key_values=legacy, use_cache=True).logits
        torch.testing.assert_close(two, full[:, 1:2], atol=1e-5, rtol=0)


def test_packed_documents_and_left_padding():
    model = _model(_hf_config())
    a, b = torch.randint(0, VOCAB, (1, 4)), torch.randint(0, VOCAB, (1, 5))
    packed = torch.cat((a, b), dim=1)
    doc = torch.tensor([0] * 4 + [1] * 5)
    mask = (doc[:, None] == doc[None, :])[None, None]
    pos = torch.cat((torch.arange(4), torch.arange(5)))[None]
    with torch.no_grad():
        together = model(packed, position_ids=pos, attention_mask=mask).logits
        separate = torch.cat((model(a).logits, model(b).logits), dim=1)
        torch.testing.assert_close(together, separate, atol=1e-5, rtol=0)
        padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), b), dim=1)
        attn = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
        lpos = (attn.cumsum(-1) - 1).clamp_min(0)
        out = model(padded, position_ids=lpos, attention_mask=attn).logits
        torch.testing.assert_close(out[:, 3:], model(b).logits, atol=1e-5, rtol=0)


def test_save_load_and_config_round_trip(tmp_path):
    model = _model(_hf_config(), seed=3)
    model.save_pretrained(tmp_path)
    loaded = McoreRLForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.ngram_orders == [2, 3] and loaded.config.ngram_table_size == 97
    x = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)
    mc = ModelConfig.of(
        vocab_size=VOCAB,
        hidden_size=48,
        ffn_hidden_size=64,
        ngram=NgramEmbeddingConfig(orders=[2, 3], table_size=97, num_slices=2),
    )
    hf = hf_config_from_model_config(mc)
    assert (hf.ngram_orders, hf.ngram_table_size, hf.ngram_num_slices) == ([2, 3], 97, 2)
    assert model_config_from_hf_config(hf) == mc
    with pytest.raises(ValueError, match="ngram_orders"):
        to_stock_hf_config(hf)


def test_config_validation():
    from mcore_rl.config import ConfigError, SFTConfig, validate_sft_config
    from mcore_rl.config.schema import ParallelConfig

    def cfg(tp=1, cp=1, **ng):
        ngram = NgramEmbeddingConfig(**{"orders": [2, 3], "table_size": 97, **ng})
        return SFTConfig(
            model=ModelConfig.of(ngram=ngram),
            parallel=ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp),
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_sft_config(cfg(tp=2), 4)
        validate_sft_config(cfg(tp=2, shard_over_data_parallel=True), 4)
    with pytest.warns(UserWarning, match="model.ngram.table_size=96 shares the factor"):
        validate_sft_config(cfg(table_size=96), 1)
    bad = [
        (cfg(orders=[1, 2]), 1, "model.ngram.orders"),
        (cfg(orders=[2, 2]), 1, "model.ngram.orders"),
        (cfg(table_size=0), 1, "model.ngram.table_size"),
        (cfg(table_size=2**31), 1, "model.ngram.table_size"),
        (cfg(num_slices=0), 1, "model.ngram.num_slices"),
        (cfg(num_slices=40), 1, "model.ngram.num_slices"),
        (cfg(shard_over_data_parallel=True), 3, "model.ngram.shard_over_data_parallel"),
        (cfg(cp=2), 2, "parallel.context_parallel_size"),
    ]
    for c, world, key in bad:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate_sft_config(c, world)


# ------------------------------------------------------------------------- megatron-core parity

SEQ, MBS, NUM_MICROBATCHES = 16, 2, 4
NGRAM = ModelConfig.of(
    arch="qwen3",
    num_layers=2,
    hidden_size=48,
    ffn_hidden_size=96,
    ngram=NgramEmbeddingConfig(orders=[2, 3], table_size=97, num_slices=2),
)
NGRAM_DP = NGRAM.replace(ngram=dataclasses.replace(NGRAM.section(NgramEmbeddingConfig), shard_over_data_parallel=True))


def _packed_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    """Rows of 1-3 packed documents: positions restart, segment ids number the documents."""
    g = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(NUM_MICROBATCHES):
        tokens = torch.randint(0, vocab, (MBS, SEQ + 1), generator=g)
        pos = torch.zeros(MBS, SEQ, dtype=torch.long)
        seg = torch.zeros(MBS, SEQ, dtype=torch.long)
        for r in range(MBS):
            cuts = sorted(torch.randperm(SEQ - 2, generator=g)[: r + 1].add(1).tolist())
            start, doc = 0, 1
            for end in cuts + [SEQ]:
                pos[r, start:end] = torch.arange(end - start)
                seg[r, start:end] = doc
                start, doc = end, doc + 1
        loss_mask = (torch.rand(MBS, SEQ, generator=g) > 0.25).float()
        batches.append(
            dict(
                tokens=tokens[:, :-1].contiguous(),
                labels=tokens[:, 1:].contiguous(),
                loss_mask=loss_mask,
                position_ids=pos,
                segment_ids=seg,
            )
        )
    return batches


def _reference_packed(mc: ModelConfig, batches):
    """Loss, HF state and HF gradients of the global token-mean loss on packed rows."""
    torch.manual_seed(1234)
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif "ngram_embeddings" in name:
                p.normal_(0.0, 0.3)
    total = sum(float(b["loss_mask"].sum()) for b in batches)
    objective, lm_sum = 0.0, 0.0
    for b in batches:
        seg = b["segment_ids"]
        mask = (seg[:, :, None] == seg[:, None, :])[:, None]
        out = model(
            b["tokens"],
            position_ids=b["position_ids"],
            attention_mask=mask,
            labels=b["labels"],
            loss_mask=b["loss_mask"],
        )
        n = float(b["loss_mask"].sum())
        lm_sum = lm_sum + out.loss.detach() * n
        objective = objective + out.loss * n / total
    objective.backward()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(lm_sum) / total, state, grads


def _after_checks(mc, ref, ckpt_dir, save, load):
    """Global grad norm == the reference's; model-only checkpoints save/load across layouts."""

    def run(chunks):
        import torch.distributed as dist

        from mcore_rl.hf.weight_map import hf_to_megatron
        from mcore_rl.models.shards import gather_full_state_dict, grad_of
        from mcore_rl.train.checkpoint import load_checkpoint, save_checkpoint
        from mcore_rl.train.optimizer import global_grad_norm

        params = [p for c in chunks for p in c.parameters()]
        norm = global_grad_norm(params, [grad_of(p) for p in params])
        want = math.sqrt(sum(float(g.double().square().sum()) for g in ref[2].values()))
        assert abs(norm - want) <= 1e-5 * want, f"grad norm {norm} vs {want}"
        if save:
            save_checkpoint(ckpt_dir, 1, chunks, None, {})
        if load:
            with torch.no_grad():
                for p in params:
                    p.zero_()
            load_checkpoint(f"{ckpt_dir}/iter_0000001", chunks, None)
            got = gather_full_state_dict(chunks)
            for key, want_t in hf_to_megatron(ref[1], mc).items():
                assert torch.equal(got[key], want_t), f"{key} differs after loading the checkpoint"
        dist.barrier()

    return run


def _ngram_world(rank: int, world_size: int, cases, ckpt_dir: str) -> None:
    from tests.helpers import _check_layout

    refs: dict = {}
    batches = _packed_batches(NGRAM.vocab_size)
    for mc, pc, save, load in cases:
        key = repr(
            mc.replace(ngram=dataclasses.replace(mc.section(NgramEmbeddingConfig), shard_over_data_parallel=False))
        )
        if key not in refs:
            refs[key] = _reference_packed(mc, batches)
        _check_layout(mc, pc, batches, refs[key], after=_after_checks(mc, refs[key], ckpt_dir, save, load))


@pytest.mark.slow
def test_parity_two_ranks(tmp_path):
    from tests.helpers import P
    from tests.world import run_world

    cases = [
        (NGRAM_DP, P(), True, False),  # DP=2, tables sharded over DP (all-to-all lookup); saves
        (NGRAM, P(tp=2, sp=True), False, True),  # TP=2 + SP; loads the DP-sharded checkpoint
        (NGRAM, P(tp=2), False, False),
        (NGRAM, P(pp=2), False, False),  # tables on the first stage only
        (NGRAM, P(), False, False),  # DP=2, tables replicated over DP
    ]
    run_world(2, _ngram_world, cases, str(tmp_path / "ckpt"))


@pytest.mark.slow
def test_parity_four_ranks(tmp_path):
    from tests.helpers import P
    from tests.world import run_world

    cases = [
        (NGRAM_DP, P(tp=2, sp=True), True, False),  # 4 table shards over TP x DP
        (NGRAM, P(tp=2, pp=2), False, True),
    ]
    run_world(4, _ngram_world, cases, str(tmp_path / "ckpt"))
