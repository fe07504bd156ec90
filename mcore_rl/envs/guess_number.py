"""Guess-the-number: the policy guesses a secret integer, the environment answers "higher" or "lower".

A multi-turn task the 2-layer demo model (byte-level tokenizer, 256 positions) can learn: every message
is a few bytes (prompt "guess 1-16", a guess "8", feedback "higher"), and the optimal policy, binary
search, needs at most ceil(log2(hi - lo + 1)) guesses, so the reward of fewer guesses rewards search.

The secret is the prompt's label (the prompt source draws it from its seed), so the G episodes of a
group start from the same state; a prompt without a label draws it from the reset seed. The state text
is the interval the feedback so far leaves ("9-16"): steps with the same knowledge share it.

Two options make the task easier to learn and to hold out (the agentic demo uses both):
`feedback: interval` answers "higher 5-8" instead of "higher", so the best next guess (the middle of
the interval) depends on the last message alone, not on remembering the whole conversation; and
`min_span > 0` gives every prompt its own range inside `lo`-`hi` ("guess 3-7", at least `min_span`
numbers), so a (range, secret) pair can be held out of training: with one fixed range there are only
`hi - lo + 1` states.

With `fresh_secret`, every group draws its secret from its reset seed (the prompt gives only the
range): with a few secrets per range in the training pool, a policy can learn *those* secrets (a
search tree that finds them, and misses the held-out ones); with fresh secrets only search pays. The
held-out games stay fixed (their reset seeds are), but a held-out (range, secret) pair is then no
longer kept out of training: what is held out is a set of games, not a set of states.

Its scripted player (`demonstrate`, for an SFT warm start) plays by `player`: "open" names a number
still open, uniformly (valid play that reads the feedback but does not search: 69% solved on the
agentic demo's options), "range" any number of the range (feedback ignored: 38.5%), "middle" the
middle of the numbers still open (binary search: 97%). `benchmarks/guess_number_baselines.py`
measures each.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Literal

from mcore_rl.data.samples import Prompt
from mcore_rl.envs import register_env
from mcore_rl.envs.base import PRIVILEGED, AgentAction, Environment, EnvReset, EnvStep

_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class GuessNumberOptions:
    """`lo`..`hi` inclusive; `max_guesses` turns (an unreadable guess costs one); the reward of a right
    guess is 1 minus `turn_penalty` per guess before it (never below 0), a miss scores 0. `feedback`:
    "direction" ("higher") or "interval" ("higher 5-8": the numbers still open); `min_span` > 0: each
    prompt draws its own range of at least that many numbers inside `lo`-`hi`."""

    lo: int = 1
    hi: int = 16
    max_guesses: int = 6
    turn_penalty: float = 0.0
    feedback: Literal["direction", "interval"] = "direction"
    min_span: int = 0
    player: Literal["open", "range", "middle"] = "open"  # the scripted player of warm starts (`demonstrate`)
    fresh_secret: bool = False  # draw each group's secret from its reset seed, not the prompt's label

    def __post_init__(self) -> None:
        if self.hi <= self.lo:
            raise ValueError(f"option 'hi' ({self.hi}) must be above 'lo' ({self.lo})")
        if self.max_guesses < 1:
            raise ValueError(f"option 'max_guesses' must be >= 1, got {self.max_guesses}")
        if not 0.0 <= self.turn_penalty <= 1.0:
            raise ValueError(f"option 'turn_penalty' must be in [0, 1], got {self.turn_penalty}")
        if self.feedback not in ("direction", "interval"):
            raise ValueError(f"option 'feedback' must be 'direction' or 'interval', got {self.feedback!r}")
        if self.player not in ("open", "range", "middle"):
            raise ValueError(f"option 'player' must be 'open', 'range' or 'middle', got {self.player!r}")
        if self.min_span != 0 and not 2 <= self.min_span <= self.hi - self.lo + 1:
            raise ValueError(
                f"option 'min_span' must be 0 (one fixed range) or 2..{self.hi - self.lo + 1} (hi - lo + 1), "
                f"got {self.min_span}"
            )


def prompt_text(lo: int, hi: int) -> str:
    return f"guess {lo}-{hi}"


@dataclass(frozen=True)
class GuessNumberPrompts:
    """The prompt source: a secret per prompt (the label), drawn from the seed; with `min_span` also a
    range per prompt (the label is then {"lo", "hi", "secret"} and the text names the range)."""

    options: GuessNumberOptions

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        rng = random.Random(seed)
        o = self.options
        if not o.min_span:
            return [(prompt_text(o.lo, o.hi), rng.randint(o.lo, o.hi)) for _ in range(n)]
        out: list[tuple[str, Any]] = []
        for _ in range(n):
            lo = rng.randint(o.lo, o.hi - o.min_span + 1)
            hi = rng.randint(lo + o.min_span - 1, o.hi)
            out.append((prompt_text(lo, hi), {"lo": lo, "hi": hi, "secret": rng.randint(lo, hi)}))
        return out


def parse_guess(text: str) -> int | None:
    """The first integer of the model's text, or None."""
    m = _INT.search(text)
    return int(m.group()) if m else None


@register_env(
    "guess_number",
    options=GuessNumberOptions,
    prompts=GuessNumberPrompts,
    origin="own generator (secret per prompt)",
    privileged=("solution", "outcome"),
)
class GuessNumberEnv(Environment):
    def __init__(self, options: GuessNumberOptions) -> None:
        self.options = options
        self.secret = options.lo
        self.lo, self.hi = options.lo, options.hi  # this episode's range
        self.low, self.high = options.lo, options.hi  # what the feedback so far leaves open
        self.guesses = 0

    def _state(self) -> str:
        return f"{self.low}-{self.high}"

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        o = self.options
        label = prompt.label
        self.lo, self.hi = o.lo, o.hi
        if isinstance(label, dict):  # a range of its own (min_span)
            self.lo, self.hi, label = int(label["lo"]), int(label["hi"]), label["secret"]
            if not o.lo <= self.lo < self.hi <= o.hi:
                raise ValueError(f"guess_number: the prompt's range {self.lo}-{self.hi} is outside {o.lo}-{o.hi}")
        if o.fresh_secret:
            label = None
        if isinstance(label, int) and not isinstance(label, bool):
            if not self.lo <= label <= self.hi:
                raise ValueError(f"guess_number: the prompt's secret {label} is outside {self.lo}-{self.hi}")
            self.secret = label
        else:
            self.secret = random.Random(seed).randint(self.lo, self.hi)
        self.low, self.high, self.guesses = self.lo, self.hi, 0
        text = prompt_text(self.lo, self.hi)
        return EnvReset(
            messages=[{"role": "user", "content": text}], state=self._state(), privileged={"solution": self._solution()}
        )

    def _solution(self) -> str:
        """The privileged answer (`base.PRIVILEGED`): a self-teacher that knows the secret."""
        return f"The secret number is {self.secret}."

    def step(self, action: AgentAction) -> EnvStep:
        o = self.options
        self.guesses += 1
        left = o.max_guesses - self.guesses
        guess = parse_guess(action.text)
        info: dict[str, Any] = {"guesses": self.guesses}
        if guess is None or not self.lo <= guess <= self.hi:
            info["events"] = {"invalid_action": 1}
            feedback = f"say a number {self.lo}-{self.hi}"
        elif guess == self.secret:
            reward = max(0.0, 1.0 - o.turn_penalty * (self.guesses - 1))
            info["solved"] = True
            info[PRIVILEGED + "outcome"] = f"Solved: {self.secret} on guess {self.guesses}."
            return EnvStep([_user("yes")], reward=reward, done=True, state="solved", info=info)
        elif guess < self.secret:
            self.low = max(self.low, guess + 1)
            feedback = "higher"
        else:
            self.high = min(self.high, guess - 1)
            feedback = "lower"
        if o.feedback == "interval" and guess is not None and self.lo <= guess <= self.hi:
            feedback = f"{feedback} {self._state()}"
        done = left <= 0
        if done:
            info["solved"] = False
            info[PRIVILEGED + "outcome"] = f"Not solved in {self.guesses} guesses: the secret was {self.secret}."
        else:
            info[PRIVILEGED + "solution"] = self._solution()
        return EnvStep([_user(feedback)], reward=0.0, done=done, state=self._state(), info=info)

    def demonstrate(self, rng: random.Random) -> str | None:
        player = self.options.player
        if player == "range":
            return str(rng.randint(self.lo, self.hi))
        if player == "middle":
            return str((self.low + self.high) // 2)
        return str(rng.randint(self.low, self.high))


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}
