"""mcore_rl: a megatron-core based trainer for RL and on-policy distillation of LLMs."""

__version__ = "0.1.0"
