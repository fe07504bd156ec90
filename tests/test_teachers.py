"""Teachers of on-policy distillation against real engines: `mcore-rl serve` processes on loopback
started on real checkpoints, found and killed by their pids.

- the prompt-scoring request gives SGLang's reply shape and exactly the teacher model's log-probs
  of the student's tokens (and its top-k);
- a teacher with another tokenizer, or one that does not answer, is refused before training with
  an error naming `teachers[i]` and the engine;
- an engine SIGKILLed while it scores costs only its requests (they go to the teacher's other
  engine); with every engine dead the samples are marked, and nothing raises;
- UI-MOPD routing: each sample is scored by the teacher of its domain only, so changing the
  desktop teacher changes the (K3) distillation term of desktop samples only;
- SGLang's `token_ids_logprob` on a real `mcore-rl serve` process equals a plain forward; a
  reference teacher (Direct-OPD's π_Tref) scores the teacher's tokens and top-k ids, and a
  Direct-OPD run with teacher and reference trains (sync and async);
- the `teachers:` config section and its errors;
- in a trainer world: engine teachers through `RLRun.teach`, the privileged-context and the
  frozen-copy teachers, and short sync and async runs with teachers.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import urllib.request

import pytest
import torch

from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from mcore_rl.config.schema import ModelConfig
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.data.tokenizer import NAMED_SPECIAL_TOKENS, ByteTokenizer, load_tokenizer
from mcore_rl.rollout.teacher import EngineTeacher, TeacherError, route_by_domain, start_teacher_engines

CONTEXT = 256
TOK = load_tokenizer(None)


def write_checkpoint(path: str, seed: int, tokenizer: ByteTokenizer | None = None) -> str:
    """An HF checkpoint of the default model, weights from `seed` (and a tokenizer file, if given)."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = McoreRLForCausalLM(hf_config_from_model_config(ModelConfig()))
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def reference_model(path: str):
    from mcore_rl.hf import McoreRLForCausalLM

    return McoreRLForCausalLM.from_pretrained(path).eval()


@torch.no_grad()
def reference_scores(model, samples: list[Sample], k: int = 0):
    """log p(response[j]) and the top-k of every response position, from one plain forward."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        lp = torch.log_softmax(model(ids).logits.float(), -1)[0]
        p = len(s.prompt_ids)
        rows = lp[p - 1 : p - 1 + len(s.response_ids)]
        chosen = rows.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        top = rows.topk(k, dim=-1) if k else None
        out.append((chosen, top))
    return out


def make_samples(n: int, domains=("",), seed: int = 0, prompt_len: int = 12, response_len: int = 20) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        text = f"{i} + {i * 7} = "
        ids = [TOK.bos_id] + TOK.encode(text)
        ids += torch.randint(32, 127, (max(0, prompt_len - len(ids)),), generator=g).tolist()
        resp = torch.randint(32, 127, (response_len - i % 5,), generator=g).tolist()
        prompt = Prompt(i, text, ids, label=str(i * 8), domain=domains[i % len(domains)])
        out.append(
            Sample(
                prompt,
                group=i // 4,
                response_ids=resp,
                rollout_logp=[-1.0] * len(resp),
                policy_version=1,
                finish_reason="stop",
                text=TOK.decode(resp),
                reward=float(i % 4 == 0),
            )
        )
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    swapped = [NAMED_SPECIAL_TOKENS[0], NAMED_SPECIAL_TOKENS[2], NAMED_SPECIAL_TOKENS[1], *NAMED_SPECIAL_TOKENS[3:]]
    other_tok = ByteTokenizer(swapped + TOK.special_tokens[len(swapped) :], TOK.vocab_size)  # <bos>/<eos> swapped
    return {
        "a": write_checkpoint(str(root / "a"), 0),
        "b": write_checkpoint(str(root / "b"), 1),
        "other_tok": write_checkpoint(str(root / "other_tok"), 2, other_tok),
        "root": str(root),
    }


@pytest.fixture(scope="module")
def servers(ckpts):
    """Engine processes: two on checkpoint a (one teacher, killed by the last engine test), one each
    on b and on the checkpoint with another tokenizer (and other weights)."""
    root = ckpts["root"]
    procs = {}
    try:
        for name, ck, n in (("a", "a", 2), ("b", "b", 1), ("other_tok", "other_tok", 1)):
            procs[name] = start_teacher_engines(
                ckpts[ck],
                num=n,
                workdir=os.path.join(root, f"w_{name}"),
                context_length=CONTEXT,
                threads=1,
                max_running_requests=32,
            )
        yield procs
    finally:
        for p in procs.values():
            p.close()


def _load(url: str) -> int:
    with urllib.request.urlopen(url + "/get_load", timeout=5) as r:
        return int(json.loads(r.read())[0]["num_reqs"])


# ------------------------------------------------------------------------------- scoring


def test_prompt_scoring_reply_is_sglangs_and_scores_are_the_teachers(servers, ckpts):
    from mcore_rl.rollout.client import EngineClient

    url = servers["b"].urls[0]
    ids = [TOK.bos_id] + TOK.encode("3 + 4 = 7")

    async def raw():
        async with EngineClient(url) as c:
            return await c.generate(
                input_ids=ids,
                sampling_params={"max_new_tokens": 0},
                return_logprob=True,
                logprob_start_len=4,
                top_logprobs_num=3,
            )

    import asyncio

    out = asyncio.run(raw())
    meta = out["meta_info"]
    # SGLang's prefill-only reply: nothing generated, input log-probs aligned with input_ids[4:]
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    assert meta["input_token_logprobs"][0] == [None, ids[4], None]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[4:]
    assert meta["input_top_logprobs"][0] is None and all(len(t) == 3 for t in meta["input_top_logprobs"][1:])

    teacher = EngineTeacher("b", servers["b"].urls, vocab_size=TOK.vocab_size, top_k=4)
    try:
        samples = make_samples(6)
        teacher.score(samples)
        ref = reference_scores(reference_model(ckpts["b"]), samples, k=4)
        for s, (chosen, top) in zip(samples, ref):
            t = s.teacher
            assert t.error is None and t.source == f"b@{url}"
            assert len(t.logp) == len(s.response_ids) == len(t.topk_ids) == len(t.topk_logp)
            torch.testing.assert_close(torch.tensor(t.logp), chosen, rtol=0, atol=1e-5)
            torch.testing.assert_close(torch.tensor(t.topk_logp), top.values, rtol=0, atol=1e-5)
            assert t.topk_ids == top.indices.tolist()
    finally:
        teacher.close()


@torch.no_grad()
def response_rows(model, s: Sample) -> torch.Tensor:
    """[len(response), V] log-probs of every response position, from one plain forward."""
    lp = torch.log_softmax(model(torch.tensor([s.prompt_ids + s.response_ids])).logits.float(), -1)[0]
    p = len(s.prompt_ids)
    return lp[p - 1 : p - 1 + len(s.response_ids)]


def test_token_ids_logprob_is_sglangs_and_equals_a_plain_forward(servers, ckpts):
    """SGLang's `token_ids_logprob`: the log-probs of the given ids at every scored input position
    (`input_token_ids_logprobs`, the first entry None as `input_top_logprobs` is padded) and per
    generated token (`output_token_ids_logprobs`); bad ids are a 400 naming the field."""
    import asyncio

    from mcore_rl.rollout.client import EngineClient, EngineHTTPError

    url = servers["b"].urls[0]
    model = reference_model(ckpts["b"])
    prompts = [[TOK.bos_id] + TOK.encode("3 + 4 = 7"), [TOK.bos_id] + TOK.encode("12 + 30 = 42!")]
    ids = [[5, 65, TOK.vocab_size - 1, 65], [TOK.eos_id, 70]]  # order kept, duplicates too

    async def call(**body):
        async with EngineClient(url, retries=0) as c:
            return await c.generate(**body)

    def refused(**body) -> str:
        with pytest.raises(EngineHTTPError) as err:
            asyncio.run(call(**body))
        assert err.value.status == 400
        return err.value.message

    outs = asyncio.run(
        call(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=2,
            token_ids_logprob=ids,
        )
    )  # one list per prompt of the batch
    for prompt, want, out in zip(prompts, ids, outs):
        meta = out["meta_info"]
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits.float(), -1)[0]
        entries = meta["input_token_ids_logprobs"]
        assert len(entries) == len(meta["input_token_logprobs"]) == len(prompt) - 2 and entries[0] is None
        for j, e in enumerate(entries[1:]):  # position 2 + j, which predicts prompt[3 + j]
            assert [x[1] for x in e] == want and all(x[2] is None for x in e)
            torch.testing.assert_close(torch.tensor([x[0] for x in e]), lp[2 + j, want], rtol=0, atol=1e-5)
        assert meta["output_token_ids_logprobs"] == []
    # one list for every prompt, generated tokens, text in the entries
    greedy = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    outs = asyncio.run(
        call(
            input_ids=prompts,
            sampling_params=greedy,
            return_logprob=True,
            token_ids_logprob=ids[1],
            return_text_in_logprobs=True,
        )
    )
    for prompt, out in zip(prompts, outs):
        meta = out["meta_info"]
        assert meta["input_token_ids_logprobs"] == [None]  # logprob_start_len -1: the last prompt token only
        full = prompt + out["output_ids"]
        lp = torch.log_softmax(model(torch.tensor([full])).logits.float(), -1)[0]
        gen = meta["output_token_ids_logprobs"]
        assert len(gen) == len(out["output_ids"]) == 3
        for j, e in enumerate(gen):
            assert [x[1] for x in e] == ids[1] and [x[2] for x in e] == [TOK.decode([t]) for t in ids[1]]
            torch.testing.assert_close(
                torch.tensor([x[0] for x in e]), lp[len(prompt) - 1 + j, ids[1]], rtol=0, atol=1e-5
            )
    plain = asyncio.run(call(input_ids=prompts[0], sampling_params=greedy, return_logprob=True))
    assert (
        "input_token_ids_logprobs" not in plain["meta_info"] and "output_token_ids_logprobs" not in plain["meta_info"]
    )

    one = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    assert "token_ids_logprob: expected integer token ids" in refused(**one, token_ids_logprob=[1, "x"])
    assert "token_ids_logprob: expected integer token ids" in refused(**one, token_ids_logprob=[1, 2.0])
    assert (
        f"token_ids_logprob contains out-of-vocabulary token id {TOK.vocab_size}; valid range is [0, {TOK.vocab_size})."
    ) in refused(**one, token_ids_logprob=[1, TOK.vocab_size])  # SGLang's wording
    assert "token_ids_logprob contains out-of-vocabulary token id -1" in refused(**one, token_ids_logprob=[-1])
    assert "token_ids_logprob: a list of lists needs a batch" in refused(**one, token_ids_logprob=[[1]])
    assert "token_ids_logprob: expected a list of token ids" in refused(**one, token_ids_logprob=True)
    batch = {**one, "input_ids": prompts}
    assert "token_ids_logprob: 3 lists for a batch of 2 prompts" in refused(**batch, token_ids_logprob=[[1], [2], [3]])
    assert "(batch item 1)" in refused(**batch, token_ids_logprob=[[1], [2, 1000]])


def test_a_reference_teacher_scores_the_teachers_tokens_and_top_k_ids(servers, ckpts):
    """The reference (π_Tref, checkpoint a) scores what the teacher (b) scored: the sampled tokens and
    exactly the teacher's top-k ids per position, equal to a plain forward of a; from the trainer's
    thread and from another event loop (the async scheduler's); a reference that fails marks the sample."""
    import asyncio

    from tests.helpers import _free_port

    teacher = EngineTeacher("b", servers["b"].urls, vocab_size=TOK.vocab_size, top_k=4)
    ref = EngineTeacher("a", servers["a"].urls[:1], vocab_size=TOK.vocab_size)
    dead = EngineTeacher(
        "gone", [f"http://127.0.0.1:{_free_port()}"], vocab_size=TOK.vocab_size, timeout=5, health_interval=60.0
    )
    teacher.reference = ref
    try:
        samples = make_samples(5)
        teacher.score(samples[:3])
        asyncio.run(teacher.ascore(samples[3:]))
        main = reference_scores(reference_model(ckpts["b"]), samples, k=4)
        ref_model = reference_model(ckpts["a"])
        for s, (chosen, top) in zip(samples, main):
            t = s.teacher
            assert t.error is None and t.topk_ids == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(t.logp), chosen, rtol=0, atol=1e-5)
            rows = response_rows(ref_model, s)
            assert len(t.ref_logp) == len(t.ref_topk_logp) == len(s.response_ids)
            torch.testing.assert_close(
                torch.tensor(t.ref_logp), rows.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0], rtol=0, atol=1e-5
            )
            torch.testing.assert_close(
                torch.tensor(t.ref_topk_logp), rows.gather(1, torch.tensor(t.topk_ids)), rtol=0, atol=1e-5
            )
        teacher.reference = dead
        start = time.monotonic()
        late = make_samples(2, seed=3)
        teacher.score(late)  # does not raise
        assert time.monotonic() - start < 30
        assert all(s.teacher.error.startswith("reference gone:") and s.teacher.logp == [] for s in late)
    finally:
        for t in (teacher, ref, dead):
            t.close()


def _direct_opd_world(rank: int, world_size: int, tmp: str, url_teacher: str, url_ref: str, ckpt_ref: str) -> None:
    from mcore_rl.runtime import run_rl
    from mcore_rl.runtime.loop import RLRun
    from mcore_rl.train.rl_step import Learner

    from mcore_rl.algos.distill.direct_opd import adapt_alpha

    opd = [
        "distill.losses=[{name: direct_opd}]",
        "distill.top_k=2",
        "algorithm.reference_model=true",
        f"teachers=[{{kind: engine, name: post, urls: ['{url_teacher}'], top_k: 2, reference: pre}}, "
        f"{{kind: engine, name: pre, urls: ['{url_ref}']}}]",
    ]
    cfg = small(f"run_dir={tmp}/one", *opd)
    validate_rl_config(cfg, 1)
    run = RLRun(cfg)
    try:  # RLRun.teach: the reference's scores of the student's samples at the teacher's top-k ids
        run.initialise()
        samples, _ = run.rollouts()
        metrics = run.teach(samples, Learner(cfg, run.chunks, run.optimizer, run.ref_chunks, run.tokenizer.pad_id))
        assert metrics["teacher/post/error_frac"] == 0 and metrics["teacher/pre/error_frac"] == 0
        assert metrics["teacher/pre/samples"] == len(samples) and "teacher/pre/samples" in metrics
        ref_model = reference_model(ckpt_ref)
        for s in samples:
            rows = response_rows(ref_model, s)
            torch.testing.assert_close(
                torch.tensor(s.teacher.ref_logp),
                rows.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0],
                rtol=0,
                atol=1e-5,
            )
            torch.testing.assert_close(
                torch.tensor(s.teacher.ref_topk_logp),
                rows.gather(1, torch.tensor(s.teacher.topk_ids)),
                rtol=0,
                atol=1e-5,
            )
    finally:
        run.close()
    for mode, extra in (
        ("sync", []),
        (
            "async",
            [
                "rollout.runtime=async",
                "rollout.max_staleness=1",
                "rollout.request_timeout_s=20",
                "rollout.max_running_requests=32",
            ],
        ),
    ):
        summary = run_rl(small(f"run_dir={tmp}/{mode}", *opd, *extra))
        assert summary["state"]["rl_step"] == 2
        with open(f"{tmp}/{mode}/metrics.jsonl") as f:
            recs = [json.loads(line) for line in f]
        assert len(recs) == 2
        for r in recs:
            assert r["teacher/post/error_frac"] == 0 and r["teacher/pre/error_frac"] == 0
            assert r["teacher/routed_frac"] == 1 and "teacher/pre/routed_frac" not in r
            assert math.isfinite(r["distill/direct_opd/shift_mean"]) and r["distill/direct_opd/shift_mean"] != 0
            assert math.isfinite(r["distill/direct_opd/loss"])
            if mode == "async":  # scored right after the rewards, the reference too
                assert r["teacher/engine_scored_late_frac"] == 0

    # the KL weight α adapts from step to step (α₀ = 1, then ×(1 ± 0.01) with the sign of the last
    # step's shift mean) and a run resumed from the step-2 checkpoint goes on with the same α
    def alphas(run_dir: str) -> list[tuple[int, float, float]]:
        with open(f"{run_dir}/metrics.jsonl") as f:
            recs = [json.loads(line) for line in f]
        return [(r["rl_step"], r["distill/direct_opd/alpha"], r["distill/direct_opd/shift_mean"]) for r in recs]

    ckpt = f"{tmp}/ckpt"
    run_rl(
        small(
            f"run_dir={tmp}/full",
            *opd,
            "train.num_steps=4",
            f"checkpoint.save_dir={ckpt}",
            "checkpoint.save_interval=2",
        )
    )
    full = alphas(f"{tmp}/full")
    assert [x[0] for x in full] == [1, 2, 3, 4] and full[0][1] == 1.0
    for (_, a, shift), (_, a_next, _) in zip(full, full[1:]):
        assert a_next == pytest.approx(adapt_alpha(a, shift), rel=1e-12)
    assert len({a for _, a, _ in full}) > 1  # it moved
    run_rl(small(f"run_dir={tmp}/resumed", *opd, "train.num_steps=4", f"checkpoint.load_dir={ckpt}/iter_0000002"))
    resumed = alphas(f"{tmp}/resumed")
    assert [x[0] for x in resumed][-2:] == [3, 4]
    assert resumed[-2][1] == full[2][1] != 1.0  # α of step 3 comes from the checkpoint, not from α₀
    assert resumed[-1][1] == pytest.approx(full[3][1], rel=1e-12)


def test_direct_opd_with_a_reference_teacher_in_a_trainer_world(tmp_path, servers, ckpts):
    """Direct-OPD from YAML: teacher b with reference a (two `mcore-rl serve` processes with other
    weights); the reference's scores are a plain forward of a at the teacher's ids, and two steps of
    a sync and of an async run train with `distill/direct_opd/...` logged. Its KL weight α adapts
    across four steps and a run resumed from the step-2 checkpoint continues with the same α."""
    from tests.world import run_world

    run_world(1, _direct_opd_world, str(tmp_path), servers["b"].urls[0], servers["a"].urls[0], ckpts["a"])


def test_tokenizer_and_reachability_are_checked_before_training(servers, ckpts):
    same = EngineTeacher("a", servers["a"].urls, vocab_size=TOK.vocab_size)
    try:
        same.check(TOK, "teachers[0] (a)")  # the student's tokenizer: passes
    finally:
        same.close()
    other = EngineTeacher("o", servers["other_tok"].urls, vocab_size=TOK.vocab_size)
    try:
        with pytest.raises(
            TeacherError,
            match=r"teachers\[1\] \(o\).*does not share the student's tokenizer.*"
            r"/tokenize of '<bos>'",
        ):
            other.check(TOK, "teachers[1] (o)")
    finally:
        other.close()
    from tests.helpers import _free_port

    dead = f"http://127.0.0.1:{_free_port()}"
    gone = EngineTeacher("d", [servers["b"].urls[0], dead], vocab_size=TOK.vocab_size)
    try:
        with pytest.raises(TeacherError, match=rf"teachers\[2\] \(d\): the teacher engine {dead} is unreachable"):
            gone.check(TOK, "teachers[2] (d)")
    finally:
        gone.close()


def test_routing_by_domain_ui_mopd(servers):
    """UI-MOPD, testable property 2: changing the desktop teacher's log-probs changes the loss only
    on desktop-tagged samples (and teachers are never mixed within a sample)."""
    from mcore_rl.algos.kl import kl_estimate
    from mcore_rl.train.packing import sequence_view

    assert route_by_domain([["desktop"], ["mobile"], []], ["mobile", "desktop", "web", ""]) == [1, 0, 2, 2]
    assert route_by_domain([["desktop"]], ["mobile", "desktop"]) == [None, 0]

    def k3_per_sample(samples):
        view = sequence_view(samples)
        teacher = torch.zeros_like(view.rollout_logp)
        for i, s in enumerate(samples):
            teacher[i, : len(s.teacher.logp)] = torch.tensor(s.teacher.logp)
        return (kl_estimate(view.rollout_logp, teacher, "k3") * view.mask).sum(1)

    def score(desktop_urls):
        samples = make_samples(12, domains=("desktop", "mobile", "web"))
        teachers = [
            EngineTeacher("desktop", desktop_urls, vocab_size=TOK.vocab_size),
            EngineTeacher("mobile", servers["b"].urls, vocab_size=TOK.vocab_size),
        ]
        try:
            routes = route_by_domain([["desktop"], ["mobile"]], [s.prompt.domain for s in samples])
            for i, t in enumerate(teachers):
                t.score([s for s, r in zip(samples, routes) if r == i])
        finally:
            for t in teachers:
                t.close()
        return samples

    # the desktop teacher replaced by one with other weights (its tokenizer does not matter to scoring by ids)
    first, second = score(servers["a"].urls[:1]), score(servers["other_tok"].urls)
    for s in first:
        want = {"desktop": "desktop@", "mobile": "mobile@"}.get(s.prompt.domain)
        assert (s.teacher is None) if want is None else s.teacher.source.startswith(want)
    web = [i for i, s in enumerate(first) if s.prompt.domain == "web"]
    for samples in (first, second):
        for i in web:  # no teacher: no distillation term
            samples[i].teacher = samples[i].teacher or type(first[0].teacher)(logp=list(samples[i].rollout_logp))
    before, after = k3_per_sample(first), k3_per_sample(second)
    for i, s in enumerate(first):
        if s.prompt.domain == "desktop":
            assert before[i] != after[i]
        else:
            assert before[i] == after[i]
            assert first[i].teacher.logp == second[i].teacher.logp


def test_a_teacher_engine_killed_mid_run_costs_its_requests_not_the_run(servers, ckpts):
    procs = servers["a"]
    teacher = EngineTeacher(
        "a", procs.urls, vocab_size=TOK.vocab_size, top_k=2, max_concurrency=64, timeout=30, health_interval=60.0
    )
    try:
        samples = make_samples(160, prompt_len=24, response_len=60)
        seen_busy = []

        def kill_when_busy() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if _load(procs.urls[0]) > 0:
                    seen_busy.append(True)
                    os.kill(procs.pids[0], signal.SIGKILL)  # engine 0, while it holds requests
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        teacher.score(samples)
        killer.join()
        assert seen_busy, "engine 0 never had requests in flight"
        assert not procs.alive(0)
        assert all(s.teacher.error is None for s in samples)  # every request was answered (failover)
        sources = {s.teacher.source for s in samples}
        assert f"a@{procs.urls[1]}" in sources
        ref = reference_scores(reference_model(ckpts["a"]), samples[::16], k=2)
        for s, (chosen, top) in zip(samples[::16], ref):
            torch.testing.assert_close(torch.tensor(s.teacher.logp), chosen, rtol=0, atol=1e-5)
            assert s.teacher.topk_ids == top.indices.tolist()

        os.kill(procs.pids[1], signal.SIGKILL)  # now every engine of this teacher is dead
        deadline = time.monotonic() + 10
        while procs.alive(1) and time.monotonic() < deadline:
            time.sleep(0.05)
        late = make_samples(8, seed=1)
        start = time.monotonic()
        teacher.score(late)  # does not raise
        assert time.monotonic() - start < 20
        assert all(s.teacher is not None and s.teacher.error and not s.teacher.logp for s in late)
    finally:
        teacher.close()


# ------------------------------------------------------------------------------- config

SMALL = [
    "train.num_steps=2",
    "train.seq_length=64",
    "train.micro_batch_size=8",
    "data.synthetic_max_digits=1",
    "data.synthetic_num_prompts=500",
    "rollout.group_size=4",
    "rollout.prompts_per_step=2",
    "rollout.max_new_tokens=12",
    "rollout.context_length=256",
    "algorithm.num_minibatches=1",
    "reward.name=tests.reward_fns:digit_count",
    "eval.interval=0",
    "eval.at_start=false",
    "eval.num_prompts=4",
    "eval.k=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
]


def small(*overrides: str, yaml_path: str | None = None) -> RLConfig:
    return load_config(RLConfig, yaml_path, SMALL + list(overrides))


def test_example_recipe_and_config_errors(tmp_path, ckpts):
    cfg = load_config(RLConfig, os.path.join(os.path.dirname(__file__), "..", "configs", "distill_teachers.yaml"))
    validate_rl_config(cfg, 1)
    assert [t.kind for t in cfg.teachers] == ["engine", "privileged", "frozen"]

    def errors(yaml_text: str) -> str:
        path = tmp_path / "r.yaml"
        path.write_text(yaml_text)
        with pytest.raises(ConfigError) as info:
            validate_rl_config(small(yaml_path=str(path)), 1)
        return str(info.value)

    msg = errors(
        "teachers:\n  - {kind: engine, urls: ['http://127.0.0.1:1'], domains: [math]}\n"
        "  - {kind: frozen, domains: [math, code]}\n"
    )
    assert "teachers[1].domains" in msg and "'math' is also routed to teachers[0]" in msg
    assert "teachers: teachers [0, 1] all have no domains" in errors(
        "teachers:\n  - {kind: frozen}\n  - {kind: privileged}\n"
    )
    msg = errors(
        "teachers:\n  - {kind: engine}\n  - {kind: privileged, top_k: 400, domains: [x], urls: ['http://a']}\n"
    )
    assert "teachers[0].urls: an engine teacher needs either urls" in msg
    assert "teachers[1].top_k: must be in [0, model.vocab_size=384]" in msg
    assert "teachers[1].urls: only applies to kind 'engine'" in msg
    msg = errors(f"teachers:\n  - {{kind: engine, model_path: {tmp_path}, urls: ['ftp://x']}}\n")
    assert "got both" in msg and "teachers[0].urls[0]: must be an http(s) URL" in msg
    assert "teachers[0].model_path" in msg
    assert "teachers[0].template: must contain '{context}'" in errors(
        "teachers:\n  - {kind: privileged, template: 'no placeholder'}\n"
    )
    msg = errors(
        "teachers:\n  - {kind: privileged, refresh_interval: -1, checkpoint: x, domains: [a]}\n"
        "  - {kind: engine, urls: ['http://127.0.0.1:1'], refresh_interval: 2}\n"
    )
    assert "teachers[0].refresh_interval: must be >= 0 (0 = the current policy), got -1" in msg
    assert "teachers[0].checkpoint: only applies to kind 'frozen' (this one is 'privileged')" in msg
    assert "teachers[1].refresh_interval: only applies to kinds 'frozen' and 'privileged'" in msg
    with pytest.raises(ConfigError, match=r"teachers\[0\]\.kind"):
        small("teachers=[{kind: oracle}]")


# ------------------------------------------------------------------------------- in a trainer world


def _world(rank: int, world_size: int, tmp: str, ckpt_a: str, url_b: str, url_other: str) -> None:
    from mcore_rl.runtime import run_rl
    from mcore_rl.runtime.loop import RLRun
    from mcore_rl.train.rl_step import Learner
    from mcore_rl.train.forward_backward import attention_mask_from_segments
    from mcore_rl.train.packing import build_microbatches
    from mcore_rl.train.teachers import FrozenTeacher, PolicyCopy, PrivilegedTeacher, privileged_context, token_topk

    # 1. an engine teacher the trainer starts on a checkpoint; a mismatched one is refused first
    bad = small(f"run_dir={tmp}/bad", f"teachers=[{{kind: engine, name: wrong, urls: ['{url_other}']}}]")
    with pytest.raises(TeacherError, match=r"teachers\[0\] \(wrong\).*does not share the student's tokenizer"):
        RLRun(bad).initialise()
    cfg = small(
        f"run_dir={tmp}/one",
        "rollout.health_check_interval_s=60",
        f"teachers=[{{kind: engine, name: big, model_path: {ckpt_a}, num_engines: 2, top_k: 2}}]",
    )
    run = RLRun(cfg)
    try:
        run.initialise()
        samples, _ = run.rollouts()
        learner = Learner(cfg, run.chunks, run.optimizer, run.ref_chunks, run.tokenizer.pad_id)
        metrics = run.teach(samples, learner)
        assert metrics["teacher/big/error_frac"] == 0 and metrics["teacher/engine_scored_late_frac"] == 1
        ref = reference_scores(reference_model(ckpt_a), samples, k=2)
        for s, (chosen, top) in zip(samples, ref):
            torch.testing.assert_close(torch.tensor(s.teacher.logp), chosen, rtol=0, atol=1e-5)
            assert s.teacher.topk_ids == top.indices.tolist() and s.teacher.source.startswith("big@")
        # the trainer's teacher engines killed by pid between steps: one, then both; the run goes on
        procs = run.teachers.teachers[0].pool.processes
        os.kill(procs.pids[0], signal.SIGKILL)
        more, _ = run.rollouts()
        assert run.teach(more, learner)["teacher/big/error_frac"] == 0
        assert {s.teacher.source for s in more} == {f"big@{procs.urls[1]}"}
        os.kill(procs.pids[1], signal.SIGKILL)
        while procs.alive(1):
            time.sleep(0.05)
        last, _ = run.rollouts()
        assert run.teach(last, learner)["teacher/big/error_frac"] == 1
        assert all(s.teacher.error and s.teacher.logp == [] for s in last)

        # 2. privileged context: the policy on answer + prompt, the same response tokens
        def logprobs(ss, t, chunks):
            return learner.token_logprobs(ss, t, chunks=chunks)[0]

        priv = PrivilegedTeacher(
            "priv", run.tokenizer, cfg.train.seq_length, context="answer", template="Answer: {context}\n"
        )
        batch = [s for s in samples]
        for s in batch:
            s.teacher = None
        batch[1].prompt = type(batch[1].prompt)(**{**batch[1].prompt.__dict__, "label": None})
        priv.score(batch, batch, logprobs)
        assert batch[1].teacher.error == "no privileged context" and batch[1].teacher.logp == []
        copy = priv.privileged_samples([batch[0]], batch)[0]
        assert copy.prompt_ids[0] == run.tokenizer.bos_id
        assert copy.prompt_ids[1 : len(copy.prompt_ids) - len(batch[0].prompt_ids) + 1] == run.tokenizer.encode(
            f"Answer: {batch[0].prompt.label}\n"
        )
        t = max(len(s.response_ids) for s in batch)
        want = logprobs([copy], t, None)[0, : len(batch[0].response_ids)]
        plain = logprobs([batch[0]], t, None)[0, : len(batch[0].response_ids)]
        torch.testing.assert_close(torch.tensor(batch[0].teacher.logp), want)
        assert not torch.allclose(want, plain)  # the context changes the teacher's view
        # peer context: the best other sample of the group (none good enough: marked)
        group = [s for s in batch if s.group == batch[0].group]
        best = max(group[1:], key=lambda s: s.reward)
        assert privileged_context(group[0], batch, "peer", peer_min_reward=-1e9) == best.text
        assert privileged_context(group[0], batch, "peer", peer_min_reward=1e9) is None
        too_long = PrivilegedTeacher("long", run.tokenizer, 8, context="answer")
        too_long.score(batch[:1], batch, logprobs)
        assert "longer than train.seq_length" in batch[0].teacher.error

        # 3. a frozen copy: fixed until refreshed, then the current policy; its top-k from the
        #    vocab-parallel logits equals the top-k of the full logits
        frozen = FrozenTeacher("old", cfg, run.chunks, refresh_interval=2, version=run.state.version, top_k=3)

        def topk(ss, t, chunks):
            return token_topk(
                chunks,
                ss,
                t,
                3,
                seq_length=cfg.train.seq_length,
                micro_batch_size=cfg.train.micro_batch_size,
                pad_id=run.tokenizer.pad_id,
            )

        frozen.score(batch, batch, logprobs, topk)
        mb = build_microbatches(
            batch, range(len(batch)), cfg.train.seq_length, cfg.train.micro_batch_size, 0, 1, run.tokenizer.pad_id, t
        )[0]
        with torch.no_grad():
            logits = frozen.chunks[0](mb["tokens"], mb["position_ids"], attention_mask_from_segments(mb["segment_ids"]))
        full = torch.log_softmax(logits.float(), -1).reshape(-1, logits.shape[-1])
        for j, i in enumerate(mb["seq_index"].tolist()):
            n = len(batch[i].response_ids)
            want = full[mb["seq_pos"][j, :n]].topk(3, dim=-1)
            assert batch[i].teacher.topk_ids == want.indices.tolist()
            torch.testing.assert_close(torch.tensor(batch[i].teacher.topk_logp), want.values, rtol=0, atol=1e-5)
            sampled = full[mb["seq_pos"][j, :n]].gather(1, torch.tensor(batch[i].response_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(batch[i].teacher.logp), sampled, rtol=0, atol=1e-5)
        start = [list(s.teacher.logp) for s in batch]
        assert batch[0].teacher.source == "frozen:1"
        policy_now = logprobs(batch, t, None)
        for i, s in enumerate(batch):
            torch.testing.assert_close(torch.tensor(start[i]), policy_now[i, : len(s.response_ids)])
        # a stale privileged teacher (StepOPSD's): a copy of the policy taken every 2 steps, with the context
        stale = PrivilegedTeacher(
            "stale",
            run.tokenizer,
            cfg.train.seq_length,
            context="answer",
            template="Answer: {context}\n",
            copy=PolicyCopy(cfg, run.chunks, 2, None, run.state.version),
        )
        n0 = len(batch[0].response_ids)
        before = logprobs([copy], t, None)[0, :n0]  # the current policy with the context
        stale.score(batch[:1], batch, logprobs)
        assert batch[0].teacher.source == f"stale:{run.state.version}"
        torch.testing.assert_close(torch.tensor(batch[0].teacher.logp), before)
        for s in batch:
            s.teacher = None
        with torch.no_grad():  # the policy moves (as after an update)
            for p in run.chunks[0].parameters():
                p.add_(0.05 * torch.randn_like(p))
        frozen.step_done(1, 2)  # not a refresh step
        frozen.score(batch, batch, logprobs)
        assert [s.teacher.logp for s in batch] == start
        moved = logprobs(batch, t, None)
        assert not torch.allclose(moved[0, : len(batch[0].response_ids)], torch.tensor(start[0]))
        frozen.step_done(2, 3)
        frozen.score(batch, batch, logprobs)
        assert batch[0].teacher.source == "frozen:3"
        torch.testing.assert_close(torch.tensor(batch[0].teacher.logp), moved[0, : len(batch[0].response_ids)])
        stale.step_done(1, 2)  # the policy moved, the stale teacher did not
        stale.score(batch[:1], batch, logprobs)
        torch.testing.assert_close(torch.tensor(batch[0].teacher.logp), before)
        stale.step_done(2, 3)  # now it reads the moved policy, with the context
        stale.score(batch[:1], batch, logprobs)
        moved_priv = logprobs([copy], t, None)[0, :n0]
        assert batch[0].teacher.source == "stale:3" and not torch.allclose(moved_priv, before)
        torch.testing.assert_close(torch.tensor(batch[0].teacher.logp), moved_priv)
    finally:
        run.close()

    # 4. short runs: sync with a privileged teacher with top-k on a copy of the policy taken every step (an
    #    engine one for another domain); async with the engine teacher scoring right after the rewards (off the
    #    learner's path)
    sync = (
        f"teachers=[{{kind: engine, urls: ['{url_b}'], domains: [other]}}, "
        "{kind: privileged, name: hint, top_k: 2, refresh_interval: 1}]"
    )
    summary = run_rl(small(f"run_dir={tmp}/sync", sync))
    assert summary["state"]["rl_step"] == 2
    with open(f"{tmp}/sync/metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert all(r["teacher/hint/error_frac"] == 0 and r["teacher/routed_frac"] == 1 for r in recs)
    teachers = f"teachers=[{{kind: engine, name: eng, urls: ['{url_b}']}}, {{kind: frozen, domains: [other]}}]"
    run_rl(
        small(
            f"run_dir={tmp}/async",
            teachers,
            "rollout.runtime=async",
            "rollout.max_staleness=1",
            "rollout.request_timeout_s=20",
            "rollout.max_running_requests=32",
        )
    )
    with open(f"{tmp}/async/metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert all(r["teacher/eng/error_frac"] == 0 and r["teacher/engine_scored_late_frac"] == 0 for r in recs)


def test_teachers_in_a_trainer_world(tmp_path, servers, ckpts):
    from tests.world import run_world

    run_world(1, _world, str(tmp_path), ckpts["a"], servers["b"].urls[0], servers["other_tok"].urls[0])


def _tp2_topk(rank: int, store: str) -> None:
    import torch.distributed as dist

    from mcore_rl.train.teachers import vocab_parallel_topk

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        g = torch.Generator().manual_seed(0)
        hidden, weight = torch.randn(37, 16, generator=g), torch.randn(50, 16, generator=g)
        shard = weight.chunk(2)[rank]  # rows rank*25 ... (rank+1)*25
        vals, ids = vocab_parallel_topk(hidden, shard, 7, temperature=0.7, chunk_size=8, tp_group=dist.group.WORLD)
        want = torch.log_softmax(hidden @ weight.t() / 0.7, -1).topk(7, dim=-1)
        torch.testing.assert_close(vals, want.values)
        assert torch.equal(ids, want.indices)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_topk_over_two_tensor_parallel_ranks(tmp_path):
    """Two gloo ranks, each with half of the vocabulary (no megatron needed: a plain process group)."""
    import torch.multiprocessing as mp

    mp.spawn(_tp2_topk, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def test_the_answer_context_of_a_structured_label_is_its_answer_not_the_whole_entry() -> None:
    """A reasoning-gym label is its generator's entry (question, answer, metadata); the privileged
    teacher must see the answer, not the metadata's dict."""
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.data.tasks.reasoning_gym import ReasoningGymTask
    from mcore_rl.train.teachers import answer_of_label, privileged_context

    question, entry = ReasoningGymTask("gcd", max_value=30).rl_examples(1, 7)[0]
    prompt = Prompt(index=0, text=question, ids=[1, 2], label=entry)
    sample = Sample(prompt, group=0, response_ids=[3], rollout_logp=[-1.0], policy_version=0, finish_reason="stop")
    assert privileged_context(sample, [sample], "answer") == str(entry["answer"])
    assert answer_of_label("42") == "42" and answer_of_label(7) == "7"
    assert answer_of_label({"question": "q"}) is None and answer_of_label("") is None and answer_of_label(None) is None
