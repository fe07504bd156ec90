"""The registration of the recipes (the hook protocol: `mcore_rl/hooks.py`).

One module per method that needs more than a pure tensor function of `mcore_rl.algos`; this tuple
is the one registration of their hooks (their config keys: `config/__init__.py: SECTIONS`). The order is the order their hooks run in within one hook point (POLARIS's
rescue before GEC's repair of what is still wrong, APPO's branches from the groups as repaired; MIPU and EffOPD exclude each other).
"""

from mcore_rl.recipes.appo import TreeRollouts
from mcore_rl.recipes.effopd import EffOPD
from mcore_rl.recipes.gec import GuidedErrorCorrection
from mcore_rl.recipes.judge_heads import JudgeHeads
from mcore_rl.recipes.mipu import MIPU
from mcore_rl.recipes.polaris import Polaris
from mcore_rl.recipes.remath import RefreshStop
from mcore_rl.recipes.s2l_po import SmallModelExplorer

RECIPES = (MIPU, EffOPD, SmallModelExplorer, Polaris, GuidedErrorCorrection, TreeRollouts, JudgeHeads, RefreshStop)

__all__ = ["RECIPES"]
