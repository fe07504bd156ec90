"""Multi-turn episodes: token-exact trajectories and the episode runner (between `rollout` and `train`)."""
