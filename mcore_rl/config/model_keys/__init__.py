"""The model's sections: the `model.*` keys a model feature or family owns, one dataclass each,
registered here once.

`ModelConfig` (`config/schema.py`) holds the keys every decoder shares; the keys of MoE, LatentMoE,
AttnRes, the n-gram embeddings and each family of `hf/families.py` are a `config/sections.py: Section`
of theirs, flat under their own names (`model.q_lora_rank`) or, for the n-gram embeddings, their own
mapping (`model.ngram`). Code reads one typed: `cfg.model.section(DeepSeekV3Keys).q_lora_rank`.

They sit here, not in the bundles' `hf/` and `models/` modules, because loading a config must import
no torch (`mcore_rl.hf` imports transformers when the package loads) and `hf/` may import `config`
but not `models`. The loader reads `SECTIONS` by name (`sections.py: SECTIONS_MODULES`); the order is
the order of their keys in messages and in the configuration reference.
"""

from mcore_rl.config.model_keys import attn_res, deepseek_v3, gpt_oss, latent_moe, moe, mtp, ngram

# The keys of a model family (`hf/families.py: FAMILIES`): its bundle checks them on every config
# (a model of another arch leaves them at their defaults); add a family's section here.
FAMILY_SECTIONS = (deepseek_v3.SECTION, gpt_oss.SECTION)
SECTIONS = (moe.SECTION, latent_moe.SECTION, attn_res.SECTION, ngram.SECTION, mtp.SECTION, *FAMILY_SECTIONS)

__all__ = ["FAMILY_SECTIONS", "SECTIONS"]
