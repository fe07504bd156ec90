"""A reward for tests/test_recipes_polaris.py's loop run: one an untrained model often gets, so the
POLARIS rescue buffer fills (imported by name in the reward workers)."""

from mcore_rl.rewards import RewardInput


def starts_with_digit(s: RewardInput) -> float:
    """1 when the completion starts with a digit (what an addition answer does), else 0."""
    return float(s.completion[:1].isdigit())
