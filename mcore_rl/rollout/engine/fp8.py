"""FP8 (e4m3) weights with 128x128 block scales, as DeepSeek-V3 and SGLang's "fp8" checkpoints hold them.

Layout (what a block-quantized checkpoint stores for a Linear `x`):
  `x.weight`           float8_e4m3fn [out, in]
  `x.weight_scale_inv` float32 [ceil(out/128), ceil(in/128)]; dequantized w = weight * scale_inv (per block)

Activations are quantized per token per 128-channel group before the matmul, as SGLang's
`w8a8_block_fp8_matmul` does. Here both operands are dequantized and multiplied in the compute
dtype (a portable emulation of the FP8 GEMM: the rounding of weights and activations to e4m3 is
what changes the log-probs, not the accumulation), so FP8 mode runs on CPU and reproduces a real
train-inference mismatch. Which Linears are quantized follows SGLang: every Linear of the decoder
layers except the MoE router (LatentMoE's latent projections included, see `is_fp8_weight`);
embeddings (n-gram tables too), lm_head, norms and AttnRes depth mixers stay in the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_SUFFIX = ".weight_scale_inv"


def _pad_to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    out, inp = x.shape
    pad_o, pad_i = (-out) % block, (-inp) % block
    return torch.nn.functional.pad(x, (0, pad_i, 0, pad_o)) if pad_o or pad_i else x


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (e4m3 [out, in], fp32 scale_inv [ceil(out/b), ceil(in/b)]).

    Each block's scale maps its absolute maximum to 448, so no value saturates; an all-zero block
    gets scale 1 (any scale reproduces zeros exactly).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_block_fp8 expects a 2-D weight, got shape {tuple(w.shape)}")
    out, inp = w.shape
    nb_o, nb_i = -(-out // block), -(-inp // block)
    blocks = _pad_to_blocks(w.float(), block).view(nb_o, block, nb_i, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(nb_o * block, nb_i * block)[:out, :inp].contiguous()
    return q, scale_inv.contiguous()


def dequantize_block_fp8(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = BLOCK
) -> torch.Tensor:
    """Inverse of `quantize_block_fp8`: e4m3 [out, in] * per-block scale_inv -> `dtype` [out, in]."""
    out, inp = q.shape
    expected = (-(-out // block), -(-inp // block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for weight {tuple(q.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]
    return (q.float() * scale).to(dtype)


def quantize_activation_fp8(x: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """Round x [..., in] to e4m3 with one scale per token per `group` channels; returns the
    dequantized values in x's dtype (what the FP8 GEMM effectively multiplies)."""
    inp = x.shape[-1]
    pad = (-inp) % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    g = xf.view(*xf.shape[:-1], -1, group)
    scale = (g.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    deq = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale
    return deq.view(*xf.shape)[..., :inp].to(x.dtype)


class Fp8Linear(nn.Module):
    """A Linear whose weight is held as e4m3 + block scales (the checkpoint's names and layout).

    The dequantized weight is cached in the compute dtype for speed and rebuilt whenever `weight`
    or `weight_scale_inv` is replaced (weight updates go through `set_weight`/`set_quantized`).
    """

    weight: torch.Tensor  # buffers, registered in __init__
    weight_scale_inv: torch.Tensor
    bias: nn.Parameter | None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = dtype
        nb = (-(-out_features // BLOCK), -(-in_features // BLOCK))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale_inv", torch.ones(nb, dtype=torch.float32, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self._dequantized: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> Fp8Linear:
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, linear.weight.device)
        m.set_weight(linear.weight.detach())
        if linear.bias is not None and m.bias is not None:
            m.bias.data.copy_(linear.bias.detach().to(dtype))
        return m

    def set_weight(self, w: torch.Tensor) -> None:
        """Quantize a full-precision weight into this layer."""
        q, s = quantize_block_fp8(w.to(self.weight.device))
        self.set_quantized(q, s)

    def set_quantized(self, q: torch.Tensor | None = None, scale_inv: torch.Tensor | None = None) -> None:
        """Take an already-quantized weight and/or its scales (they may arrive in separate buckets)."""
        if q is not None:
            if tuple(q.shape) != tuple(self.weight.shape):
                raise ValueError(f"fp8 weight has shape {tuple(q.shape)}, expected {tuple(self.weight.shape)}")
            self.weight.copy_(q.to(FP8_DTYPE))
        if scale_inv is not None:
            if tuple(scale_inv.shape) != tuple(self.weight_scale_inv.shape):
                raise ValueError(
                    f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {tuple(self.weight_scale_inv.shape)}"
                )
            self.weight_scale_inv.copy_(scale_inv.float())
        self._dequantized = None

    def dequantized_weight(self) -> torch.Tensor:
        if self._dequantized is None:
            self._dequantized = dequantize_block_fp8(self.weight, self.weight_scale_inv, self.compute_dtype)
        return self._dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(quantize_activation_fp8(x), self.dequantized_weight(), self.bias)


def is_fp8_weight(hf_name: str) -> bool:
    """Whether the HF parameter `hf_name` is held in FP8 by an FP8 engine (SGLang's choice): the
    projection weights of the decoder layers (`*_proj.weight`: attention, MLP, experts, shared
    expert, and LatentMoE's `fc1_latent_proj` / `fc2_latent_proj`), not the router
    (`mlp.gate.weight`), norms, embeddings or lm_head. A weight sync uses this to decide what to
    quantize and send as `weight` + `weight_scale_inv`.

    LatentMoE's W_down / W_up are quantized on purpose: they are plain per-token GEMMs like the
    experts they feed, and SGLang's (and vLLM's) Nemotron-H latent MoE builds them as
    `ReplicatedLinear(..., quant_config=quant_config)`, so an FP8 SGLang run rounds them too; block
    scales cover a latent size that is not a multiple of 128 (the last block is partial). Not
    quantized, being no GEMM weights: AttnRes pseudo-queries and key norms (`*_res.query`,
    `*_res.norm.weight`) and the n-gram tables and projections (`model.ngram_embeddings.*`, outside
    the decoder layers, like the token embedding)."""
    return hf_name.startswith("model.layers.") and hf_name.endswith("_proj.weight")


def is_quantized_linear_name(module_name: str) -> bool:
    """`is_fp8_weight` for a Linear's module path (`model.layers.0.mlp.up_proj`)."""
    return is_fp8_weight(module_name + ".weight")


def quantize_model_fp8(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Replace every eligible nn.Linear of `model` by an `Fp8Linear` in place; returns their names."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and is_quantized_linear_name(n)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Fp8Linear.from_linear(getattr(parent, child), dtype))
    return names
