"""Unmodified agent programs as a rollout mode of `mcore-rl train` (`data.domains[i].agent`).

The shipped example agent (`examples/agents/calculator_agent.py`, a plain `openai` tool loop) trains
the tiny model, initialised from one learned tool conversation (`tests/tool_agent.py`) so its calls are
valid, in both schedules: the synchronous one on the embedded engine, the asynchronous one on started
`mcore-rl serve` processes. The samples are the engine's tokens (the agent's conversation decoded),
the tool results untrainable, the rewards the trainer's (the answer scored against the label), the
episodes counted, and a crashing, silent or greedy agent costs its episode only. Processes that
hang or crash without any engine are checked without a model.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest

from mcore_rl.agent.programs import ANSWER_KEY, AgentGroups
from mcore_rl.config.rl_schema import AgentConfig
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.rollout.pool import Generation, GenRequest
from tests.world import run_world

pytest.importorskip("openai")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT_ANSWER = "Answer: 5"


async def _no_engine(req: GenRequest) -> Generation:
    raise AssertionError("these programs never call the model")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie is dead, waiting for its reaper
    except FileNotFoundError:
        return True


def test_hanging_crashing_and_silent_programs_cost_their_episode(tmp_path):
    py = sys.executable
    pidfile = tmp_path / "grandchild.pid"
    hang = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
    hang += f" open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(600)"
    agents = {
        "hang": AgentConfig(command=[py, "-c", hang], timeout_s=2.0),
        "crash": AgentConfig(command=[py, "-c", "import sys; print('partial'); sys.stderr.write('boom'); sys.exit(3)"]),
        "silent": AgentConfig(command=[py, "-c", "import sys; sys.stdin.read()"]),
        "echo": AgentConfig(command=[py, "-c", "import sys; print(sys.stdin.read().upper())"]),
    }
    tok = load_tokenizer(None)
    groups = AgentGroups(agents, dict.fromkeys(agents, 64), tok, context_length=256, vocab_size=tok.vocab_size)

    async def main():
        prompts = [Prompt(i, "two plus three?", tok.encode("x"), "5", name) for i, name in enumerate(agents)]
        return await asyncio.gather(*(groups.run_group(p, [{}], _no_engine) for p in prompts))

    try:
        start = time.monotonic()
        (hung,), (crashed,), (silent,), (echoed,) = asyncio.run(main())
        assert time.monotonic() - start < 60
    finally:
        groups.close()
    assert hung.info["episode/finish"] == "timeout" and "process group killed" in (hung.reward_error or "")
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 30
    while not _gone(grandchild):  # what the agent started dies with its episode
        assert time.monotonic() < deadline, f"the agent's child {grandchild} outlived its episode"
        time.sleep(0.05)
    assert (
        crashed.info["episode/finish"] == "exit_nonzero"
        and crashed.reward_error == "agent exit_nonzero: exit code 3: boom"
    )
    assert silent.info["episode/finish"] == "no_answer" and "printed nothing" in (silent.reward_error or "")
    # an agent that answers without asking the model: answered, to be scored, but no tokens to train
    assert echoed.info["episode/finish"] == "answered" and echoed.info[ANSWER_KEY] == "TWO PLUS THREE?"
    assert echoed.reward_error is None and echoed.response_ids == [] and echoed.info["episode/turns"] == 0
    for s in (hung, crashed, silent, echoed):
        assert s.episode == 0 and s.step_index == 0 and s.info["episode/events/refused_after_end"] == 0


TRAINER = """
import asyncio, sys
from mcore_rl.agent.programs import AgentGroups
from mcore_rl.config.rl_schema import AgentConfig
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tokenizer import load_tokenizer

async def no_engine(req):
    raise AssertionError("never called")

tok = load_tokenizer(None)
agents = {"hang": AgentConfig(command=[sys.executable, "-c", sys.argv[1]], timeout_s=600.0)}
groups = AgentGroups(agents, {"hang": 64}, tok, context_length=256, vocab_size=tok.vocab_size)
asyncio.run(groups.run_group(Prompt(0, "q", tok.encode("x"), "5", "hang"), [{}], no_engine))
"""


def test_what_an_agent_started_dies_with_a_sigkilled_trainer(tmp_path):
    """The trainer runs no cleanup under SIGKILL: the agent's leash (its process group's leader, told
    by the kernel that its parent died) kills the agent and the agent's own children."""
    import signal
    import subprocess

    pidfile = tmp_path / "pids"
    hang = "import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
    hang += f" open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}} {{p.pid}}'); time.sleep(600)"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, hang], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and len(pidfile.read_text().split()) == 2):
            assert trainer.poll() is None and time.monotonic() < deadline, "the agent never started"
            time.sleep(0.05)
        agent, grandchild = map(int, pidfile.read_text().split())
        assert not _gone(agent) and not _gone(grandchild)
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + 10
    while not (_gone(agent) and _gone(grandchild)):
        assert time.monotonic() < deadline, f"agent {agent} or its child {grandchild} outlived the trainer"
        time.sleep(0.05)


# ---- the example agent through `mcore-rl train` -------------------------------------------------

RUN = [
    "train.num_steps=2",
    "train.seq_length=1024",
    "train.micro_batch_size=4",
    "rollout.quantization=none",
    "rollout.group_size=4",
    "rollout.prompts_per_step=2",
    "rollout.max_new_tokens=200",
    "rollout.context_length=1024",
    "rollout.request_timeout_s=900",
    "reward.timeout_s=600",  # the math reward's first call imports sympy: slow on a loaded machine
    "algorithm.num_minibatches=1",
    "optimizer.lr=1e-5",
    "eval.interval=0",
    "eval.at_start=false",
    "eval.num_prompts=1",
    "eval.k=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
]


def _config(tmp: str, name: str, init: str, misbehave: str, *overrides: str):
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.rl_schema import DomainConfig, DomainEvalConfig, RewardHeadConfig

    transcripts = os.path.join(tmp, name, "transcripts")
    os.makedirs(transcripts)
    cfg = load_config(RLConfig, None, [f"run_dir={tmp}/{name}", f"init.checkpoint={init}", *RUN, *overrides])
    agent = AgentConfig(
        command=[sys.executable, os.path.join(ROOT, "tests", "agent_program.py")],
        tool_format="hermes",
        max_completions=6,
        timeout_s=900.0,  # a loaded machine: the guard is tested without a model above
        env={"TRANSCRIPT_DIR": transcripts, "MISBEHAVE": misbehave, "OMP_NUM_THREADS": "1"},
    )
    cfg.data.domains = [
        DomainConfig(
            name="calc",
            path=f"{tmp}/train.jsonl",
            rewards=[RewardHeadConfig(name="math")],
            agent=agent,
            eval=DomainEvalConfig(path=f"{tmp}/eval.jsonl", num_prompts=1),
        )
    ]
    return cfg, transcripts


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "episode/count" in line]


def _check_answered(samples, transcripts: str, tok) -> int:
    """Every answered episode's sample is its conversation as the engine produced it: the agent's
    transcript rendered, the model's turns trainable with μ, the tool results and headers not; its
    reward is the math reward of its answer against its prompt's label. Returns how many."""
    from calculator_agent import TOOLS  # examples/agents, put on sys.path

    from mcore_rl.rollout.openai_api import chat_prompt, chat_tools

    tools = chat_tools({"tools": TOOLS}, "hermes")
    n = 0
    for s in samples:
        if s.info["episode/finish"] != "answered":
            continue
        n += 1
        assert s.info["episode/template_drift"] == 0  # the agent sends its history back as it was: one sample
        with open(os.path.join(transcripts, f"{s.group}-{s.episode}.json")) as f:
            messages = json.load(f)
        final = messages[-1]["content"]
        text = tok.decode(s.prompt.ids + s.response_ids)
        assert text == chat_prompt(messages[:-1], tok, tools=tools, tool_format="hermes") + final + "<|im_end|>"
        assert tok.decode(s.prompt.ids) == chat_prompt(messages[:1], tok, tools=tools, tool_format="hermes")
        assert s.trainable is not None and len(s.trainable) == len(s.response_ids) == len(s.rollout_logp)
        model = "".join(tok.decode([t]) for t, m in zip(s.response_ids, s.trainable) if m)
        assert model.endswith(final + "<|im_end|>")
        assert all((lp < 0) == bool(m) for lp, m in zip(s.rollout_logp, s.trainable) if lp != 0)
        assert all(lp == 0 for lp, m in zip(s.rollout_logp, s.trainable) if not m)
        others = "".join(tok.decode([t]) for t, m in zip(s.response_ids, s.trainable) if not m)
        tool_results = [m["content"] for m in messages if m["role"] == "tool"]
        for result in tool_results:  # the agent's tool results: in the sample, never trained
            assert f"<|im_start|>tool\n{result}<|im_end|>" in others
            assert f"tool\n{result}" not in model
        expected = 1.0 if final.strip() == f"Answer: {s.prompt.label}" else 0.0
        assert s.reward_error is None, s.reward_error
        assert s.reward == expected, (s.reward, final, s.prompt.label)
        assert s.reward_heads == {"math": expected} and s.info["episode/return"] == expected, (s.reward_heads, s.info)
    return n


def _runs(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.config import ParallelConfig
    from mcore_rl.config.rl_validate import validate_rl_config
    from mcore_rl.convert import hf_to_mcore
    from mcore_rl.runtime import run_rl
    import mcore_rl.runtime.rollouts as rollouts

    sys.path.insert(0, os.path.join(ROOT, "examples", "agents"))
    from calculator_agent import TOOLS  # examples/agents, put on sys.path
    from tests.tool_agent import save_tool_model

    hf = save_tool_model(f"{tmp}/hf", steps=300, tools=TOOLS, answer=AGENT_ANSWER)
    init = hf_to_mcore(hf, f"{tmp}/mcore", ParallelConfig())
    with open(f"{tmp}/train.jsonl", "w") as f:  # one question; the label decides the reward
        for label in ("5", "7", "5", "7"):
            f.write(json.dumps({"prompt": "2+3?", "label": label}) + "\n")
    with open(f"{tmp}/eval.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "4+4?", "label": "8"}) + "\n")
    tok = load_tokenizer(None)

    seen: list = []
    original = rollouts.score_answers

    async def recording(samples, score):  # the scored groups, as the learner gets them
        await original(samples, score)
        seen.extend(samples)

    rollouts.score_answers = recording
    try:
        # synchronous, on the embedded engine: 2 prompts x 4 episodes a step; in prompt 0's group one
        # agent crashes, one prints nothing; in prompt 1's one asks past its completions
        cfg, transcripts = _config(tmp, "sync", init, "0-1:crash,0-2:silent,1-3:greedy")
        validate_rl_config(cfg, 1)
        summary = run_rl(cfg)
        recs = _records(f"{tmp}/sync")
        assert len(recs) == 2 and all(r["episode/count"] == 8 for r in recs)
        first = recs[0]
        assert first["episode/finish/exit_nonzero"] == 1 and first["episode/finish/no_answer"] == 1
        assert first["episode/finish/max_completions"] == 1 and first["episode/finish/answered"] == 5
        acc = summary["accounting"]
        assert acc["balanced"] and acc["trained"] == 4 and acc["episodes_trained"] == 16
        assert _check_answered(seen, transcripts, tok) >= 8
        # the held-out evaluation (after the last step) ran the agent too, scored by its answer
        with open(os.path.join(transcripts, "eval0-0.json")) as f:
            final = json.load(f)[-1]["content"]
        right = 1.0 if final.strip() == "Answer: 8" else 0.0
        assert summary["eval_after"]["eval/calc/greedy_pass@1"] == right, (final, summary["eval_after"])
        lost = {s.info["episode/finish"]: s for s in seen if s.group == 0 and s.episode in (1, 2)}
        assert lost["exit_nonzero"].reward_error.startswith("agent exit_nonzero: exit code 3")
        assert lost["exit_nonzero"].response_ids  # its completion is recorded, but it trains nothing
        assert lost["no_answer"].reward_error.startswith("agent no_answer")
        # the greedy one spent its completions: the policy's doing, so a wrong answer that trains, not a lost one
        spent = [s for s in seen if s.info.get("episode/finish") == "max_completions"]
        assert spent and any(s.response_ids for s in spent)
        assert all(s.reward_error is None and s.reward == 0.0 and s.info["episode/return"] == 0.0 for s in spent)

        # asynchronous, one version of staleness, on started engine processes
        seen.clear()
        cfg, transcripts = _config(tmp, "async", init, "", "rollout.runtime=async", "rollout.max_staleness=1")
        summary = run_rl(cfg)
        recs = _records(f"{tmp}/async")
        assert len(recs) == 2 and all(r["episode/count"] == 8 for r in recs)
        acc = summary["accounting"]
        assert acc["balanced"] and acc["failed"] == 0 and acc["trained"] == 4 and acc["episodes_trained"] == 16
        assert _check_answered(seen, transcripts, tok) >= 8
    finally:
        rollouts.score_answers = original
    _hermes_environment_run(tmp, init)


def _hermes_environment_run(tmp: str, init: str) -> None:
    """An environment domain with `tool_format: hermes` trains: every turn is parsed in the hermes
    format by reasoning_tools' calculator toolset, the episodes end, and the step trains. The tool
    model (taught the example agent's `add` tool) is warm-started on the environment's scripted player
    (a calculator call on the problem's expression, then the answer), so it calls the calculator here,
    and its calls are counted: run, invalid (bad JSON or arguments) or failed, each by its event."""
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.rl_schema import DomainConfig, DomainEvalConfig, EnvironmentConfig
    from mcore_rl.config.rl_validate import validate_rl_config
    from mcore_rl.runtime import run_rl

    warm = ["init.sft_steps=200", "init.sft_seq_length=512", "init.sft_micro_batch_size=4", "init.sft_num_examples=64"]
    overrides = [f"run_dir={tmp}/hermes", f"init.checkpoint={init}", *RUN, "train.num_steps=1", "rollout.group_size=2"]
    overrides += warm
    cfg = load_config(RLConfig, None, overrides)
    env = EnvironmentConfig(
        name="reasoning_tools",
        options={"dataset": "basic_arithmetic", "tools": ["calculator"], "max_turns": 2},
        tool_format="hermes",
        max_turns=2,
        max_tokens_per_turn=160,  # a calculator call in hermes is ~80 tokens before its expression
        max_invalid_calls=2,
    )
    cfg.data.domains = [DomainConfig(name="arith", environment=env, eval=DomainEvalConfig(num_prompts=1))]
    validate_rl_config(cfg, 1)
    summary = run_rl(cfg)
    (rec,) = _records(f"{tmp}/hermes")
    assert rec["episode/count"] == 4 and rec["episode/turns_mean"] >= 1
    calls = {k: v for k, v in rec.items() if k.split("/")[-1] in ("tool_call", "invalid_call", "tool_error")}
    assert sum(calls.values()) >= 1, rec  # the model's calls, counted by what became of them
    assert summary["accounting"]["trained"] == 2 and summary["accounting"]["episodes_trained"] == 4


def test_the_example_agent_trains_in_both_schedules(tmp_path):
    run_world(1, _runs, str(tmp_path))


def test_the_shipped_config_validates_and_agent_keys_are_named_in_errors(monkeypatch):
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rl_schema import EnvironmentConfig
    from mcore_rl.config.rl_validate import validate_rl_config

    monkeypatch.chdir(ROOT)  # the recipe's paths are from the repository root
    cfg = load_config(RLConfig, os.path.join(ROOT, "configs", "agent_demo.yaml"), [])
    validate_rl_config(cfg, 1)

    def errors() -> str:
        try:
            validate_rl_config(cfg, 1)
        except ConfigError as err:
            return str(err)
        return ""

    dom = cfg.data.domains[0]
    agent = dom.agent
    assert agent is not None
    agent.command = ["no-such-program-here", "examples/agents/missing.py"]
    agent.tool_format, agent.timeout_s, agent.max_completions = "llama3_json", 0.0, 0
    dom.template = "Q: {prompt}"
    msg = errors()
    for line in (
        "data.domains[0].agent.command: domain 'sums': 'no-such-program-here' is not an executable",
        "data.domains[0].agent.command: domain 'sums': 'examples/agents/missing.py' is not a file",
        "data.domains[0].agent.tool_format: domain 'sums': 'llama3_json' is not the tool-call format of the "
        "bundled byte tokenizer (ChatML) (its format: 'hermes')",
        "data.domains[0].agent.timeout_s: domain 'sums': must be a finite number > 0, got 0.0",
        "data.domains[0].agent.max_completions: domain 'sums': must be >= 1, got 0",
        "data.domains[0].template: domain 'sums': the agent writes its own messages",
    ):
        assert line in msg, msg
    agent.command, agent.tool_format, agent.timeout_s, agent.max_completions = [], "hermes", 5.0, 2
    dom.template = None
    assert "data.domains[0].agent.command: domain 'sums': must be a non-empty list" in errors()
    agent.command = [sys.executable]
    dom.environment = EnvironmentConfig(name="guess_number")
    assert "data.domains[0].agent: domain 'sums': an agent domain or an environment domain, not both" in errors()
