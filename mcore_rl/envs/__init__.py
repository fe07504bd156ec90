"""Interactive tasks for multi-turn RL: environments and the tools they offer (see `base.Environment`)."""
