"""Unmodified agents as a rollout mode: a domain's prompts run as agent programs, one per episode.

The agent is a program its user wrote against the `openai` client (`data.domains[i].agent.command`).
Each episode starts it as a child process in a session of its own, with its episode's base URL on
the trainer's `EpisodeProxy` in `OPENAI_BASE_URL` (and `OPENAI_API_KEY`, `OPENAI_MODEL`), the task
(the prompt's text) on stdin; what it prints on stdout is its final answer. Its completions are
recorded token by token by the proxy and joined by prefix into samples (`proxy.record_samples`).

The reward is the trainer's: the answer text is scored with the domain's reward heads against the
prompt's label (`score_answers`, called by the rollout's scoring step); nothing else the program
prints or does sets it. An episode that spends its budget on the proxy — more than `max_completions`
completions or the domain's token budget (`max_completions`, `max_tokens`: the program is killed at
once) — is the policy's own doing and is scored as an answer that is wrong: reward 0, trained on, as an
environment episode cut at its budget is (were it left out, a policy could escape a wrong answer by
looping). An episode is lost — its samples carry `reward_error` (no loss, out of the group's
statistics) — when the program itself fails: it exits non-zero (`exit_nonzero`), runs past
`timeout_s` (`timeout`: its process group is killed) or prints no answer (`no_answer`). Each reason
is counted as `episode/finish/<reason>`. Calls for an episode that has ended are refused
(409) and counted (`episode/events/refused_after_end`). Every child process dies with its episode
(its process group is killed when the episode ends, however it ends) and with the trainer (a parent
death signal).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mcore_rl.agent.proxy import EngineCall, EpisodeProxy, EpisodeRecord, EpisodeRoute, record_samples
from mcore_rl.config.rl_schema import AgentConfig, RLConfig
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.parallel.lifetime import preexec_die_with_parent

# finishes that are the policy's doing (its episode spent the budget): reward 0, trained on, not lost
BUDGET_SPENT = ("max_completions", "max_tokens")
MAX_ANSWER_BYTES = 1 << 16  # the answer read from stdout (the rest is read and dropped)
STDERR_TAIL = 300  # characters of the program's stderr kept in a lost episode's error
ANSWER_KEY = "agent/answer"  # where an answered episode's first sample carries the text to score


@dataclass
class AgentOutcome:
    """How one agent process ended: why (`answered` or the reason it was lost), its answer, the detail."""

    finish: str
    answer: str = ""
    detail: str = ""


class AgentGroups:
    """The agent domains of a run: one proxy per domain (its tool-call format), started on first use;
    `run_group` runs a prompt's G episodes, each one agent process."""

    def __init__(
        self,
        agents: dict[str, AgentConfig],
        budgets: dict[str, int],
        tokenizer: Tokenizer,
        *,
        context_length: int,
        vocab_size: int,
    ) -> None:
        self.agents, self.budgets, self.tokenizer = agents, budgets, tokenizer
        self.context_length, self.vocab_size = context_length, vocab_size
        self.proxies: dict[str, EpisodeProxy] = {}
        self._slots: asyncio.Semaphore | None = None  # (bound to the loop the groups run on)
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._pids: set[int] = set()  # process groups of running agents (killed on close)

    @classmethod
    def from_config(cls, cfg: RLConfig, tokenizer: Tokenizer) -> AgentGroups | None:
        agents = {d.name: d.agent for d in cfg.data.domains if d.agent is not None}
        if not agents:
            return None
        r = cfg.rollout
        budgets = {
            d.name: min(d.max_new_tokens or r.max_new_tokens, r.max_new_tokens) for d in cfg.data.domains if d.agent
        }
        return cls(agents, budgets, tokenizer, context_length=r.context_length, vocab_size=tokenizer.vocab_size)

    def handles(self, prompt: Prompt) -> bool:
        return prompt.domain in self.agents

    def proxy(self, domain: str) -> EpisodeProxy:
        if domain not in self.proxies:
            agent = self.agents[domain]
            px = EpisodeProxy(
                None,
                self.tokenizer,
                tool_format=None if agent.tool_format == "none" else agent.tool_format,
                context_length=self.context_length,
                vocab_size=self.vocab_size,
                model_name=agent.model_name,
            )
            px.start()
            self.proxies[domain] = px
        return self.proxies[domain]

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots = asyncio.Semaphore(max(a.max_parallel for a in self.agents.values()))
            self._slots_loop = loop
        return self._slots

    async def run_group(
        self, prompt: Prompt, samplings: Sequence[dict[str, Any]], generate: EngineCall, purpose: str = ""
    ) -> list[Sample]:
        """The prompt's group: one agent episode per sampling-parameter set, concurrently. `purpose`
        ("eval" for held-out prompts, whose indexes are their own) goes into the episode's id."""
        done = await asyncio.gather(
            *(self.run_episode(prompt, j, sp, generate, purpose) for j, sp in enumerate(samplings))
        )
        return [s for episode in done for s in episode]

    async def run_episode(
        self, prompt: Prompt, j: int, sampling: dict[str, Any], generate: EngineCall, purpose: str = ""
    ) -> list[Sample]:
        """Episode `j` of `prompt`'s group: the agent process to its end, its completions as samples.
        Its id, in its base URL: `<domain>-<purpose><prompt index>-<j>-<random>`."""
        agent, proxy = self.agents[prompt.domain], self.proxy(prompt.domain)
        loop = asyncio.get_running_loop()
        failed = asyncio.Event()

        def on_failure() -> None:  # (from the proxy's thread)
            loop.call_soon_threadsafe(failed.set)

        route = EpisodeRoute(
            generate, loop, sampling, max_completions=agent.max_completions, max_tokens=self.budgets[prompt.domain]
        )
        episode_id = f"{prompt.domain}-{purpose}{prompt.index}-{j}-{uuid.uuid4().hex[:8]}"
        async with self._semaphore():
            base_url = proxy.open(episode_id, route, on_failure=on_failure)
            try:
                outcome = await self._run_process(agent, base_url, prompt.text, failed)
            finally:
                record = proxy.end(episode_id)
                proxy.forget(episode_id)
        if record.failure is not None:  # a limit of the proxy: it ended the episode
            outcome = AgentOutcome(record.failure, detail=f"the agent exceeded its {record.failure}")
        return episode_samples(record, prompt, j, outcome, self.tokenizer)

    async def _run_process(self, agent: AgentConfig, base_url: str, task: str, failed: asyncio.Event) -> AgentOutcome:
        env = {
            **os.environ,
            **agent.env,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": "episode",  # the proxy checks none; clients insist on one
            "OPENAI_MODEL": agent.model_name,
        }
        proc = await asyncio.create_subprocess_exec(
            *leashed(agent.command),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: the episode's end kills all it started
            preexec_fn=preexec_die_with_parent(signal.SIGTERM),  # the leash kills the group then
        )
        self._pids.add(proc.pid)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        readers = asyncio.gather(_read_capped(proc.stdout, MAX_ANSWER_BYTES), _read_capped(proc.stderr, 1 << 14))
        exited = asyncio.ensure_future(proc.wait())
        flagged = asyncio.ensure_future(failed.wait())
        feeding = asyncio.ensure_future(_feed(proc.stdin, task))
        timed_out = False
        try:
            await asyncio.wait({exited, flagged}, timeout=agent.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            timed_out = not exited.done() and not failed.is_set()
        finally:
            _kill_group(proc.pid)  # whatever it started, on every way out (a cancelled group too)
            self._pids.discard(proc.pid)
            flagged.cancel()
            feeding.cancel()
            await exited
            out, err = await readers
        tail = err.decode("utf-8", "replace")[-STDERR_TAIL:].strip()
        if failed.is_set():
            return AgentOutcome("limit")  # (the record names which)
        if timed_out:
            return AgentOutcome("timeout", detail=f"no answer within {agent.timeout_s:g} s; process group killed")
        if proc.returncode != 0:
            return AgentOutcome("exit_nonzero", detail=f"exit code {proc.returncode}" + (f": {tail}" if tail else ""))
        answer = out.decode("utf-8", "replace").strip()
        if not answer:
            return AgentOutcome("no_answer", detail="printed nothing on stdout" + (f"; stderr: {tail}" if tail else ""))
        return AgentOutcome("answered", answer)

    def close(self) -> None:
        for pid in list(self._pids):
            _kill_group(pid)
        self._pids.clear()
        for px in self.proxies.values():
            px.stop()
        self.proxies.clear()


async def _feed(stdin: asyncio.StreamWriter, text: str) -> None:
    """The task on the program's stdin, then EOF (a program that does not read it is fine)."""
    try:
        stdin.write(text.encode("utf-8"))
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    """At most `cap` bytes of a stream, read to its end (a chatty program never blocks on a full pipe)."""
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        kept += chunk[: max(0, cap - len(kept))]
    return bytes(kept)


# The agent runs under a leash: a small Python process, leader of the episode's process group, that
# runs the command as its child (stdin/stdout/stderr inherited) and exits as it exits. The kernel
# sends the leash SIGTERM when the trainer dies, however it died (SIGKILL included), and the leash
# then kills the whole group: the agent and everything it started, which a death signal on the agent
# alone would leave running under PID 1.
LEASH = """
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
rc = subprocess.call(sys.argv[1:])
if rc < 0:  # the agent died of a signal: so does its leash, so the trainer reads the same status
    signal.signal(-rc, signal.SIG_DFL)
    os.kill(os.getpid(), -rc)
sys.exit(rc)
"""


def leashed(command: Sequence[str]) -> list[str]:
    """`command` under the leash (see LEASH)."""
    return [sys.executable, "-S", "-c", LEASH, *command]


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def episode_samples(
    record: EpisodeRecord, prompt: Prompt, j: int, outcome: AgentOutcome, tokenizer: Tokenizer
) -> list[Sample]:
    """The episode's samples with its summary in `info` (`episode/*`, as environment episodes carry);
    a lost episode's samples carry its reason in `reward_error`; one with no completion is one empty
    sample (no tokens: the learner leaves it out) that keeps the group's shape."""
    last = record.completions[-1].finish_reason if record.completions else "abort"
    scored = outcome.finish == "answered" or outcome.finish in BUDGET_SPENT
    out = record_samples(record, prompt, last if scored else "abort", tokenizer)
    if not out:
        out = [Sample(prompt, prompt.index, [], [], 0, "abort")]
    summary: dict[str, Any] = {
        "episode/return": 0.0,  # set from the answer's reward when it is scored
        "episode/turns": len(record.completions),
        "episode/finish": outcome.finish,
        "episode/invalid_turns": 0,
        "episode/continued_requests": sum(c.parts - 1 for c in record.completions),
        "episode/template_drift": record.drift,
        "episode/template_splits": record.drift,
        "episode/events/refused_after_end": record.refused,
    }
    error = None if scored else f"agent {outcome.finish}: {outcome.detail}"[:300]
    oldest = min((s.policy_version for s in out if s.response_ids), default=0)
    for k, s in enumerate(out):
        s.episode, s.step_index, s.policy_version = j, k, oldest
        s.reward, s.reward_error = 0.0, error
        s.info = dict(summary)
    if outcome.finish == "answered":
        out[0].info[ANSWER_KEY] = outcome.answer
    return out


async def score_answers(samples: Sequence[Sample], score: Callable[[list[Sample]], Awaitable[None]]) -> None:
    """Score each answered agent episode of `samples` by its answer: one sample per episode whose text
    is the answer goes through `score` (the domain's reward heads, against the prompt's label), and
    its reward, heads and error become every sample's of the episode (and `episode/return`)."""
    episodes: dict[tuple[int, int], list[Sample]] = {}
    for s in samples:
        if s.episode is not None and "episode/finish" in s.info:
            episodes.setdefault((s.group, s.episode), []).append(s)
    answered = [(ss, ss[0].info[ANSWER_KEY]) for ss in episodes.values() if ANSWER_KEY in ss[0].info]
    if not answered:
        return
    probes = [
        Sample(replace(ss[0].prompt), ss[0].group, [], [], ss[0].policy_version, ss[-1].finish_reason, str(answer))
        for ss, answer in answered
    ]
    await score(probes)
    for (ss, _), probe in zip(answered, probes):
        for s in ss:
            s.reward, s.reward_heads, s.reward_error = probe.reward, dict(probe.reward_heads), probe.reward_error
            s.info["episode/return"] = probe.reward
