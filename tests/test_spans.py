"""StepOPSD's tagged step spans (`agent/spans.py`, `environment.distill_span_tags`): which response
tokens lie inside an action's tags, on the real episode runner's samples (step-wise and conversation),
the learner's distillation mask multiplied by it, StepOPSD leaving every other token's advantage as
it was, and the config rules."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from mcore_rl.agent.spans import char_spans, tagged_token_mask, token_offsets
from mcore_rl.data.samples import DISTILL_SPAN, Prompt, Sample, TeacherScores
from mcore_rl.rollout.pool import Generation, GenRequest
from tests.helpers import TOK

TAGS = ("<action>", "</action>")


def test_char_spans_are_the_insides_of_closed_pairs_left_to_right():
    text = "think <action>up</action> more <action>left</action> <action>open"
    assert [text[a:b] for a, b in char_spans(text, *TAGS)] == ["up", "left"]
    assert char_spans("no tags", *TAGS) == [] and char_spans("<action>never closed", *TAGS) == []
    assert [t[a:b] for t in ["```py\nx=1\n```"] for a, b in char_spans(t, "```", "```")] == ["py\nx=1\n"]


@pytest.mark.parametrize("text", ["I will go <action>down</action>.", "é: <action>déjà vu</action> ü"])
def test_exactly_the_tokens_inside_the_tags_are_marked_even_when_tokens_split_characters(text):
    ids = TOK.encode(text)
    mask = tagged_token_mask(ids, TOK.decode, *TAGS)
    offsets = token_offsets(ids, TOK.decode)
    assert len(mask) == len(ids) and offsets[-1][1] == len(TOK.decode(ids))
    inside = TOK.decode([i for i, m in zip(ids, mask) if m])
    assert inside == text.split("<action>")[1].split("</action>")[0]  # not the tags, nothing outside
    assert tagged_token_mask(TOK.encode("no action here"), TOK.decode, *TAGS) == [0] * len(TOK.encode("no action here"))


def _episode(trajectory: str, replies: list[str]):
    from mcore_rl.agent.episodes import Episode, EpisodeSettings, run_episode
    from mcore_rl.envs import env_prompts, make_env

    options = {"lo": 1, "hi": 99, "max_guesses": 3}  # three wrong guesses: the episode plays every reply
    text, label = env_prompts("guess_number", **options).examples(1, 0)[0]
    label = 42  # the secret
    env = make_env("guess_number", **options)
    settings = EpisodeSettings(trajectory=trajectory, max_turns=3, max_tokens_per_turn=40, distill_span_tags=TAGS)
    e = Episode(env, Prompt(index=0, text=text, ids=[1], label=label), 0, 0, TOK, settings, {})
    turns = iter(replies)

    async def generate(req: GenRequest) -> Generation:
        text = next(turns)
        ids = TOK.encode(text)
        return Generation(ids, [-1.0] * len(ids), 0, "stop", text, "e0")

    asyncio.run(run_episode(e, generate))
    return e


def test_every_step_sample_carries_its_action_span():
    replies = ["I think low. <action>3</action>", "no tags, just 5", "<action>7</action> done"]
    e = _episode("stepwise", replies)
    assert e.error is None and e.turns == 3
    samples = e.samples()
    assert len(samples) == 3
    for s, reply in zip(samples, replies):
        span = s.info[DISTILL_SPAN]
        assert len(span) == len(s.response_ids)
        want = reply.split("<action>")[1].split("</action>")[0] if "<action>" in reply else ""
        assert TOK.decode([i for i, m in zip(s.response_ids, span) if m]) == want


def test_a_conversation_marks_only_the_models_tagged_tokens_never_an_observation():
    e = _episode("conversation", ["<action>3</action>", "<action>5</action>", "<action>7</action>"])
    assert e.error is None and e.turns == 3
    (s,) = e.samples()
    span = s.info[DISTILL_SPAN]
    assert s.trainable is not None and len(span) == len(s.response_ids)
    assert all(t for m, t in zip(span, s.trainable) if m)  # only the model's tokens
    assert TOK.decode([i for i, m in zip(s.response_ids, span) if m]) == "357"


def _sample(k: int, span: list[int] | None) -> Sample:
    s = Sample(Prompt(index=0, text="p", ids=[1, 2]), 0, list(range(3, 3 + k)), [-1.0] * k, 0, "stop", "x")
    s.teacher = TeacherScores(logp=[-0.5] * k, source="test")
    if span is not None:
        s.info[DISTILL_SPAN] = span
    return s


def test_the_learner_distils_only_the_span_and_stepopsd_keeps_every_other_advantage():
    from mcore_rl.algos.distill.base import DistillBatch
    from mcore_rl.algos.distill.stepopsd import stepopsd
    from mcore_rl.train.distillation import teacher_view

    samples = [_sample(4, [0, 1, 1, 0]), _sample(4, None), _sample(3, [0, 0, 0])]
    view = teacher_view(samples, 5, 0, [None] * 3)
    assert view.mask.tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]
    adv = torch.tensor([1.0, -1.0, 1.0])
    student = torch.full((3, 5), -2.0)
    batch = DistillBatch(student, student, view.logp, view.mask, advantages=adv)
    delta = stepopsd(batch, decay_steps=None).token_advantage
    assert delta is not None
    assert (delta[view.mask == 0] == 0).all() and (delta[view.mask > 0] != 0).all()
    with pytest.raises(ValueError, match="has 2 entries for a 4-token response"):
        teacher_view([_sample(4, [1, 1])], 5, 0, [None])


def test_span_tags_are_checked_before_workers_start():
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rl_validate import validate_rl_config

    demo = os.path.join(os.path.dirname(__file__), "..", "configs", "agentic_demo.yaml")
    key = "data.domains[0].environment.distill_span_tags"
    stepopsd = ["distill.losses=[{name: stepopsd}]", "teachers=[{kind: privileged, context: peer_episode}]"]
    validate_rl_config(load_config(RLConfig, demo, [f"{key}=['<action>', '</action>']", *stepopsd]), 1)

    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            validate_rl_config(load_config(RLConfig, demo, list(overrides)), 1)
        return str(info.value)

    assert f"{key}: domain 'guess': must be [] or two non-empty strings [open, close], got ['<a>']" in error(
        f"{key}=['<a>']", *stepopsd
    )
    assert "got ['<a>', '']" in error(f"{key}=['<a>', '']", *stepopsd)
    assert f"{key}: domain 'guess': marks the tokens distillation acts on, but distill.losses names no" in error(
        f"{key}=['<a>', '</a>']"
    )
