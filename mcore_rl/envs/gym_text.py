"""Gymnasium's toy-text games behind a text interface: the board as text in, an action word out.

The model names its move in words ("right", "pickup"); the last action word of its text counts, so it
may think aloud first. A turn without one is answered with the list of moves and counted as the event
"invalid_action" (it costs a turn, not the episode). The board is re-drawn after every move and is
also the state text. gymnasium is imported when the first game is built (it takes about 0.7 s).

Privileged context (`base.PRIVILEGED`): `solution`, the shortest list of moves from a state to a
rewarded end, found by breadth-first search over gymnasium's transition table (deterministic games
only: none for slippery ice), at reset and after every move; `outcome`, how the episode ended (its
last step). A self-teacher (SDAR, SEED) reads them; the policy never does.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.samples import Prompt
from mcore_rl.envs.base import PRIVILEGED, AgentAction, Environment, EnvReset, EnvStep

PRIVILEGED_NAMES = ("solution", "outcome")  # what every game here gives (register_env(privileged=...))


def parse_action(text: str, actions: tuple[str, ...]) -> int | None:
    """The index in `actions` of the last action word in `text` (whole words, any case), or None."""
    found = re.findall(r"[a-z]+", text.lower())
    for word in reversed(found):
        if word in actions:
            return actions.index(word)
    return None


@dataclass(frozen=True)
class GameSeeds:
    """The prompt source of a game: one start per prompt, its seed the label (a group shares it)."""

    game: str

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        import random

        rng = random.Random(seed)
        return [(f"{self.game} #{i}", {"seed": rng.randrange(2**31)}) for i in range(n)]


class GymTextEnv(Environment):
    """A toy-text gymnasium environment with its board drawn as text. Subclasses build the gymnasium
    environment (`make`), draw the board (`board`) and name the actions (`ACTIONS`, gymnasium's order)."""

    ACTIONS: tuple[str, ...] = ()
    RULES: str = ""

    def __init__(self, max_turns: int) -> None:
        self.max_turns = max_turns
        self.turns = 0
        self.obs = 0
        self.env: Any = None
        self.total = 0.0

    @abstractmethod
    def make(self, label: dict[str, Any]) -> Any: ...

    @abstractmethod
    def board(self) -> str: ...

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        label = prompt.label if isinstance(prompt.label, dict) else {}
        self.close()
        self.env = self.make(label)
        self.obs, _ = self.env.reset(seed=int(label.get("seed", seed)))
        self.turns, self.total = 0, 0.0
        moves = ", ".join(self.ACTIONS)
        text = f"{self.RULES}\nMoves: {moves}.\n{self.board()}"
        solution = self.solution_text()
        privileged = {"solution": solution} if solution else {}
        return EnvReset(messages=[{"role": "user", "content": text}], state=self.board(), privileged=privileged)

    def step(self, action: AgentAction) -> EnvStep:
        self.turns += 1
        info: dict[str, Any] = {}
        move = parse_action(action.text, self.ACTIONS)
        reward, done = 0.0, False
        if move is None:
            info["events"] = {"invalid_action": 1}
            text = f"Say one move: {', '.join(self.ACTIONS)}."
        else:
            self.obs, r, terminated, truncated, _ = self.env.step(move)
            reward, done = float(r), bool(terminated or truncated)
            self.total += reward
            text = self.board()
            if terminated:
                info["outcome"] = self.outcome()
        if not done and self.turns >= self.max_turns:
            done = True
            info["end_reason"] = "max_turns"
        if done:
            info["return"] = self.total
            info[PRIVILEGED + "outcome"] = (
                f"The episode ended after {self.turns} turns ({info.get('outcome', info.get('end_reason', 'done'))}), "
                f"return {self.total:g}. The board:\n{self.board()}"
            )
        else:
            solution = self.solution_text()
            if solution:
                info[PRIVILEGED + "solution"] = solution
        return EnvStep([{"role": "user", "content": text}], reward=reward, done=done, state=self.board(), info=info)

    def outcome(self) -> str:
        return "done"

    def solution(self) -> list[str] | None:
        """The shortest move list from the current state to a rewarded end (breadth-first over
        gymnasium's table `P[s][a] = [(p, s', r, terminated)]`); None when there is none or when a move
        has more than one outcome (slippery ice: no list of moves is a solution)."""
        table = getattr(self.env.unwrapped, "P", None)
        if table is None:
            return None
        start = int(self.obs)
        parent: dict[int, tuple[int, int]] = {}
        seen, queue = {start}, deque([start])
        while queue:
            s = queue.popleft()
            for a, outcomes in table[s].items():
                if len(outcomes) != 1:
                    return None
                _, nxt, reward, terminated = outcomes[0]
                if terminated and reward > 0:
                    moves = [self.ACTIONS[a]]
                    while s != start:
                        s, prev = parent[s]
                        moves.append(self.ACTIONS[prev])
                    return moves[::-1]
                if not terminated and nxt not in seen:
                    seen.add(nxt)
                    parent[nxt] = (s, a)
                    queue.append(nxt)
        return None

    def solution_text(self) -> str:
        moves = self.solution()
        return f"Moves from here to the goal: {', '.join(moves)}." if moves else ""

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None
