"""SEED's analyzer (`agent/hindsight.py`): after a group's episodes, the engines that played them write
one lesson per episode from its transcript; the lesson reaches every sample of that episode as
`privileged/hindsight_skill` (never another episode's, never the policy's prompt), an aborted analysis
leaves its episode without one; the config checks; stage 1's SFT lines (`tools/make_seed_sft.py`)
read back as `mcore-rl sft` data. The real episode runner and environments, a scripted generator."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from mcore_rl.agent.hindsight import INFO_KEY, analysis_messages, sft_example, transcript
from mcore_rl.config.rl_schema import AnalyzerConfig
from mcore_rl.config import RLConfig, load_config
from mcore_rl.config.errors import ConfigError
from mcore_rl.config.rl_validate import validate_rl_config
from mcore_rl.rollout.pool import Generation, GenRequest
from tests.helpers import TOK

REPO = os.path.join(os.path.dirname(__file__), "..")
DEMO = os.path.join(REPO, "configs", "agentic_demo.yaml")
ANALYZER = "data.domains[0].environment.analyzer={max_new_tokens: 40}"
CONTEXT = "model.max_position_embeddings=1024"  # the demo's 256 do not hold the analyzer's prompt
TEACHER = "teachers=[{kind: privileged, context: info, context_key: privileged/hindsight_skill}]"
SEED = "distill.losses=[{name: seed}]"


def _groups(*overrides: str):
    from mcore_rl.agent.groups import EpisodeGroups, environment_examples
    from mcore_rl.data.samples import Prompt

    cfg = load_config(RLConfig, DEMO, list(overrides))
    validate_rl_config(cfg, 1)
    groups = EpisodeGroups.from_config(cfg, TOK)
    assert groups is not None
    domain = cfg.data.domains[0]
    text, label = environment_examples(domain, 1, 0)[0]
    return cfg, groups, Prompt(index=0, text=text, ids=TOK.encode(text), domain=domain.name, label=label)


def test_each_episode_gets_the_lesson_its_own_analysis_wrote():
    cfg, groups, prompt = _groups(ANALYZER, TEACHER, SEED, CONTEXT)
    analyses: list[GenRequest] = []
    guesses = {11: "10", 12: "90", 13: "50", 14: "25"}  # each episode guesses its own number

    async def generate(req: GenRequest) -> Generation:
        text = TOK.decode(req.input_ids)
        if "You are reviewing an agent's attempt" in text:
            analyses.append(req)
            move = text.split("Move 1: ")[1].split("\n")[0]
            lesson = "" if move == "25" else f"Lesson: after {move}, move towards the hint."
            finish = "abort" if move == "90" else "stop"  # a sync cut this analysis off
            return Generation(TOK.encode(lesson), [-1.0] * len(lesson), 0, finish, lesson, "e0")
        seed = int(req.sampling_params["sampling_seed"])
        guess = next(g for s, g in guesses.items() if (seed - s) % 7919 == 0)
        ids = TOK.encode(guess)
        return Generation(ids, [-1.0] * len(ids), 0, "stop", guess, "e0")

    samplings = [{"temperature": 1.0, "sampling_seed": s} for s in guesses]
    samples = asyncio.run(groups.run_group(prompt, samplings, generate))

    assert len(analyses) == 4  # one analysis per episode, after the episodes
    for req in analyses:
        assert req.sampling_params["max_new_tokens"] == 40 and req.sampling_params["temperature"] == 0.0
        assert req.sampling_params["sampling_seed"] not in guesses  # apart from the turns' draws
    by_episode: dict[int, list] = {}
    for s in samples:
        by_episode.setdefault(s.episode, []).append(s)
    assert len(by_episode) == 4
    for j, guess in enumerate(guesses.values()):
        got = {s.info.get(INFO_KEY) for s in by_episode[j]}
        if guess in ("90", "25"):  # aborted, or an empty lesson: no skill, never another episode's
            assert got == {None}
        else:
            assert got == {f"Lesson: after {guess}, move towards the hint."}
    for s in samples:  # the policy's own prompt never holds the lesson
        assert "Lesson" not in TOK.decode(s.prompt_ids)
    from mcore_rl.agent.episodes import episode_metrics

    assert episode_metrics([samples])["episode/hindsight_lessons"] == 2.0  # of 4 episodes


@pytest.mark.parametrize("overrides", [(), (ANALYZER,)], ids=["no analyzer", "no room in the context"])
def test_no_analysis_is_sent_without_the_analyzer_or_room_for_it(overrides):
    _, groups, prompt = _groups(*overrides)  # the demo's context, 256 tokens: too small for an analysis
    asked = []

    async def generate(req: GenRequest) -> Generation:
        asked.append(TOK.decode(req.input_ids))
        ids = TOK.encode("50")
        return Generation(ids, [-1.0] * len(ids), 0, "stop", "50", "e0")

    samples = asyncio.run(groups.run_group(prompt, [{"temperature": 1.0, "sampling_seed": 3}], generate))
    assert samples and all(INFO_KEY not in s.info for s in samples)
    from mcore_rl.agent.episodes import episode_metrics

    assert episode_metrics([samples]).get("episode/hindsight_lessons") == (0.0 if overrides else None)
    assert not any("You are reviewing" in a for a in asked)


def test_the_transcript_holds_the_task_every_move_and_the_end_and_is_capped():
    from mcore_rl.agent.episodes import Episode, EpisodeSettings, run_episode
    from mcore_rl.data.samples import Prompt
    from mcore_rl.envs import make_env

    env = make_env("frozen_lake", size=4)
    prompt = Prompt(index=0, text="frozen lake", ids=[1], label={"seed": 3}, domain="lake")
    e = Episode(env, prompt, 0, 0, TOK, EpisodeSettings(trajectory="stepwise", max_turns=3), {"sampling_seed": 1})
    moves = iter(["left", "up", "left"])

    async def generate(req: GenRequest) -> Generation:
        m = next(moves)
        return Generation(TOK.encode(m), [-1.0] * len(m), 0, "stop", m, "e0")

    asyncio.run(run_episode(e, generate))
    text = transcript(e)
    assert text.startswith("Task: frozen lake\nState 1: ")
    assert [line for line in text.splitlines() if line.startswith("Move")] == [
        f"Move {t + 1}: {m}" for t, m in enumerate(e.actions)
    ]
    assert text.splitlines()[-1].endswith(f"return {e.episode_return:g}.") and "End: " in text
    short = AnalyzerConfig(max_transcript_chars=80)
    (msg,) = analysis_messages(e, short)
    body = msg["content"].split("\n\n", 1)[1]
    assert len(body) <= 80 + len("\n...\n") and body.startswith("Task: ") and "\n...\n" in body


def test_the_analyzer_and_a_teacher_on_its_lesson_are_checked_before_workers_start():
    validate_rl_config(load_config(RLConfig, DEMO, [ANALYZER, TEACHER, SEED]), 1)

    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            validate_rl_config(load_config(RLConfig, DEMO, list(overrides)), 1)
        return str(info.value)

    msg = error(TEACHER, SEED)  # no analyzer: nothing writes the lesson
    assert "teachers[0].context_key: environment 'guess_number' (domain 'guess') gives no" in msg
    key = "data.domains[0].environment.analyzer"
    msg = error(f"{key}={{max_new_tokens: 0, temperature: -1, max_transcript_chars: 10}}")
    assert f"{key}.max_new_tokens: domain 'guess': must be >= 1, got 0" in msg
    assert f"{key}.temperature: domain 'guess': must be a finite number >= 0, got -1" in msg
    assert f"{key}.max_transcript_chars: domain 'guess': must be >= 64, got 10" in msg
    with pytest.raises(ConfigError, match="did you mean 'data.domains.0..environment.analyzer.max_new_tokens'"):
        load_config(RLConfig, DEMO, [f"{key}={{max_tokens: 5}}"])


def test_stage_one_sft_lines_are_the_analyzers_prompt_and_read_back_as_sft_data(tmp_path):
    """`tools/make_seed_sft.py --policy reader` (a scripted player, the rule analysts as annotator): every
    line's prompt is the analyzer's chat prompt for one played episode, the response its skill with the
    template's closing; `mcore-rl sft`'s reader takes the file as it is."""
    from mcore_rl.config.schema import DataConfig
    from mcore_rl.data.sft import read_examples

    out = tmp_path / "seed_sft.jsonl"
    tool = os.path.join(REPO, "tools", "make_seed_sft.py")
    run = subprocess.run(
        [sys.executable, tool, "--policy", "reader", "--env", "frozen_lake", "--option", "size=4"]
        + ["--tasks", "6", "--group", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["trajectories"] == 12 and summary["kept"] + summary["dropped"] == 12 and summary["kept"] > 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == summary["kept"]
    for line in lines:
        assert line["prompt"].startswith("<|im_start|>user\nYou are reviewing an agent's attempt")
        assert line["prompt"].endswith("<|im_start|>assistant\n") and "Move 1: " in line["prompt"]
        assert line["response"].startswith("From a state like this") and line["response"].endswith("<|im_end|>\n")
    examples = read_examples(DataConfig(path=str(out)))
    assert len(examples) == len(lines) and examples[0].prompt == lines[0]["prompt"]

    with pytest.raises(SystemExit):  # an endpoint annotator needs its URL and model
        from importlib import util

        spec = util.spec_from_file_location("make_seed_sft", tool)
        assert spec is not None and spec.loader is not None
        mod = util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.main(["--policy", "reader", "--annotator", "endpoint", "--out", str(tmp_path / "x.jsonl")])


def test_sft_example_renders_the_same_prompt_the_analyzer_sends():
    from mcore_rl.agent.episodes import Episode, EpisodeSettings
    from mcore_rl.agent.trajectory import ChatFormat
    from mcore_rl.data.samples import Prompt
    from mcore_rl.envs import make_env

    e = Episode(
        make_env("guess_number"),
        Prompt(index=0, text="guess", ids=[1], label={"seed": 1}),
        0,
        0,
        TOK,
        EpisodeSettings(),
        {},
    )
    settings = AnalyzerConfig()
    line = sft_example(e, "  Halve the range each time. ", TOK, settings)
    chat = ChatFormat(TOK)
    assert TOK.encode(line["prompt"]) == chat.prompt_ids(analysis_messages(e, settings))
    assert line["response"] == "Halve the range each time." + chat.closing


def test_the_analysis_prompt_is_cut_to_fit_the_engines_context():
    """The engine refuses a prompt that leaves no room (an analysis must not fail its group): the
    transcript is halved until prompt + lesson fit; when not even a short one fits there is no analysis."""
    from mcore_rl.agent.episodes import Episode, EpisodeSettings, run_episode
    from mcore_rl.agent.hindsight import analysis_ids
    from mcore_rl.agent.trajectory import ChatFormat
    from mcore_rl.data.samples import Prompt
    from mcore_rl.envs import make_env

    env = make_env("frozen_lake", size=4)
    prompt = Prompt(index=0, text="frozen lake", ids=[1], label={"seed": 3}, domain="lake")
    e = Episode(env, prompt, 0, 0, TOK, EpisodeSettings(trajectory="stepwise", max_turns=6), {"sampling_seed": 1})

    async def generate(req: GenRequest) -> Generation:
        return Generation(TOK.encode("up"), [-1.0, -1.0], 0, "stop", "up", "e0")

    asyncio.run(run_episode(e, generate))
    chat = ChatFormat(TOK)
    full = analysis_ids(chat, e, AnalyzerConfig())
    assert full is not None and full == chat.prompt_ids(analysis_messages(e, AnalyzerConfig()))
    fit = analysis_ids(chat, e, AnalyzerConfig(max_new_tokens=40), max_context=len(full) - 10)
    assert fit is not None and len(fit) + 40 <= len(full) - 10 and "\n...\n" in TOK.decode(fit)
    assert analysis_ids(chat, e, AnalyzerConfig(max_new_tokens=40), max_context=100) is None
