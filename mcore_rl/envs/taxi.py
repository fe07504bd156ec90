"""Taxi (gymnasium) as text: drive to the passenger, pick them up, drop them off at the destination.

The board is gymnasium's 5x5 map with its walls (`|`), the four stands R, G, Y, B, and the taxi drawn
as `T` (`@` with the passenger aboard); the text under it says where the passenger waits and where
they go. The start is drawn from the prompt's seed, so a group plays one start. Rewards are
gymnasium's: -1 per move, +20 for a right drop-off, -10 for a wrong pickup or drop-off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_rl.envs import register_env
from mcore_rl.envs.gym_text import PRIVILEGED_NAMES, GameSeeds, GymTextEnv

STANDS = "RGYB"


@dataclass(frozen=True)
class TaxiOptions:
    max_turns: int = 30

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"option 'max_turns' must be >= 1, got {self.max_turns}")


def _prompts(options: TaxiOptions) -> GameSeeds:
    return GameSeeds("taxi")


@register_env(
    "taxi",
    options=TaxiOptions,
    prompts=_prompts,
    origin="own generator (a start per prompt)",
    privileged=PRIVILEGED_NAMES,
)
class TaxiEnv(GymTextEnv):
    ACTIONS = ("south", "north", "east", "west", "pickup", "dropoff")  # gymnasium's action ids 0..5
    RULES = "Drive the taxi (T) to the passenger, pickup, drive to the destination, dropoff. | is a wall."

    def __init__(self, options: TaxiOptions) -> None:
        super().__init__(options.max_turns)
        self.options = options

    def make(self, label: dict[str, Any]) -> Any:
        import gymnasium  # lazy: 0.7 s, and only environments of this kind need it

        return gymnasium.make("Taxi-v4", max_episode_steps=10**6)

    def board(self) -> str:
        taxi_row, taxi_col, passenger, destination = self.env.unwrapped.decode(int(self.obs))
        rows = [[c.decode() for c in row] for row in self.env.unwrapped.desc]
        rows[1 + taxi_row][2 * taxi_col + 1] = "@" if passenger == 4 else "T"
        where = "in the taxi" if passenger == 4 else f"at {STANDS[passenger]}"
        return "\n".join("".join(r) for r in rows) + f"\nPassenger {where}; destination {STANDS[destination]}."

    def outcome(self) -> str:
        return "delivered"
