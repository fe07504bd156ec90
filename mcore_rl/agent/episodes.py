"""The episode runner: a prompt's group as G episodes of its domain's environment, turn by turn.

All G episodes of a prompt reset from the same seed (the same initial state); each turn the model
generates from the trajectory so far (`Episode.request`), its output is parsed for tool calls in the
family's format, the environment steps, and its messages are appended (`Episode.advance`). Guards end
an episode, counted by reason: `max_turns`, the token budget of the whole episode (`length`), and
`max_invalid_calls` consecutive invalid turns (unparseable calls, or an environment that reports an
invalid action); a per-turn token cap bounds each generation. The environment runs behind
`envs.guard.GuardedEnv`: one that raises, hangs or returns an invalid step costs its episode (its
samples carry `reward_error`, its reason is counted), never the run.

Two forms of samples (`EpisodeSettings.trajectory`): `conversation`, one growing token-exact
conversation per episode (`trajectory.Trajectory`: one sample, or one per segment under the `split`
template policy), trained only at the model's tokens; and `stepwise`, one sample per step whose
prompt is the opening messages plus the last `memory_k` steps (their actions and observations) and
whose response is that step's model output. Every sample knows its group (`Sample.group`), episode
(`Sample.episode`) and step (`Sample.step_index`), and gets the episode's return as its reward; a
step-wise sample also carries what step-level estimators compare steps by (`algos.step_credit`): the
state it acted in (`info["state"]`, its stable hash `info["state_key"]`) and the step's own reward
(`info["step_reward"]`: the environment's, less the invalid-turn penalty). Privileged texts
(`envs.base.PRIVILEGED`) go to `info["privileged/<name>"]` as they are, for a self-teacher
(`teachers[i].context: info`): a step-wise sample gets those about the state it acted in (the reset's
for step 0, the previous step's `info` after), over the episode's last ones (`outcome`); a
conversation gets the start state's over the last ones.

One driver for both schedules: `run_episode`, one coroutine per episode through the rollout
scheduler's `generate` (an embedded engine batches the turns that arrive together); a turn that a
weight sync aborted is continued as context + tokens so far, each token keeping the version it was
sampled under, so a sync never ends an episode. Held-out evaluation, between training steps, plays
its episodes with `run_lockstep` over a pool's blocking `generate` (one batch per round).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from mcore_rl.agent.spans import tagged_token_mask
from mcore_rl.agent.trajectory import ChatFormat, Message, TemplatePolicy, Trajectory
from mcore_rl.algos.step_credit import StepBatch, state_key
from mcore_rl.data.samples import DISTILL_SPAN, Prompt, Sample
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.data.tool_calls import ParsedTurn, parse_tool_calls
from mcore_rl.envs.base import PRIVILEGED, AgentAction, Environment
from mcore_rl.envs.guard import EnvGuards, EpisodeFailed, GuardedEnv
from mcore_rl.rollout.pool import Generation, GenRequest

TrajectoryForm = Literal["conversation", "stepwise"]


@dataclass(frozen=True)
class EpisodeSettings:
    """The guards and the form of one domain's episodes (from `data.domains[i].environment`)."""

    tool_format: str = "none"  # "none": turns are plain text; else a `data.tool_calls` format name
    max_turns: int = 8
    max_tokens_per_turn: int = 64
    max_invalid_calls: int = 3  # consecutive invalid turns that end the episode
    trajectory: TrajectoryForm = "conversation"
    memory_k: int = 2  # stepwise: the previous steps in each step's prompt
    template_policy: TemplatePolicy = "keep"
    max_episode_tokens: int = 256  # the response budget of the whole episode (model + observation tokens)
    # the most tokens one sample (prompt + response) may have: the learner's row, the engine's context.
    # A turn gets no more budget than fits, and one that cannot fit a token ends the episode ("length"):
    # a stepwise step's prompt grows with the history it shows, which no check can bound before the run
    max_sample_tokens: int = 0  # 0: no cap
    invalid_penalty: float = 0.0  # subtracted from the return per invalid turn (a format signal from the start)
    # (open, close): distillation acts only on the tokens inside these tags (`agent/spans.py`); None: all
    distill_span_tags: tuple[str, str] | None = None


@dataclass
class TurnOutput:
    """One model turn as the engine(s) produced it, across the requests of a partial rollout."""

    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "abort"
    engine: str = ""
    parts: int = 0  # requests it took (1 + continuations after weight syncs)

    def add(self, gen: Generation) -> None:
        self.ids += list(gen.output_ids)
        self.logps += list(gen.output_logprobs)
        self.versions += list(gen.output_versions or [gen.weight_version] * len(gen.output_ids))
        self.finish_reason, self.engine = gen.finish_reason, gen.engine
        self.parts += 1


@dataclass
class _Step:
    """A stepwise sample in the making: its prompt ids, the model's output, the state it acted in."""

    prompt_ids: list[int]
    out: TurnOutput
    state: str


def parse_turn(text: str, tool_format: str) -> ParsedTurn:
    """The model's turn as prose and tool calls (`none`: prose only)."""
    return ParsedTurn(text) if tool_format == "none" else parse_tool_calls(text, tool_format)


# the guard's reasons for an episode its environment lost (`envs.guard.GuardedEnv`)
FAILURES = ("env_error", "env_timeout", "env_invalid")


def _invalid(parsed: ParsedTurn, info: dict[str, Any]) -> bool:
    """An unparseable call, or an environment that reports an invalid action / call."""
    events = info.get("events") or {}
    return bool(parsed.errors) or bool(events.get("invalid_action")) or bool(events.get("invalid_call"))


class Episode:
    """One episode of a group, driven from outside: `request()` is the next model turn (None once it
    is over), `advance(turn)` feeds the engine's answer; `samples()` at the end."""

    def __init__(
        self,
        env: Environment,
        prompt: Prompt,
        index: int,
        seed: int,
        tokenizer: Tokenizer,
        settings: EpisodeSettings,
        sampling: dict[str, Any],
        guards: EnvGuards | None = None,
    ) -> None:
        self.env = GuardedEnv(env, guards if guards is not None else EnvGuards())
        self.prompt, self.index, self.settings = prompt, index, settings
        self.sampling = dict(sampling)  # SGLang sampling params; the per-turn seed is derived from its seed
        self.rewards: list[float] = []
        self.invalid_at: list[bool] = []  # per turn: was it invalid (its step reward carries the penalty)
        self.turns = 0
        self.invalid_run = 0  # consecutive invalid turns
        self.invalid = 0
        self.continued = 0  # requests that continued a turn a weight sync had aborted (partial rollouts)
        self.finish: str | None = None  # why it ended
        self.error: str | None = None  # the environment's failure, if it failed
        self.steps: list[_Step] = []
        self.actions: list[str] = []  # each model turn's text as the environment got it
        self.history: list[list[Message]] = []  # stepwise memory: each step's action and observation
        self.states: list[str] = []
        self.privileged: list[dict[str, str]] = []  # per state in `states`: its privileged texts
        self.last_privileged: dict[str, str] = {}  # those of the episode's last step (outcome)
        self.info: dict[str, Any] = {}
        self.events: dict[str, int] = {}  # the environment's counted events (`EnvStep.info["events"]`)
        try:
            reset = self.env.reset(prompt, seed)
            self.chat = ChatFormat(tokenizer, reset.tools)
            self.opening = list(reset.messages)
            self.states.append(reset.state)
            self.privileged.append({PRIVILEGED + k: v for k, v in reset.privileged.items()})
            self.trajectory = Trajectory(self.chat, self.opening, settings.template_policy)
        except EpisodeFailed as err:  # a broken environment costs this episode
            self._fail(err.reason, err.detail)
            self.chat = ChatFormat(tokenizer)
            self.opening = [{"role": "user", "content": prompt.text}]
            self.trajectory = Trajectory(self.chat, self.opening, settings.template_policy)

    # ------------------------------------------------------------------ driving

    @property
    def done(self) -> bool:
        return self.finish is not None

    def _fail(self, reason: str, detail: str) -> None:
        self.error, self.finish = f"{reason}: {detail}"[:300], reason
        self.close()

    def close(self) -> None:
        self.env.close()  # the guard closes once, under its timeout, and never raises

    def context_ids(self) -> list[int]:
        """What the next turn continues: the conversation so far, or the step's prompt (stepwise)."""
        if self.settings.trajectory == "conversation":
            return self.trajectory.context_ids
        messages = list(self.opening)
        k = self.settings.memory_k
        for step in self.history[len(self.history) - k :] if k > 0 else []:
            messages += step
        if k == 0 and self.history:  # the current state: the last observation
            messages += [m for m in self.history[-1] if m.get("role") != "assistant"]
        return self.chat.prompt_ids(messages)

    def _budget(self) -> int:
        s = self.settings
        if s.trajectory == "stepwise":
            return s.max_tokens_per_turn
        used = len(self.trajectory.current.ids)
        return min(s.max_tokens_per_turn, s.max_episode_tokens - used)

    def request(self, prefix: Sequence[int] = (), part: int = 0) -> GenRequest | None:
        """The next turn's request (continuing `prefix`, the turn's tokens so far, after a sync
        aborted it: part > 0); None when the episode is over or the turn has no budget left."""
        if self.done:
            return None
        context = self.context_ids()
        budget = self._budget() - len(prefix)
        if self.settings.max_sample_tokens > 0:
            budget = min(budget, self.settings.max_sample_tokens - len(context) - len(prefix))
        if budget <= 0:
            return None
        sp = dict(self.sampling, max_new_tokens=budget)
        sp["stop_token_ids"] = sorted(set(sp.get("stop_token_ids") or []) | set(self.chat.stop_ids))
        if "sampling_seed" in sp:  # each turn and part its own draw, reproducible
            sp["sampling_seed"] = (int(sp["sampling_seed"]) + 7919 * self.turns + 104729 * part) % (2**31 - 1)
        return GenRequest(context + list(prefix), sp)

    def advance(self, out: TurnOutput) -> None:
        """Feed a finished model turn: append it, parse it, step the environment, append its answer."""
        s = self.settings
        self.turns += 1
        self.continued += max(0, out.parts - 1)
        if s.trajectory == "conversation":
            self.trajectory.add_model_turn(out.ids, out.logps, out.versions, out.finish_reason)
        else:
            self.steps.append(_Step(self.context_ids(), out, self.states[-1] if self.states else ""))
        content = self.chat.decode([i for i in out.ids if i not in self.chat.stop_ids])
        parsed = parse_turn(content, s.tool_format)
        self.actions.append(content)
        step = self.env.step(AgentAction(content, parsed, truncated=out.finish_reason == "length"))
        self.rewards.append(float(step.reward))
        invalid = _invalid(parsed, step.info)
        self.invalid_at.append(invalid)
        self.states.append(step.state)
        privileged = {k: str(v) for k, v in step.info.items() if k.startswith(PRIVILEGED)}
        self.privileged.append(privileged)
        self.last_privileged = privileged
        for name, n in (step.info.get("events") or {}).items():
            self.events[name] = self.events.get(name, 0) + int(n)
        self.info.update(
            {k: v for k, v in step.info.items() if k not in ("events", "end_detail") and k not in privileged}
        )
        end = step.info.get("end_reason")
        if end in FAILURES:
            self._fail(str(end), str(step.info.get("end_detail", "")))
            return
        if invalid:
            self.invalid += 1
            self.invalid_run += 1
        else:
            self.invalid_run = 0
        if s.trajectory == "stepwise":
            self.history.append([{"role": "assistant", "content": content}, *step.messages])
        if step.done:
            self.finish = str(end) if end else "done"
        elif self.invalid_run >= s.max_invalid_calls:
            self.finish = "invalid_calls"
        elif self.turns >= s.max_turns:
            self.finish = "max_turns"
        elif s.trajectory == "conversation":
            try:
                self.trajectory.add_observation(step.messages)
            except Exception as err:  # a message the template cannot render
                self._fail("observation_unrenderable", f"{type(err).__name__}: {err}")
                return
            if self._budget() <= 0:
                self.finish = "length"
        if self.done:
            self.close()

    def cut(self) -> None:
        """End a running episode at the token budget (a turn that got no budget at all)."""
        if not self.done:
            self.finish = "length"
            self.close()

    # ------------------------------------------------------------------ results

    @property
    def episode_return(self) -> float:
        ret = self.info.get("return")
        base = float(ret) if isinstance(ret, (int, float)) else float(sum(self.rewards))
        return base - self.settings.invalid_penalty * self.invalid

    def step_reward(self, t: int) -> float:
        """The environment's reward for turn t, less the invalid-turn penalty if it was invalid (what
        step-level estimators credit to the step; `algos.step_credit`)."""
        return self.rewards[t] - (self.settings.invalid_penalty if self.invalid_at[t] else 0.0)

    def samples(self) -> list[Sample]:
        """The episode's samples, each with the episode's return, its ids and its episode's summary
        in `info` (`episode/*`)."""
        finish = self.finish or "abort"
        if self.settings.trajectory == "conversation":
            out = self.trajectory.samples(self.prompt, finish) if self.turns else []
            start = self.privileged[0] if self.privileged else {}
            for s in out:
                s.info = {**s.info, **self.last_privileged, **start}
        else:
            out = [
                Sample(
                    replace(self.prompt, ids=list(st.prompt_ids)),
                    self.prompt.index,
                    list(st.out.ids),
                    list(st.out.logps),
                    min(st.out.versions) if st.out.versions else 0,
                    finish if t == len(self.steps) - 1 else "step",
                    self.chat.decode(st.out.ids),
                    st.out.engine,
                    token_versions=list(st.out.versions) if len(set(st.out.versions)) > 1 else None,
                    info={
                        "state": st.state,
                        "state_key": state_key(st.state),
                        "step_reward": self.step_reward(t),
                        **self.last_privileged,
                        **(self.privileged[t] if t < len(self.privileged) else {}),
                    },
                )
                for t, st in enumerate(self.steps)
            ]
        if not out:  # lost before its first turn (a reset that failed): one empty, unusable sample keeps
            # the group's shape, its reason in `reward_error` (the learner leaves it out: no tokens)
            # (or whose opening alone does not fit a sample: its ids are cut to the cap, never trained)
            ids = self.trajectory.context_ids
            if self.settings.max_sample_tokens > 0:
                ids = ids[: self.settings.max_sample_tokens]
            out = [Sample(replace(self.prompt, ids=ids), self.prompt.index, [], [], 0, "abort")]
        summary = {
            "episode/return": self.episode_return,
            "episode/turns": self.turns,
            "episode/finish": finish,
            "episode/invalid_turns": self.invalid,
            "episode/continued_requests": self.continued,
            "episode/template_drift": self.trajectory.drift,
            "episode/template_splits": self.trajectory.splits,
            **{f"episode/events/{k}": v for k, v in self.events.items()},
        }
        tags = self.settings.distill_span_tags
        if tags is not None:  # StepOPSD's action spans: the tagged model tokens only
            for s in out:
                span = tagged_token_mask(s.response_ids, self.chat.decode, *tags)
                if s.trainable is not None:  # an observation that echoes a tag is not the model's
                    span = [m * int(bool(t)) for m, t in zip(span, s.trainable, strict=True)]
                s.info = {**s.info, DISTILL_SPAN: span}
        oldest = min((s.policy_version for s in out), default=0)
        for k, s in enumerate(out):
            s.episode, s.step_index = self.index, k
            s.policy_version = oldest  # the staleness bound counts the episode's oldest token
            s.reward = self.episode_return
            s.reward_heads = {"environment": self.episode_return}
            s.reward_error = self.error
            s.info = {**s.info, **summary, **{f"env/{k}": v for k, v in self.info.items() if _scalar(v)}}
        return out


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool))


def episode_metrics(groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
    """`episode/*` over the episodes of a batch (each counted once, from its first sample)."""
    firsts = [s for g in groups for s in g if s.episode is not None and s.step_index == 0]
    if not firsts:
        return {}
    n = float(len(firsts))
    out = {
        "episode/count": n,
        "episode/samples": float(sum(1 for g in groups for s in g if s.episode is not None)),
        "episode/return_mean": sum(float(s.info["episode/return"]) for s in firsts) / n,
        "episode/turns_mean": sum(float(s.info["episode/turns"]) for s in firsts) / n,
        "episode/invalid_turns": float(sum(int(s.info["episode/invalid_turns"]) for s in firsts)),
        "episode/continued_requests": float(sum(int(s.info["episode/continued_requests"]) for s in firsts)),
        "episode/template_drift": float(sum(int(s.info["episode/template_drift"]) for s in firsts)),
        "episode/template_splits": float(sum(int(s.info["episode/template_splits"]) for s in firsts)),
    }
    for key in sorted({k for s in firsts for k in s.info if k.startswith("episode/events/")}):
        out[key] = float(sum(int(s.info.get(key, 0)) for s in firsts))
    analysed = [s for s in firsts if "episode/hindsight_lesson" in s.info]  # SEED's analyzer (agent/hindsight.py)
    if analysed:
        out["episode/hindsight_lessons"] = float(sum(int(s.info["episode/hindsight_lesson"]) for s in analysed))
    for reason in sorted({str(s.info["episode/finish"]) for s in firsts}):
        out[f"episode/finish/{reason}"] = float(sum(s.info["episode/finish"] == reason for s in firsts))
    return out


def step_batch(samples: Sequence[Sample]) -> StepBatch:
    """Where each sample sits in its episode, for the step-level estimators (`algos.step_credit`): a
    step-wise environment sample carries its state key and step reward in `info`; any other sample
    (a task's, a whole conversation) is no step of an episode (-1)."""
    steps = [s.episode is not None and "state_key" in s.info for s in samples]
    return StepBatch(
        episode=torch.tensor([int(s.episode or 0) if ok else -1 for s, ok in zip(samples, steps)], dtype=torch.long),
        step=torch.tensor([int(s.step_index or 0) if ok else 0 for s, ok in zip(samples, steps)], dtype=torch.long),
        state_key=torch.tensor([int(s.info["state_key"]) if ok else 0 for s, ok in zip(samples, steps)]),
        step_reward=torch.tensor(
            [float(s.info.get("step_reward", 0.0)) if ok else s.reward for s, ok in zip(samples, steps)],
            dtype=torch.float64,
        ),
    )


# ---------------------------------------------------------------------- drivers


def run_lockstep(
    episodes: Sequence[Episode], generate: Callable[[list[GenRequest]], list[Generation]]
) -> list[Episode]:
    """Every episode to its end, one batched `generate` per round over the episodes still running: the
    driver of held-out evaluation and validation batches, which run between training steps on any
    engine pool's blocking `generate` (no weight sync happens inside, so no turn is aborted)."""
    while True:
        live: list[tuple[Episode, GenRequest]] = []
        for e in episodes:
            req = None if e.done else e.request()
            if req is not None:
                live.append((e, req))
            elif not e.done:
                e.cut()
        if not live:
            return list(episodes)
        gens = generate([req for _, req in live])
        for (e, _), gen in zip(live, gens):
            out = TurnOutput()
            out.add(gen)
            e.advance(out)


async def generate_turn(
    episode: Episode, generate: Callable[[GenRequest], Awaitable[Generation]], max_parts: int = 64
) -> TurnOutput | None:
    """One model turn through the asynchronous engines: a request a weight sync aborted is sent again
    as context + tokens so far (a partial rollout), its tokens keeping their versions and μ. None when
    the episode has no budget for a turn."""
    out = TurnOutput()
    for part in range(max_parts):
        req = episode.request(out.ids, part)
        if req is None:
            if part == 0:
                return None
            out.finish_reason = "length"  # aborted on its last token of budget
            return out
        out.add(await generate(req))
        if out.finish_reason != "abort":
            return out
    raise RuntimeError(f"a turn was cut off {max_parts} times by weight syncs without finishing")


async def run_episode(episode: Episode, generate: Callable[[GenRequest], Awaitable[Generation]]) -> Episode:
    """One episode to its end through `generate` (a sync in between continues its turn)."""
    while not episode.done:
        out = await generate_turn(episode, generate)
        if out is None:
            episode.cut()
            break
        episode.advance(out)
    return episode
