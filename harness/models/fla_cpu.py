"""A CPU path for flash-linear-attention models (guide 004's GLA) in tiny mode.

flash-linear-attention computes with Triton kernels and has none for the CPU. Its own reference
implementation (`fla.ops.gla.naive.naive_recurrent_gla`) and plain torch norms, SwiGLU and cross
entropy compute the same functions, so on a CPU we route fla's kernel entry points to them. The
model class, its config, its layers, peft and the training loop stay exactly as on a GPU; only the
innermost kernels differ, which is why tiny mode checks relative claims, not absolute bytes.
On a GPU nothing here is applied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_applied = False


def _gla_reference(q, k, v, g=None, gk=None, initial_state=None, output_final_state=False,
                   state_v_first=False, cu_seqlens=None, scale=None, **_unused):
    from fla.ops.gla.naive import naive_recurrent_gla

    if cu_seqlens is not None:
        raise NotImplementedError("variable-length batches have no CPU path in tiny mode")
    gate = gk if gk is not None else g
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    o, state = naive_recurrent_gla(q, k, v, gate, initial_state=initial_state,
                                   output_final_state=output_final_state)
    if state is not None and state_v_first:
        state = state.transpose(-1, -2)
    return o, state


def _rms(x, weight, bias, eps):
    dtype = x.dtype
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def _rmsnorm_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None:
        x = x + residual
    residual_out = x.float() if residual_in_fp32 else x
    y = _rms(x, self.weight, self.bias, self.eps)
    return (y, residual_out) if prenorm else y


def _gated_rmsnorm_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None:
        x = x + residual
    gate = torch.sigmoid if getattr(self, "activation", "swish") == "sigmoid" else F.silu
    y = _rms(x, self.weight, getattr(self, "bias", None), self.eps) * gate(g.float()).to(x.dtype)
    return (y, x) if prenorm else y


def _swiglu(x, y):
    return F.silu(x) * y


def _swiglu_linear(x, y, weight, bias):
    return F.linear(F.silu(x) * y, weight, bias)


class _CrossEntropy(torch.nn.CrossEntropyLoss):
    def __init__(self, inplace_backward: bool = False, reduction: str = "mean", **kwargs):
        super().__init__(reduction=reduction, ignore_index=kwargs.get("ignore_index", -100))


def apply() -> None:
    """Route fla's Triton entry points to reference torch code. Idempotent."""
    global _applied
    if _applied:
        return
    import fla.layers.gla as gla_layer
    import fla.models.modeling_utils as modeling_utils
    import fla.modules.mlp as mlp
    from fla.modules import FusedRMSNormGated, RMSNorm

    for name in ("chunk_gla", "fused_chunk_gla", "fused_recurrent_gla"):
        setattr(gla_layer, name, _gla_reference)
    mlp.swiglu = _swiglu
    mlp.swiglu_linear = _swiglu_linear
    RMSNorm.forward = _rmsnorm_forward
    FusedRMSNormGated.forward = _gated_rmsnorm_forward
    modeling_utils.FusedCrossEntropyLoss = _CrossEntropy
    _applied = True
