"""The token-exact trajectory of a multi-turn episode: ids as the model saw and produced them.

A model turn's tokens are the engine's output ids, kept as they are: never decoded and encoded again
(a re-encoding can split the same text differently and the learner would then train on tokens the
model never sampled). What the environment says back (tool results, observations, feedback) is
rendered with the model's chat template as an *increment*: the text the template puts after a
finished assistant turn, up to and including the next generation prompt, encoded and appended.

Every token carries whether the learner trains on it (model tokens 1; template headers, tool and
observation tokens 0; text the harness writes on the model's behalf, such as the end-of-turn marker
of a turn cut at the token cap, 0), the weight version it was sampled under and μ, the engine's
log-prob (0.0 and the latest version on tokens the model did not sample, so they never count in the
staleness bound).

The prefix invariant (the chat template renders the conversation so far to exactly these tokens)
is checked after every turn. Templates that are not append-only break it (Qwen3 strips the
`<think>` block of earlier assistant turns once a new user message follows); `TemplatePolicy` says
what to do: `keep` the exact tokens (the model is trained on what it saw; a served model would
have seen the stripped form), or `split`: close the current segment as a sample and start a new one
whose prompt is the template's rendering, so each turn is trained once, in the context the template
gives it. Either way the event is counted (`Trajectory.drift`), never asserted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.data.tool_calls import ToolSpec
from mcore_rl.envs.base import Message

TemplatePolicy = Literal["keep", "split"]

# the ChatML layout of the byte tokenizer, which has no chat template of its own (the same layout
# `mcore-rl serve` falls back to for chat requests)
CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"

# the probe messages an increment is rendered after (any finished exchange would do)
_PROBE = [{"role": "user", "content": "\x00probe-user"}, {"role": "assistant", "content": "\x00probe-assistant"}]


class TemplateError(ValueError):
    """The chat template cannot render an increment (it does not extend a finished exchange)."""


class ChatFormat:
    """How chat messages become ids for one tokenizer: its own chat template (a Hugging Face
    tokenizer with one), else ChatML with `<|im_end|>` as the end of an assistant turn.

    `tools` are offered to the template (`apply_chat_template(tools=...)`), `template_kwargs` go to
    it as they are (`enable_thinking`, ...)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tools: list[ToolSpec] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = [t.to_openai() for t in tools or []]
        self.template_kwargs = dict(template_kwargs or {})
        self.has_template = bool(getattr(tokenizer, "has_chat_template", False))
        self.closing = self._closing()
        self.stop_ids = self._stop_ids()

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        """The conversation as the template writes it (text, not ids)."""
        if self.has_template:
            kwargs = dict(self.template_kwargs)
            if self.tools:
                kwargs["tools"] = self.tools
            text = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]  # has_template says it has one
                [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
            return str(text)
        text = "".join(f"{CHATML_START}{m['role']}\n{m.get('content') or ''}{CHATML_END}\n" for m in messages)
        return text + (f"{CHATML_START}assistant\n" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The ids of the opening messages with the generation prompt (an episode's first prompt)."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def increment(self, messages: list[Message]) -> list[int]:
        """The ids the template appends after a finished assistant turn for `messages` (tool results,
        observations), up to and including the next generation prompt."""
        base = self.render(_PROBE, add_generation_prompt=False)
        full = self.render(_PROBE + list(messages), add_generation_prompt=True)
        if not full.startswith(base):
            raise TemplateError("the chat template does not extend a finished exchange: no increment exists")
        return self.encode(full[len(base) :])

    def _closing(self) -> str:
        """What the template writes after an assistant message's content (e.g. `<|im_end|>\\n`)."""
        probe = _PROBE[1]["content"]
        text = self.render(_PROBE, add_generation_prompt=False)
        at = text.rfind(probe)
        if at < 0:
            raise TemplateError("the chat template does not render an assistant message's content as it is")
        return text[at + len(probe) :]

    def _stop_ids(self) -> list[int]:
        """The ids that end a model turn: the eos, and the closing's first token when it is a special
        token of its own (ChatML's `<|im_end|>`; not a newline byte)."""
        ids = [int(self.tokenizer.eos_id)]
        head = self.encode(self.closing)[:1]
        said = self.decode(head) if head else ""
        if head and head[0] not in ids and len(said) > 1 and self.closing.startswith(said):
            ids.append(head[0])
        return ids

    def closes(self, output_ids: list[int]) -> bool:
        """Did the model end its turn with the closing's own first token (`<|im_end|>`)? Then that
        token stands for the start of the closing; any other ending (an eos, a cut) is content."""
        if not output_ids or output_ids[-1] not in self.stop_ids:
            return False
        said = self.decode(output_ids[-1:])
        return bool(said) and self.closing.startswith(said)

    def end_of_turn(self, output_ids: list[int]) -> list[int]:
        """The ids the harness appends after a model turn so that it ends as the template ends an
        assistant message: the rest of the closing after the model's own end-of-turn token, or the
        whole closing after a turn that was cut (or stopped on another token)."""
        if self.closes(output_ids):
            return self.encode(self.closing[len(self.decode(output_ids[-1:])) :])
        return self.encode(self.closing)


@dataclass
class Segment:
    """One sample's worth of a trajectory: a prompt, then response tokens with their per-token
    trainable flag, μ and weight version."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    trainable: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.ids


@dataclass
class Turn:
    """One model turn as the trajectory recorded it."""

    text: str  # the model's decoded output (for parsing and for the environment), stop token kept
    output_ids: list[int]
    finish_reason: str


class Trajectory:
    """A growing conversation of one episode, as ids; `segments[-1]` is the one that grows.

    `messages` mirrors it as chat messages (the model's turns as their decoded text) for the
    prefix check and for a `split` segment's prompt; `drift` counts turns where the template's
    rendering no longer matched the ids (by `policy`, kept or split)."""

    def __init__(self, chat: ChatFormat, opening: list[Message], policy: TemplatePolicy = "keep") -> None:
        self.chat, self.policy = chat, policy
        self.messages: list[Message] = [dict(m) for m in opening]
        self.segments = [Segment(chat.prompt_ids(self.messages))]
        self.turns: list[Turn] = []
        self.drift = 0  # turns after which the template's rendering differed from the ids
        self.splits = 0  # new segments started for it (policy split)

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    @property
    def context_ids(self) -> list[int]:
        """What the next model turn continues: the current segment's prompt and response so far."""
        return self.current.all_ids

    @property
    def version(self) -> int:
        """The newest weight version of a model token so far (-1 before the first)."""
        return max((v for s in self.segments for v in s.versions), default=-1)

    def _append(self, ids: list[int], trainable: int, logps: list[float] | None, versions: list[int] | None) -> None:
        seg = self.current
        n = len(ids)
        seg.ids += list(ids)
        seg.trainable += [trainable] * n
        seg.logps += list(logps) if logps is not None else [0.0] * n
        fill = self.version if self.version >= 0 else 0
        seg.versions += list(versions) if versions is not None else [fill] * n

    def add_model_turn(
        self, output_ids: list[int], logps: list[float], versions: list[int], finish_reason: str
    ) -> Turn:
        """The engine's output ids of one turn, appended as they are (trainable), then the rest of the
        template's end of an assistant message (not trainable: the harness wrote it)."""
        if not (len(output_ids) == len(logps) == len(versions)):
            raise ValueError(
                f"a model turn of {len(output_ids)} ids came with {len(logps)} μ and {len(versions)} versions"
            )
        self._append(output_ids, 1, logps, versions)
        self._append(self.chat.end_of_turn(output_ids), 0, None, None)
        text = self.chat.decode(output_ids)
        turn = Turn(text, list(output_ids), finish_reason)
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": self._content(output_ids)})
        return turn

    def _content(self, output_ids: list[int]) -> str:
        """The assistant message's content as the template would have to render it: the decoded
        output without the end-of-turn token the closing stands for (an eos stays: it is content)."""
        return self.chat.decode(output_ids[:-1] if self.chat.closes(output_ids) else output_ids)

    def add_observation(self, messages: list[Message]) -> None:
        """Environment / tool messages, rendered as the template's increment (not trainable), ending
        with the next generation prompt; then the prefix check."""
        self.messages += [dict(m) for m in messages]
        self._append(self.chat.increment(messages), 0, None, None)
        self.check_prefix()

    def check_prefix(self) -> bool:
        """Does the template render the conversation so far to exactly the current segment's ids?
        If not: count it, and under `split` start a new segment from the template's rendering."""
        rendered = self.chat.render(self.messages, add_generation_prompt=True)
        if self.chat.decode(self.context_ids) == rendered:
            return True
        self.drift += 1
        if self.policy == "split":
            self.segments.append(Segment(self.chat.encode(rendered)))
            self.splits += 1
        return False

    def samples(self, prompt: Prompt, finish_reason: str) -> list[Sample]:
        """The trajectory as samples, one per segment with any model token: the response is
        everything after the segment's prompt, `trainable` marks the model's tokens; the last
        segment ends with the episode's `finish_reason`, earlier ones with "split"."""
        out = []
        live = [s for s in self.segments if any(s.trainable)]
        for k, seg in enumerate(live):
            ids, trainable, logps, versions = _trim_tail(seg)
            model_versions = [v for v, t in zip(versions, trainable) if t]
            out.append(
                Sample(
                    replace(prompt, ids=list(seg.prompt_ids)),
                    prompt.index,
                    ids,
                    logps,
                    min(model_versions),
                    finish_reason if k == len(live) - 1 else "split",
                    self.chat.decode(ids),
                    token_versions=versions if len(set(versions)) > 1 else None,
                    trainable=trainable,
                )
            )
        return out


def _trim_tail(seg: Segment) -> tuple[list[int], list[int], list[float], list[int]]:
    """The segment without its trailing untrainable tokens (an observation after the last model
    turn, a generation prompt nobody answered): nothing after the last trainable token is learned."""
    end = max(i for i, t in enumerate(seg.trainable) if t) + 1
    return seg.ids[:end], seg.trainable[:end], seg.logps[:end], seg.versions[:end]
