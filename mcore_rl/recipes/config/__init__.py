"""The recipes' config sections, one module per method, registered here once (`SECTIONS`).

The loader reads this tuple by name (`mcore_rl/config/sections.py`), so these modules import only
the core config dataclasses they hang under: loading a config never imports a recipe's machinery.
The order is the order of their keys in messages and in the configuration reference.
"""

from mcore_rl.recipes.config import appo, effopd, gec, mipu, polaris, remath, s2l_po

SECTIONS = (mipu.SECTION, effopd.SECTION, s2l_po.SECTION, polaris.SECTION, gec.SECTION, remath.SECTION, appo.SECTION)

__all__ = ["SECTIONS"]
