"""FrozenLake (gymnasium) as text: walk from S to G on a grid of frozen tiles (F) without falling into a
hole (H). The map is drawn from the prompt's seed (`gymnasium`'s `generate_random_map`, always with a
path), so a group plays one map; reward 1 on reaching G, else 0. Not slippery by default (the moves are
what the model said); `slippery: true` is gymnasium's stochastic version, its randomness from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_rl.envs import register_env
from mcore_rl.envs.gym_text import PRIVILEGED_NAMES, GameSeeds, GymTextEnv


@dataclass(frozen=True)
class FrozenLakeOptions:
    size: int = 4
    frozen_prob: float = 0.8  # the chance that a tile is frozen (walkable) in a generated map
    slippery: bool = False
    max_turns: int = 20

    def __post_init__(self) -> None:
        if not 2 <= self.size <= 12:
            raise ValueError(f"option 'size' must be 2..12, got {self.size}")
        if not 0.0 < self.frozen_prob <= 1.0:
            raise ValueError(f"option 'frozen_prob' must be in (0, 1], got {self.frozen_prob}")
        if self.max_turns < 1:
            raise ValueError(f"option 'max_turns' must be >= 1, got {self.max_turns}")


def _prompts(options: FrozenLakeOptions) -> GameSeeds:
    return GameSeeds(f"frozen lake {options.size}x{options.size}")


@register_env(
    "frozen_lake",
    options=FrozenLakeOptions,
    prompts=_prompts,
    origin="own generator (a map per prompt)",
    privileged=PRIVILEGED_NAMES,
)
class FrozenLakeEnv(GymTextEnv):
    ACTIONS = ("left", "down", "right", "up")  # gymnasium's action ids 0..3
    RULES = "Walk from S to G on the ice. F is safe, H is a hole. You are P."

    def __init__(self, options: FrozenLakeOptions) -> None:
        super().__init__(options.max_turns)
        self.options = options

    def make(self, label: dict[str, Any]) -> Any:
        import gymnasium  # lazy: 0.7 s, and only environments of this kind need it
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        o = self.options
        desc = generate_random_map(size=o.size, p=o.frozen_prob, seed=int(label.get("seed", 0)))
        return gymnasium.make("FrozenLake-v1", desc=desc, is_slippery=o.slippery, max_episode_steps=10**6)

    def board(self) -> str:
        desc = self.env.unwrapped.desc
        n = desc.shape[1]
        row, col = divmod(int(self.obs), n)
        lines = []
        for r in range(desc.shape[0]):
            cells = [c.decode() for c in desc[r]]
            if r == row:
                cells[col] = "P"
            lines.append("".join(cells))
        return "\n".join(lines)

    def outcome(self) -> str:
        desc = self.env.unwrapped.desc
        row, col = divmod(int(self.obs), desc.shape[1])
        return "goal" if desc[row, col] == b"G" else "hole"
