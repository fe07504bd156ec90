"""`mcore-rl profile`: parallel layouts and the RL train/inference split, estimated before a cluster
is spent on them (and, with `--measure`, checked against real steps on this machine).

One idea per module: the cluster description (`cluster.py`), the layouts the trainer accepts
(`layouts.py`), per-GPU memory (`memory.py`), step time (`timing.py`), the RL GPU split
(`split.py`), real steps under `torch.profiler` (`measure.py`), tables and JSON (`report.py`),
and the command that ties them (`command.py`). Only `mcore_rl/cli.py` imports this package.
"""
