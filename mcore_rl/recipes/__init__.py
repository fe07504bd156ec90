"""Paper methods as plug-ins of the RL run (the hook protocol: `mcore_rl/hooks.py`).

One module per method that needs more than a pure tensor function of `mcore_rl.algos`, registered
once in `registry.py: RECIPES`; a method with config keys has its dataclass in `config/<method>.py`,
registered in `config/__init__.py: SECTIONS`. This package's own import stays light: loading a
config imports the sections and nothing heavy.
"""
