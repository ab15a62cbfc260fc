"""Fake-tensor execution of one training micro-step (the heavy half of `harness.predict.trace.trace`).

Builds the truncated model on `meta` as the case's stack does, moves it to fake `cpu` storage
inside `FakeTensorMode` and runs forward + backward under `AllocationLog` (the live-tensor tracker of
`harness.measure.trackers`, logging each allocation and free with its decoder layer).
See `harness.predict.trace.trace` for what is reproduced and why.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import time
import types
import warnings

import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from harness.measure.trackers import LiveTensorTracker
from harness.models.registry import Architecture, hf_config, truncated_config
from harness.predict.constants import (
    BNB_BLOCKSIZE,
    CUDNN_BACKWARD_HEAD_DIM,
    CUDNN_BACKWARD_HEAD_DIMS,
    CUDNN_DROPOUT_STEPS,
    CUDNN_HEAD_DIM_MULTIPLE,
    CUDNN_MAX_BATCH_OR_HEADS,
    CUDNN_MAX_HEAD_DIM,
    SMS,
    THREADS_PER_SM,
)
from harness.predict.step import BACKWARD, FORWARD, LAYER_POST, LAYER_PRE, ParamInfo, TraceResult, TraceSpec
from harness.predict.zero3.hook_calls import positions
from harness.spec.schema import Precision, Stack

DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16, Precision.fp32: torch.float32}


def _hf_model(config: dict, dtype: torch.dtype, attn: str | None = None, notes: list[str] | None = None):
    """The model on meta, built with the attention implementation `attn` (None: the installed
    transformers' default). Where that transformers refuses `attn` (5.24: no SDPA for Gemma-2, whose
    logit softcapping SDPA lacks; flash_attention_2 where flash-attn is not installed), the model is
    built with its default and `attn` set on its config, so its attention and its masks dispatch through
    that interface anyway; lines in `notes` say so where the architecture itself is refused, and that
    flash_attention_2 runs as a stand-in (`_attention_interfaces`)."""

    kwargs = {} if attn is None else {"attn_implementation": attn}
    refusal = None
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(hf_config(config), dtype=dtype, **kwargs)
        except (ValueError, ImportError) as exc:
            if attn is None:
                raise
            refusal = str(exc).strip().split(". ")[0].split("\n")[0].rstrip(".")
            model = AutoModelForCausalLM.from_config(hf_config(config), dtype=dtype)
    said = []
    if attn == "flash_attention_2":  # flash-attn's CUDA kernels have no fake implementation
        said.append("attention: flash_attention_2 traced through a stand-in that keeps what flash-attn 2's "
                    "kernels keep (the output and a log-sum-exp per row, no score matrices)")
        if getattr(model, "_supports_flash_attn", False):
            refusal = None  # the architecture takes it; the refusal was this machine's (no flash-attn, no GPU)
    if refusal is not None:
        said.append(f"attention: transformers {transformers.__version__} refuses {attn} for "
                    f"{type(model).__name__} ({refusal}); set on the model's config, its attention runs "
                    f"through the {attn} interface anyway, as the case asks")
    if attn is not None:
        model.config._attn_implementation = attn
    if notes is not None:
        notes += said
    return model


def attention_of(model) -> str:
    """The attention implementation a built model dispatches through ('eager', 'sdpa', ...)."""
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


class _FakeFlashAttention(torch.autograd.Function):
    """flash-attn 2's `FlashAttnFunc`, memory-wise, for inputs laid out (batch, heads, seq, dim) as
    transformers hands them to its flash_attention_2 interface (which transposes them to (batch, seq,
    heads, dim), views that the kernel takes as they are). Forward keeps q, k and v (views, no new
    storage), the output (batch, seq, heads, dim, `empty_like` of the query) and the fp32 log-sum-exp
    per head and row; no score matrix. Backward allocates dq, dk and dv, the fp32 softmax row sums, the
    fp32 dq accumulator (batch, seq, heads, dim) and, for grouped-query heads, dk and dv expanded to
    every query head before they are summed per key head."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, h, s, d = q.shape
        out = torch.empty((b, s, h, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        b, h, s, d = q.shape
        softmax_d = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        dq_accum = torch.empty((b, s, h, d), dtype=torch.float32, device=q.device)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if k.shape[1] != h:
            dk_expanded = torch.empty((b, s, h, d), dtype=k.dtype, device=k.device)
            dv_expanded = torch.empty((b, s, h, d), dtype=v.dtype, device=v.device)
            del dk_expanded, dv_expanded
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        del softmax_d, dq_accum
        return dq, dk, dv


def _fake_flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' flash_attention_2 interface on fake tensors (flash-attn's CUDA kernels have none):
    the output (batch, seq, heads, dim), as transformers' returns it, and no attention weights."""
    return _FakeFlashAttention.apply(query, key, value), None


@contextlib.contextmanager
def _attention_interfaces():
    """transformers' attention interfaces as the trace runs them: flash_attention_2 by
    `_fake_flash_attention`; SDPA without `softcap`, which the local SDPA interface refuses (5.24) and
    which changes no tensor SDPA keeps (a Gemma-2 model whose config names sdpa). Restored afterwards."""
    try:
        # optional: a transformers without the interface table is traced as it is
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        yield
        return
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    saved = dict(local)
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def sdpa_without_softcap(*args, **kwargs):
        kwargs.pop("softcap", None)
        return sdpa(*args, **kwargs)

    local["sdpa"] = sdpa_without_softcap
    local["flash_attention_2"] = _fake_flash_attention
    try:
        yield
    finally:
        local.clear()
        local.update(saved)


def _dequantize(shape, dtype, device, steps: int = 2):
    """bitsandbytes' dequantization of a double-quantized 4-bit weight: the fp32 absmax (one per 64
    elements) restored in `steps` allocations, then the weight in the compute dtype; returns the weight
    and the absmax copies, for the caller to free where bitsandbytes does. The forward's
    `_dequant_linear_fallback` makes two (`absmax_dq + absmax_offset` is a new tensor) and keeps them,
    as locals, until the `F.linear` it returns has made its output; the backward's
    `functional.dequantize_4bit` makes one (`absmax += quant_state.offset`, in place), freed when it
    returns the weight, before the matmul."""
    blocks = -(-shape[0] * shape[1] // BNB_BLOCKSIZE)
    absmax = [torch.empty(blocks, dtype=torch.float32, device=device) for _ in range(steps)]
    w = torch.empty(shape, dtype=dtype, device=device)
    return w, absmax


class _Fake4bitMatmul(torch.autograd.Function):
    """bitsandbytes' MatMul4Bit, memory-wise: nothing of the input is saved; the weight is
    dequantized into a transient (out x in, compute dtype) in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        w, absmax = _dequantize(weight.shape, x.dtype, x.device)
        ctx.shape, ctx.dtype = weight.shape, x.dtype
        ctx.has_bias = bias is not None
        out = torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
        # the fallback's locals go when it returns, in the order CPython clears them: the rebound
        # `absmax` (the sum), `absmax_dq`, `B_dq`
        del absmax[1:], absmax[0], w
        return out

    @staticmethod
    def backward(ctx, grad):
        w, absmax = _dequantize(ctx.shape, grad.dtype, grad.device, steps=1)
        del absmax
        return grad @ w, None, None


class _Fake4bitLinear(torch.nn.Linear):
    """bitsandbytes' Linear4bit forward: cast to the compute dtype, 4-bit matmul, cast back."""

    compute_dtype = torch.bfloat16

    def forward(self, x):
        inp = x.dtype
        x = x.to(self.compute_dtype)
        return _Fake4bitMatmul.apply(x, self.weight, self.bias).to(inp)


def _bnb_lora_forward(self, x, *args, **kwargs):
    """peft's `lora.bnb.Linear4bit.forward` (peft/tuners/lora/bnb.py), which wraps a 4-bit base layer
    on the device, where the trace's adapters wrap a plain `nn.Linear` and so run
    `lora.Linear.forward` (peft/tuners/lora/layer.py). The two allocate differently: the 4-bit one
    clones the base layer's output ("defensively clone", a transient of the output's size) and, without
    autocast, casts each adapter's output to the output's dtype before adding it, where the plain one
    adds in the adapter's dtype (fp32 adapters on a bf16 residual: an fp32 sum of the output's shape)
    and casts the sum. Adapter variants and mixed batches keep peft's own path."""
    if self.disable_adapters or self.merged or self.lora_variant or kwargs.get("adapter_names") is not None:
        return super(type(self), self).forward(x, *args, **kwargs)
    self._check_forward_args(x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    result = result.clone()
    for active_adapter in self.active_adapters:
        if active_adapter not in self.lora_A.keys():
            continue
        lora_A, lora_B = self.lora_A[active_adapter], self.lora_B[active_adapter]
        dropout, scaling = self.lora_dropout[active_adapter], self.scaling[active_adapter]
        requires_conversion = not torch.is_autocast_enabled()
        if requires_conversion:
            expected_dtype = result.dtype
            x = self._cast_input_dtype(x, lora_A.weight.dtype)
        output = lora_B(lora_A(dropout(x))) * scaling
        if requires_conversion:
            output = output.to(expected_dtype)
        result = result + output
    return result


def _as_bnb_lora(model) -> None:
    """Every LoRA layer around a stood-in 4-bit linear runs peft's 4-bit forward (`_bnb_lora_forward`)."""
    classes: dict[type, type] = {}
    for module in model.modules():
        if isinstance(getattr(module, "base_layer", None), _Fake4bitLinear) and hasattr(module, "lora_A"):
            cls = type(module)
            if cls not in classes:
                classes[cls] = type(f"Fake4bit{cls.__name__}", (cls,), {"forward": _bnb_lora_forward})
            module.__class__ = classes[cls]


def _cuda_transients(log: AllocationLog, func, args) -> None:
    """What CUDA kernels allocate beside their output, which a fake tensor's kernel (its output only)
    does not show, logged after the op's output and freed. They are made below autograd: nothing of
    them is saved.

    - `_safe_softmax`, which SDPA's math path applies to its scores (`_scaled_dot_product_attention_math`):
      the softmax, then `masked = self.isneginf()` (a boolean of the scores' shape) and
      `masked_rows = all(masked, dim, true)`, both kept until it returns, and `where_out` into the
      softmax's own storage (aten/src/ATen/native/transformers/attention.cpp);
    - `_softmax_backward_data` (`softmax_backward_cuda_out`, aten/src/ATen/native/cuda/SoftMax.cu): its
      output, then `Tensor tmp = grad * output`, freed when it returns. The recorded run of Llama-3.1-8B
      QLoRA (fp32 grouped-query attention on the math path, torch 2.11) shows both in every layer: a
      128 MiB boolean beside the 512 MiB scores and softmax, and a third 512 MiB block in the
      attention's backward;
    - the attention backwards' workspaces: cuDNN's (`_cudnn_attention_workspace`) and the
      memory-efficient kernel's (`_efficient_attention_transients`), after the gradients of the query,
      key and value."""
    if func is torch.ops.aten._safe_softmax.default:
        masked = args[0].isneginf()
        log._see(masked)
        rows = masked.all(args[1], keepdim=True)
        log._see(rows)
        del rows, masked
    elif func is torch.ops.aten._softmax_backward_data.default:
        tmp = args[0] * args[1]
        log._see(tmp)
        del tmp
    elif func is torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default:
        workspace = torch.empty(_cudnn_attention_workspace(args[1], args[2], args[3]), dtype=torch.uint8,
                                device=args[1].device)
        log._see(workspace)
        del workspace
    elif func is torch.ops.aten._scaled_dot_product_efficient_attention_backward.default:
        _efficient_attention_transients(log, args[0], args[1], args[3])
    elif func in (torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim):
        staged = _global_reduction(args[0], args[1] if len(args) > 1 else None)
        if staged is not None:
            buffer = torch.empty(staged[0], dtype=torch.uint8, device=args[0].device)
            log._see(buffer)
            semaphores = torch.empty(staged[1], dtype=torch.uint8, device=args[0].device)
            log._see(semaphores)
            del semaphores, buffer


def _global_reduction(x, dims) -> tuple[int, int] | None:
    """The staging buffer and semaphores, in bytes, that `gpu_reduce_kernel` (aten/src/ATen/native/cuda/
    Reduce.cuh) takes from the caching allocator when `setReduceConfig` splits each output's inputs
    across thread blocks (`should_global_reduce`), freed when the launch returns, semaphores first; None
    where it does not. A dense floating input (fp32 accumulator); the reduced dims, and the kept ones,
    each coalesced as TensorIterator does for a dense tensor. A sum over the batch and sequence of a
    bias's or a norm weight's gradient (4 x 1024 rows of 1536) takes 48 MiB and 48 bytes (Qwen2.5-1.5B's
    timeline)."""
    if not x.is_floating_point() or x.element_size() > 4 or x.dim() == 0 or not _dense(x):
        return None
    reduce = set(range(x.dim())) if not dims else {d % x.dim() for d in dims}
    reduced = [(n, st) for d, (n, st) in enumerate(zip(x.shape, x.stride(), strict=True)) if d in reduce and n > 1]
    kept = [(n, st) for d, (n, st) in enumerate(zip(x.shape, x.stride(), strict=True)) if d not in reduce and n > 1]
    inputs = 1
    for n, _ in reduced:
        inputs *= n
    outputs = x.numel() // inputs if inputs else 0
    if inputs <= 1 or outputs == 0:
        return None
    fastest = not kept or min(st for _, st in reduced) < min(st for _, st in kept)
    dim0, dim1 = (inputs, outputs) if fastest else (outputs, inputs)
    out_vec = 1
    if fastest and min(st for _, st in reduced) == 1 and dim0 > 128 and _coalesced(reduced):
        dim0 //= 4  # vectorize along the input
    elif not fastest and min(st for _, st in kept) == 1:
        inner = outputs if _coalesced(kept) else min(kept, key=lambda d: d[1])[0]
        out_vec = 4
        while out_vec > 1 and (inner % out_vec or any(st % out_vec for _, st in reduced)):
            out_vec //= 2
        dim0 //= out_vec
    most = 512 // out_vec
    dim0_pow2 = most if dim0 >= most else 1 << (dim0.bit_length() - 1)
    dim1_pow2 = most if dim1 >= most else 1 << (dim1.bit_length() - 1)
    width = min(dim0_pow2, 32)
    height = min(dim1_pow2, most // width)
    width = min(dim0_pow2, most // height)
    step_in = step_out = 1
    if fastest:
        step_in *= width
    else:
        step_out *= width
    per_thread = -(-inputs // step_in)
    split_warps = per_thread >= height * 16 or per_thread >= 256
    if split_warps:
        step_in *= height
    else:
        step_out *= height
    grid = -(-(outputs // out_vec) // step_out)
    target = SMS * (THREADS_PER_SM // (width * height))
    per_thread = -(-inputs // step_in)
    if not split_warps or per_thread < 256 or grid > target:
        return None
    ctas = max(min(-(-target // grid), -(-per_thread // 16)), -(-per_thread // 256))
    if ctas <= 1:
        return None
    size = 4 * outputs * ctas * (1 if fastest else width * out_vec)
    return size, 4 * grid


def _coalesced(dims: list[tuple[int, int]]) -> bool:
    """Whether these (size, stride) dims lie one inside the next, so TensorIterator merges them into one."""
    expected = None
    for n, st in sorted(dims, key=lambda d: d[1]):
        if expected is not None and st != expected:
            return False
        expected = n * st
    return True


def _cudnn_attention_workspace(query, key, value) -> int:
    """The bytes of the one workspace `run_cudnn_SDP_bprop` (aten/src/ATen/native/cudnn/MHA.cpp) takes
    from the caching allocator for cuDNN's SDPA backward graph, after `_cudnn_attention_backward` has
    made dq, dk and dv (`empty_like` of the query, key and value), freed when it returns. The graph is
    cudnn-frontend's `CompositeSDPABackwardNode` (include/cudnn_frontend/node/scaled_dot_product_
    flash_attention.h): its own tensors are `softmax_sum` (fp32, batch x query heads x query rows) and
    the fp32 dQ accumulator of the query's shape (`get_fe_workspace_size_node`); with fewer key or value
    heads than query heads (grouped-query attention) it computes dK and dV per query head and reduces
    them to the key's heads (`dK_fullhead`, `dV_fullhead`, in the query's dtype), which the engine holds
    in its part of the workspace. The recorded timelines (torch 2.11, cuDNN on an H200) agree to the
    byte but for 256 bytes more in every one, which the engine takes for itself and no source here
    gives: Mistral-7B 128.5 MiB (4 x 1024 tokens, 32 query and 8 key heads of 128), Qwen2.5-1.5B
    48.19 MiB, Gemma-2-2B (head dim 256) 32.06 MiB, Phi-3-mini without grouped heads 48.5 MiB (fp32
    accumulator and row sums only)."""
    b, h_q, s_q, d_qk = query.shape
    s_kv, d_v = key.shape[2], value.shape[3]
    size = b * h_q * s_q * 4 + b * h_q * s_q * d_qk * 4  # softmax_sum, dQ_accum
    if key.shape[1] != h_q:
        size += b * h_q * s_kv * d_qk * query.element_size()
    if value.shape[1] != h_q:
        size += b * h_q * s_kv * d_v * query.element_size()
    return size


def _efficient_attention_transients(log: AllocationLog, grad_out, query, value) -> None:
    """`_efficient_attention_backward` (aten/src/ATen/native/transformers/cuda/attention_backward.cu)
    after grad_q, grad_k and grad_v, for fp32 inputs on sm80 and later (the residual stream after
    peft's k-bit preparation; its kernels `dispatch_cutlassB_f32_sm80`, mem_eff_attention/kernels/
    cutlassB.h). The f32 kernels do not compute `delta` themselves (`kKernelComputesDelta` is for the
    half types): it is `(grad_out.to(kFloat) * out.to(kFloat)).sum(-1).transpose(-2, -1).contiguous()`,
    a product of the output's shape and two row sums, the first two freed at once. Then the kernel's
    workspace (`p.workspace_size()`, kernel_backward.h): fp32 output needs no dK or dV accumulator
    (`kNeedsAccumGradK/V`: the accumulator is the output's type), but split keys need one for dQ:
    per batch and head `ceil(M / kBlockSizeI) * ceil(K / kBlockSizeJ)` tiles of `GradQTempStorage`
    (four int32, then kBlockSizeI x kBlockSizeJ floats), aligned to four floats. The kernel is the first
    of the list whose `kMaxK` holds the head dim: 64 x 64 up to 64, 128 x 64 up to 128, then 128 x 64
    (a kernel the shared memory refuses, which the list then skips, is not modelled). `delta` goes when
    the launch returns, the workspace after it. Phi-3-mini QLoRA's timeline (4 x 1024 tokens, 32 heads
    of 96, torch 2.11, H200) shows the five blocks in every layer: 48 MiB, 0.5 and 0.5 MiB, then
    64.03 MiB. The half types (cuDNN's or flash's on these cards) are left as traced."""
    if query.dtype != torch.float32:
        return
    b, h, m, k = query.shape
    product = torch.empty(grad_out.shape, dtype=torch.float32, device=query.device)
    log._see(product)
    rows = torch.empty((b, m, h), dtype=torch.float32, device=query.device)
    log._see(rows)
    delta = torch.empty((b, h, m), dtype=torch.float32, device=query.device)
    log._see(delta)
    del rows, product
    block_i = 64 if max(k, value.shape[3]) <= 64 else 128
    block_j = 64
    tiles = -(-m // block_i) * -(-k // block_j)
    stride = -(-tiles * (4 + block_i * block_j) // 4) * 4
    workspace = torch.empty(b * h * stride * 4, dtype=torch.uint8, device=query.device)
    log._see(workspace)
    del delta, workspace


def _dense(t: torch.Tensor) -> bool:
    """`is_non_overlapping_and_dense`: the elements fill the storage once, in some order of the dims."""
    expected = 1
    for size, stride in sorted((d for d in zip(t.shape, t.stride(), strict=True) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


# the ops that call cuBLAS: the first in each phase takes its thread's handle and workspace
_BLAS_OPS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                       torch.ops.aten.baddbmm.default))
# torch's wrappers between a dispatch mode and the Python frame that ran the op
_DISPATCH_WRAPPERS = ("/torch/_dynamo/", "/torch/_compile.py", "/torch/utils/_python_dispatch")
_CUDNN_ATTENTION = torch.ops.aten._scaled_dot_product_cudnn_attention.default
_TRANSIENT_OPS = frozenset((torch.ops.aten._safe_softmax.default, torch.ops.aten._softmax_backward_data.default,
                            torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default,
                            torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
                            torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim))


def _cudnn_takes(query, key, value, attn_mask, dropout_p, enable_gqa, grad) -> bool:
    """Whether `can_use_cudnn_attention` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch
    2.11) passes these inputs on an sm90 card with cuDNN above 9.22 (the recorded Gemma-2 runs, head dim
    256, took it): fp16 or bf16; dense 4-dimensional inputs, the last dimension contiguous; batch and
    heads at most 65535; head dims multiples of 8 up to 256 (`check_cudnn_tensor_shapes`), and for a
    backward d <= 128, (192, 128) or (256, 256) (`check_cudnn_d256_bprop_head_dim`); more query heads
    than key heads only with `enable_gqa` and a whole number of groups; key length above 1; dropout a
    multiple of 1/16. A mask is taken (as an additive bias)."""
    if query.dtype not in (torch.float16, torch.bfloat16) or query.dim() != 4:
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or key.dim() != 4 or value.dim() != 4:
        return False
    if any(t.stride(-1) != 1 and t.shape[-1] != 1 for t in (query, key, value)):
        return False
    b, h_q, _, d_qk = query.shape
    s_kv, d_v = key.shape[2], value.shape[3]
    if b > CUDNN_MAX_BATCH_OR_HEADS or h_q > CUDNN_MAX_BATCH_OR_HEADS or s_kv == 1 or key.shape[3] != d_qk:
        return False
    if max(d_qk, d_v) > CUDNN_MAX_HEAD_DIM or d_qk % CUDNN_HEAD_DIM_MULTIPLE or d_v % CUDNN_HEAD_DIM_MULTIPLE:
        return False
    if grad and not ((d_qk <= CUDNN_BACKWARD_HEAD_DIM and d_v <= CUDNN_BACKWARD_HEAD_DIM)
                     or (d_qk, d_v) in CUDNN_BACKWARD_HEAD_DIMS):
        return False
    if key.shape[1] != h_q or value.shape[1] != h_q:
        if not enable_gqa or h_q % key.shape[1] or h_q % value.shape[1]:
            return False
    return dropout_p * CUDNN_DROPOUT_STEPS == int(dropout_p * CUDNN_DROPOUT_STEPS)


@contextlib.contextmanager
def _cuda_dropout():
    """Dropout as CUDA runs it. `aten::dropout` takes the fused kernel only for tensors on CUDA and a few
    other devices (`is_fused_kernel_acceptable`, aten/src/ATen/native/Dropout.cpp): `native_dropout`,
    which allocates the output and a boolean mask and keeps the mask for the backward. On the trace's
    fake `cpu` tensors it takes the composite path, which keeps a noise tensor of the input's dtype
    (four times the mask for fp32) and allocates differently. While the trace runs, training dropout
    with 0 < p < 1 goes to `native_dropout`, whose meta kernel allocates as the CUDA kernel does."""
    functional = torch.nn.functional
    original = functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if inplace or not training or not 0.0 < p < 1.0 or input.numel() == 0:
            return original(input, p, training, inplace)
        return torch.native_dropout(input, p, training)[0]

    functional.dropout = dropout
    try:
        yield
    finally:
        functional.dropout = original


class _Zero3Linear(torch.autograd.Function):
    """DeepSpeed's `LinearFunctionForZeroStage3` (deepspeed/runtime/zero/linear.py, 0.19.8), which ZeRO-3
    puts in place of `torch.nn.functional.linear` (`_enable_mem_efficient_linear`, partition_parameters.py,
    under `memory_efficient_linear`, on by default; it persists after `zero.Init`). Its `setup_context`
    saves the input, the weight and the bias for every call whose inputs need a gradient, where autograd's
    own linear saves the input only when the weight needs a gradient: under ZeRO-3 a frozen layer keeps its
    input (LoRA's base layers, the head) until its backward. Forward and backward compute as DeepSpeed's."""

    @staticmethod
    def forward(input, weight, bias=None):
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        output = input.matmul(weight.t())
        if bias is not None:
            output += bias
        return output

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        dim = grad_output.dim()
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            if dim > 2:
                grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                    input.reshape(-1, input.shape[-1]))
            elif dim == 1:
                grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
            else:
                grad_weight = grad_output.t().matmul(input)
        if bias is not None and ctx.needs_input_grad[2]:
            if dim > 2:
                grad_bias = grad_output.sum(list(range(dim - 1)))
            elif dim == 1:
                grad_bias = grad_output
            else:
                grad_bias = grad_output.sum(0)
        return grad_input, grad_weight, grad_bias


@contextlib.contextmanager
def _zero3_linear(enabled: bool):
    """While the trace runs, `torch.nn.functional.linear` is `_Zero3Linear`, as under ZeRO-3 on the
    device (`zero3_linear_wrap`); nothing changes where `enabled` is false."""
    if not enabled:
        yield
        return
    functional = torch.nn.functional
    original = functional.linear

    def linear(input, weight, bias=None):
        return _Zero3Linear.apply(input, weight, bias)

    functional.linear = linear
    try:
        yield
    finally:
        functional.linear = original


@contextlib.contextmanager
def _cuda_sdpa():
    """`scaled_dot_product_attention` with the memory layout of the CUDA kernel that takes it.

    The trace runs on fake `cpu` tensors, where SDPA dispatches to the CPU flash kernel, whose output
    is laid out like the query (`meta__scaled_dot_product_flash_attention_for_cpu`: `empty_like(query)`).
    On CUDA, fp32 inputs (the residual stream after peft's `prepare_model_for_kbit_training`) cannot
    take the flash kernel (fp16/bf16 only) and go to the memory-efficient one, which allocates its
    output as (batch, sequence, heads, dim) and returns it transposed
    (`meta__scaled_dot_product_efficient_attention` in torch/_meta_registrations.py: `torch.empty(B,
    M, num_heads, Kv)`, then `res.transpose(1, 2)`). transformers' `sdpa_attention_forward` then
    calls `attn_output.transpose(1, 2).contiguous()`: a no-op on CUDA, a copy of the output on the CPU
    kernel's layout whenever the query is contiguous (Phi-3's rotary embedding concatenates the rotated
    and the passed-through halves), and that copy, the input of `o_proj`'s LoRA, is kept to the
    backward. fp32 inputs without grouped-query heads go to the efficient kernel here too.

    The half dtypes go to cuDNN's kernel where it takes them (`_cudnn_takes`): torch 2.11 built for
    CUDA 13 puts cuDNN first on sm90 cards (H100, H200) with cuDNN above 9.15
    (`check_prefer_cudnn_attention`, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp). Its forward
    lays the output out like the query (`alloc_with_matching_layout`) and keeps a log-sum-exp per row
    (fp32) and the dropout seed and offset (`AllocationLog`); its backward a workspace
    (`_cudnn_attention_workspace`). Every recorded run in the half dtypes took it: the seed and offset,
    8-byte blocks beside the output, and one workspace block in every layer's backward. The rest of the
    half dtypes (flash, whose output is `empty_like` of the query on CUDA as on the CPU) is left as it
    is."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        if _cudnn_takes(query, key, value, attn_mask, dropout_p, enable_gqa, grad):
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask_cudnn
                attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    attn_mask.logical_not(), float("-inf"))
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, attn_mask, grad, dropout_p, is_causal, False, scale=scale)[0]
        if query.dim() == 4 and query.dtype in (torch.float16, torch.bfloat16) and dropout_p > 0.0:
            return _fused_dropout_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, grad)
        if query.dtype != torch.float32 or query.dim() != 4:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if key.shape[1] != query.shape[1]:  # grouped-query heads: the math path
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA converts a boolean mask
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale)[0]

    functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


def _fused_dropout_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, grad):
    """SDPA with attention dropout in the half dtypes, as CUDA runs it where cuDNN does not take it: the
    flash kernel without a mask (it draws the dropout from a Philox seed and keeps the log-sum-exp per row,
    never the probabilities or a mask), the memory-efficient one with a mask (the same, as an additive
    bias). On the trace's fake CPU tensors SDPA with dropout would take the math path, which keeps the
    attention probabilities and the dropout mask of every layer: GiBs the device never holds."""
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if attn_mask is None and d_qk == d_v and d_qk <= 256 and d_qk % 8 == 0:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA converts a boolean mask
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def _unpacked_rows():
    """transformers' `find_packed_sequence_indices` as it answers on the device for the harness's
    batches (one sequence per row, positions 0..n-1): None, no packed sequences. On fake tensors it
    cannot read the positions (`is_tracing` is true of a fake tensor, transformers/masking_utils.py)
    and returns its index tensor, so the causal mask is never skipped: a boolean mask is built and
    passed to SDPA, and a model with grouped-query heads repeats its keys and values (`repeat_kv`)
    instead of passing `enable_gqa` (`use_gqa_in_sdpa` requires no mask), which on CUDA decides the
    kernel and what it keeps. The function still runs, so its allocations stay in the trace."""
    try:
        # optional: a transformers without masking_utils is traced as it is
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def unpacked(position_ids):
        original(position_ids)
        return None

    masking_utils.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _without_bitsandbytes():
    """peft without bitsandbytes' import (it pulls in torch's compiler stack: seconds of CPU). The
    adapters traced here wrap plain `nn.Linear` layers; no bitsandbytes class is needed. While the
    trace runs, bitsandbytes reads as not installed (unless this process imported it already);
    afterwards peft's cached answers are cleared, so a real QLoRA build later in the process still
    finds it."""
    if "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None
    try:
        yield
    finally:
        if sys.modules.get("bitsandbytes", 0) is None:
            del sys.modules["bitsandbytes"]
        _clear_peft_caches()


def _clear_peft_caches() -> None:
    for modname in ("peft.import_utils", "transformers.utils.import_utils"):
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        for name in dir(mod):
            fn = getattr(mod, name, None)
            if "bnb" in name.lower() or "bitsandbytes" in name.lower():
                if callable(getattr(fn, "cache_clear", None)):
                    fn.cache_clear()


def build_as_traced(spec: TraceSpec, layers: int):
    """The model and its parameters' info as `trace` builds them, on the meta device: bitsandbytes
    hidden as there, so a build before the trace does not import it for the trace's sake."""
    with _without_bitsandbytes():
        return _build(spec, layers)


def _set_checkpointing(model, reentrant: bool) -> None:
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if reentrant:
        model.enable_input_require_grads()
    model.config.use_cache = False


def _build(spec: TraceSpec, layers: int, notes: list[str] | None = None):
    """The truncated model, prepared as the case's stack prepares it, on meta (`notes`: see `_hf_model`)."""
    arch = Architecture(name="trace", source="", config=json.loads(spec.config_json))
    dtype = DTYPES[Precision(spec.dtype)]
    model = _hf_model(truncated_config(arch, layers), dtype, spec.attn_implementation, notes)
    head = model.get_output_embeddings()
    quantized: set[int] = set()
    if spec.kind == "qlora":
        for module in model.modules():
            if type(module) is torch.nn.Linear and module is not head:
                module.__class__ = _Fake4bitLinear
                quantized.add(id(module.weight))
    if spec.kind in ("lora", "qlora"):
        for p in model.parameters():
            p.requires_grad_(False)
    if spec.kind == "qlora" and Stack(spec.stack).kbit_prepared:
        for p in model.parameters():  # prepare_model_for_kbit_training: non-4-bit params to fp32
            if id(p) not in quantized and p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.to(torch.float32)
    if spec.fp32_trainable:  # LLaMA-Factory's init_adapter: the trainable parameters upcast to fp32
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point():
                p.data = p.data.to(torch.float32)
    if spec.checkpointing:
        _set_checkpointing(model, spec.reentrant)
    info = ParamInfo()
    for p in model.parameters():
        n = p.numel()
        info.sizes.append(n)
        if id(p) in quantized:
            info.quantizable += n
        else:
            info.other += n
    info.head = head.weight.numel() if head is not None else 0
    embedding = model.get_input_embeddings()
    info.tied_head = head is not None and embedding is not None and head.weight is embedding.weight
    if spec.kind in ("lora", "qlora"):
        # here, under the callers' `_without_bitsandbytes`: imported at the top, peft would import
        # bitsandbytes (torch's compiler stack, seconds of CPU) in every process that traces
        import peft

        targets = "all-linear" if spec.lora_targets == "all" else list(spec.lora_targets)
        config = peft.LoraConfig(r=spec.lora_r, lora_alpha=2 * spec.lora_r, lora_dropout=spec.lora_dropout,
                                 target_modules=targets, task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, config)
        if spec.kind == "qlora":
            _as_bnb_lora(model)
    if spec.engine_casts:  # the engine casts the module (adapters included) to the half dtype
        half = DTYPES[Precision(spec.dtype)]
        for p in model.parameters():
            if p.is_floating_point() and id(p) not in quantized:
                p.data = p.data.to(half)
    info.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info.bytes_total = sum(
        (p.numel() // 2 if id(p) in quantized else p.numel() * p.element_size()) for p in model.parameters()
    )
    layer_leaves = [
        sum(p.numel() for p in m.parameters(recurse=False))
        for name, m in model.named_modules() if ".layers." in name
    ]
    info.largest_layer_module = max(layer_leaves, default=0)
    if spec.liger:
        _liger_loss(model)
    model.train()
    return model, info


class _FakeLigerFLCE(torch.autograd.Function):
    """Liger's `LigerFusedLinearCrossEntropyFunction` (liger_kernel/ops/fused_linear_cross_entropy.py),
    memory-wise: the forward takes the final hidden states (rows x hidden) and the output head's weight and
    never builds the logits. It allocates the input's gradient (rows x hidden, the input's dtype), the
    per-row fp32 losses, the weight's gradient where the head trains, and per chunk of rows the chunk's
    logits (chunk x vocab) and their product with the weight; the chunk is the power of two at or above
    rows / ceil(vocab / hidden). It keeps the two gradients for backward, which hands them on."""

    @staticmethod
    def forward(ctx, hidden, weight):
        rows, width = hidden.shape
        vocab = weight.shape[0]
        per = -(-vocab // width)
        chunk = 1 << max(0, (-(-rows // per) - 1).bit_length())
        grad_input = torch.empty_like(hidden)
        grad_weight = torch.empty_like(weight) if weight.requires_grad else None
        losses = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            logits = torch.empty((n, vocab), dtype=hidden.dtype, device=hidden.device)
            part = torch.empty((n, width), dtype=hidden.dtype, device=hidden.device)  # grad_logits @ weight
            del logits, part
        loss = torch.empty((), dtype=torch.float32, device=hidden.device)
        del losses
        ctx.grads = (grad_input, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad):
        grad_input, grad_weight = ctx.grads
        del ctx.grads
        return grad_input, grad_weight


def _liger_loss(model) -> None:
    """The causal LM's forward as Liger's `lce_forward` makes it in training: the decoder, then the fused
    linear cross-entropy over the last hidden states (`_FakeLigerFLCE`); no logits are returned. The labels
    shift by padding, not by copying the hidden states (LigerForCausalLMLoss)."""


    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def forward(self, input_ids=None, labels=None, **kwargs):
        kwargs.pop("logits_to_keep", None)
        hidden = self.get_decoder()(input_ids=input_ids, **kwargs)[0]
        loss = _FakeLigerFLCE.apply(hidden.reshape(-1, hidden.shape[-1]), self.get_output_embeddings().weight)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    base.forward = types.MethodType(forward, base)


def trace(spec: TraceSpec, layers: int) -> TraceResult:

    t0 = time.perf_counter()
    config = json.loads(spec.config_json)
    with _step_patches(spec, config):
        return _trace_patched(spec, layers, config, t0)


@contextlib.contextmanager
def _step_patches(spec: TraceSpec, config: dict):
    """What a training step on fake CPU tensors needs to take the device's paths (the kernels, attention,
    dropout and DeepSpeed's linear the case's run takes), while it runs."""
    with _fla_fake_kernels(config["model_type"] == "gla"), _without_bitsandbytes(), _cuda_sdpa(), \
            _cuda_dropout(), _zero3_linear(spec.zero3_linear), _unpacked_rows(), _attention_interfaces():
        yield


def fake_step(spec: TraceSpec, layers: int, prepare) -> None:
    """One forward and backward of the model as `trace` builds and runs it, on fake tensors, with no
    allocation log: `prepare(model)` is called once the model has its (fake) storage, before the step
    (hooks to attach)."""

    config = json.loads(spec.config_json)
    with _step_patches(spec, config):
        model, _ = _build(spec, layers)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            _tie_again(model)
            prepare(model)
            ids = torch.randint(0, int(config["vocab_size"]), (spec.micro_batch, spec.seq_len))
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                model(input_ids=ids, labels=ids).loss.backward()


def _trace_patched(spec: TraceSpec, layers: int, config: dict, t0: float) -> TraceResult:


    notes: list[str] = []
    model, info = _build(spec, layers, notes)
    vocab = int(config["vocab_size"])
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        _tie_again(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if spec.deepspeed:
            for p in trainable:  # DeepSpeed copies each gradient into its bucket at once
                p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        elif spec.accumulated_grads:
            for p in trainable:
                p.grad = torch.zeros_like(p)
        tracker = AllocationLog()
        for p in trainable:
            p.register_hook(tracker.note_grad)
        tracker.register(list(model.parameters()) + list(model.buffers()) + [p.grad for p in trainable
                                                                             if p.grad is not None])
        # Everything made so far (the libraries, the model) is moved out of the collector's reach, so the
        # collections during the step and the one after it look at the step's objects only: a full
        # collection over torch's and transformers' objects takes about a second.
        gc.freeze()
        hooks: list[list] = []
        placed = contextlib.nullcontext()
        if spec.zero3_hook_positions and layers == 2:  # where DeepSpeed's hooks fire among the step's events
            placed = positions(model, lambda: (len(tracker._log or ()), int(tracker.backward)), hooks)
        try:
            with tracker, _layer_tags(model, tracker, layers), placed:
                tracker.start_log()
                ids = torch.randint(0, vocab, (spec.micro_batch, spec.seq_len))
                base = tracker.current()
                with _trainer_autocast(spec):
                    out = model(input_ids=ids, labels=ids)
                logits = out.logits.numel() * out.logits.element_size() if out.logits is not None else 0
                loss = out.loss
                if spec.loss_only:  # the Trainer's compute_loss returns the loss alone (step.framework_trains)
                    del out
                    gc.collect()
                held = tracker.current() - base
                tracker.backward = True
                tracker.tag = (BACKWARD, tracker.tag[1])
                with warnings.catch_warnings():  # the layer tags' backward hooks on a layer whose input needs no grad
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    loss.backward()
                peak = tracker.peak_bytes() - base
                # what the training loop drops once the backward has returned (the loss, the logits): a chunk
                # of its own after every layer's backward, so hooks that fire inside the backward after the
                # last layer's (the embedding's) go into a stream before it (harness.predict.allocator.stream.expand)
                tracker.tag = (BACKWARD, LAYER_PRE)
                del loss
                if not spec.loss_only:
                    del out
                gc.collect()  # the step's last frees (loss, logits) belong to it
                events = tracker.stop_log()
        finally:
            gc.unfreeze()
    return TraceResult(layers=layers, peak=peak, held_after_forward=held, logits=logits, params=info,
                       seconds=time.perf_counter() - t0, events=events, layout=_layout(model, layers),
                       grads=tracker.grads, matmuls=list(tracker.matmuls), hooks=hooks,
                       attention=attention_of(model), attention_note="; ".join(notes))


def _trainer_autocast(spec: TraceSpec):
    """The HF Trainer's mixed-precision autocast around the forward and the loss (`TraceSpec.autocast`):
    matmuls in the half dtype, the half copy of an fp32 weight (LLaMA-Factory's upcast) or of an fp32 input
    (peft's adapters) cast for the forward and kept by autograd for backward. CPU autocast on the fake CPU
    tensors: its list of ops cast down is CUDA's for matmuls and linear layers, which hold the bulk of a
    step's memory."""
    if not spec.autocast:
        return contextlib.nullcontext()
    return _cuda_autocast(DTYPES[Precision(spec.dtype)])


@contextlib.contextmanager
def _cuda_autocast(half: torch.dtype):
    """CPU autocast with CUDA's policy where the two differ in what a step keeps: CUDA's autocast runs
    `layer_norm` in fp32 (its fp32 list, aten/src/ATen/autocast_mode.cpp), so the norm keeps an fp32 copy of
    its input and hands fp32 to the next layers, each of which casts it down again; CPU autocast runs it in
    the input's dtype. RMSNorm implementations upcast by hand and are the same either way."""
    functional = torch.nn.functional
    original = functional.layer_norm

    def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        if torch.is_autocast_enabled("cpu") and input.dtype in (torch.float16, torch.bfloat16):
            def up(t):
                return t.float() if t is not None and t.is_floating_point() else t

            with torch.autocast("cpu", enabled=False):
                return original(up(input), normalized_shape, up(weight), up(bias), eps)
        return original(input, normalized_shape, weight, bias, eps)

    functional.layer_norm = layer_norm
    try:
        with torch.autocast("cpu", dtype=half):
            yield
    finally:
        functional.layer_norm = original


def _tie_again(model) -> None:
    """`to_empty` gives every parameter storage of its own, which unties an output head tied to the
    embedding (`tie_word_embeddings`): the trace would then hold a second vocab x hidden weight, its
    own gradient and optimizer state, which the job does not have. Tie them again, as transformers
    does after it builds or loads a model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.tie_weights()


class AllocationLog(LiveTensorTracker):
    """`LiveTensorTracker` that also logs every storage's allocation and free, in order, as
    `[op, id, bytes, phase, layer]` (op 1 allocates, 0 frees; `id` numbers storages in the order they
    were allocated, so a free names the allocation it releases; phase FORWARD or BACKWARD; layer the
    decoder layer running, `step.LAYER_PRE` before the first or `step.LAYER_POST` after the last).
    `tag` is the (phase, layer) that hooks on the decoder layers set (`_layer_tags`)."""

    def __init__(self) -> None:
        super().__init__()
        self.tag = (FORWARD, LAYER_PRE)
        self.backward = False
        self._ids: dict[int, int] = {}
        self._issued = 0
        self._log: list[list[int]] | None = None
        self.grads: list[int] = []  # ids of the allocations handed to a parameter's AccumulateGrad
        self._sum: tuple[int, int, int] | None = None  # the engine's last sum: its key, old_var's key, log index
        self.matmuls = [-1, -1]  # `TraceResult.matmuls`

    def note_grad(self, grad: torch.Tensor) -> None:
        """A trainable parameter's hook: `grad` is what its AccumulateGrad is given."""
        seq = self._ids.get(id(grad.untyped_storage()))
        if self._log is not None and seq is not None:
            self.grads.append(seq)

    def start_log(self) -> None:
        self._log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _CUDNN_ATTENTION and self._log is not None:
            return self._cudnn_attention(func, args, kwargs or {})
        if func is torch.ops.aten.native_dropout.default:
            # CUDA's kernel (`dropout_cuda`, aten/src/ATen/native/cuda/Dropout.cu) allocates the mask, then
            # the output; the meta kernel returns them the other way round
            out = func(*args, **(kwargs or {}))
            self._see(out[1])
            self._see(out[0])
            return out
        summed = self._engine_sum(func, args, kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if summed is not None:
            self._note_sum(out, summed)
        if func in _BLAS_OPS and self._log is not None and self.matmuls[self.backward] < 0:
            self.matmuls[self.backward] = len(self._log)
        if func in _TRANSIENT_OPS:
            _cuda_transients(self, func, args)
        return out

    def _cudnn_attention(self, func, args, kwargs):
        """`_cudnn_attention_forward` (aten/src/ATen/native/transformers/cuda/attention.cu) allocates the
        dropout seed and offset (int64, on the device) before the output and the fp32 log-sum-exp, and
        the log-sum-exp only when a gradient is wanted (`compute_log_sumexp`; the meta function makes
        it always): logged in that order, the seed and offset kept with the output for the backward."""
        out = func(*args, **kwargs)
        compute_lse = args[4] if len(args) > 4 else kwargs.get("compute_log_sumexp", False)
        for tensor in (out[6], out[7], out[0], out[1] if compute_lse else None):
            if isinstance(tensor, torch.Tensor):
                self._see(tensor)
        return out

    def _engine_sum(self, func, args, kwargs):
        """The autograd engine's sum of two gradients of one tensor (`InputBuffer::add`,
        torch/csrc/autograd/input_buffer.cpp: `old_var + var`, called by the engine itself, not by a
        backward function, with grad mode off) where the device could make it in place: `old_var`
        dense, not a view (a view made in backward, `reshape` of a linear's flattened input among them,
        is still a differentiable view, `CreationMeta::NO_GRAD_MODE`, whose base holds the storage);
        the storage keys of `old_var` and `var`, else None."""
        if (self._log is None or not self.backward or func is not torch.ops.aten.add.Tensor or kwargs
                or len(args) != 2 or torch.is_grad_enabled()):
            return None
        old, var = args
        if not (isinstance(old, torch.Tensor) and isinstance(var, torch.Tensor)) or old.shape != var.shape \
                or old.dtype != var.dtype:
            return None
        if old._is_view() or not _dense(old):
            return None  # a view keeps its base, which holds the storage too: `storage().use_count()` is 2
        frame = sys._getframe(2)
        while frame is not None and any(part in frame.f_code.co_filename for part in _DISPATCH_WRAPPERS):
            frame = frame.f_back
        if frame is None or frame.f_code.co_name != "_engine_run_backward":
            return None
        return id(old.untyped_storage()), id(var.untyped_storage())

    def _note_sum(self, out, summed) -> None:
        """The engine adds in place where it holds the only reference to `old_var` and its storage
        (`can_accumulate_inplace`, `old_var.add_(var)`); under the trace's dispatch modes every tensor
        has a Python object and the test fails, so the sum is a new block. Where the trace then frees
        `old_var` before it allocates anything else, nothing else held it: the sum is logged as the
        device makes it, into `old_var`'s block (`_forget`)."""
        key = id(out.untyped_storage())
        seq = self._ids.get(key)
        if seq is not None and self._log and self._log[-1][:2] == [1, seq]:
            self._sum = (key, summed[0], len(self._log) - 1)

    def stop_log(self) -> list[list[int]]:
        log, self._log = self._log or [], None
        return log

    def _forget(self, key: int) -> None:
        if self._sum is not None and key == self._sum[1]:  # the engine's sum, made in place (`_note_sum`)
            out_key, _, index = self._sum
            self._sum = None
            seq = self._ids.pop(key, None)
            if self._log is not None and seq is not None and out_key in self._ids:
                del self._log[index]
                self._ids[out_key] = seq
                super()._forget(key)
                return
            if seq is not None:
                self._ids[key] = seq
        size = self._sizes.get(key)
        seq = self._ids.pop(key, None)
        if self._log is not None and seq is not None and size is not None:
            self._log.append([0, seq, size, *self.tag])
        super()._forget(key)

    def _see(self, tensor: torch.Tensor) -> None:
        if self._log is None or tensor.device.type == "meta" or tensor.is_sparse or tensor.is_nested:
            super()._see(tensor)
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key, size = id(storage), storage.nbytes()
        old = self._sizes.get(key)
        if old is not None and old != size and key in self._ids:  # resized in place: a new block
            self._log.append([0, self._ids[key], old, *self.tag])
        super()._see(tensor)
        if old != size:
            self._sum = None  # an allocation before `old_var` went: something else held it
            self._ids[key] = self._issued
            self._log.append([1, self._issued, size, *self.tag])
            self._issued += 1


def _decoder_stack(model, layers: int) -> str:
    """The name of the module list that holds the decoder layers: the one with `layers` entries that
    holds the most parameters ("" when there is none)."""
    best, size = "", -1
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers:
            n = sum(p.numel() for p in module.parameters())
            if n > size:
                best, size = name, n
    return best


def _layer_index(name: str, stack: str) -> int | None:
    """The decoder layer a module or parameter name belongs to, or None."""
    if not stack or not name.startswith(stack + "."):
        return None
    head = name[len(stack) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


@contextlib.contextmanager
def _layer_tags(model, log: AllocationLog, layers: int):
    """Tag the log's events with the decoder layer running: a forward pre-hook (which also fires for
    checkpointing's recompute) and a backward pre-hook on every decoder layer; after the last layer's
    forward, LAYER_POST (the final norm, the head and the loss)."""
    handles = []

    def pre(i):
        def hook(module, args):
            log.tag = (BACKWARD if log.backward else FORWARD, i)
        return hook

    def post(i):
        def hook(module, args, output):
            if not log.backward:
                log.tag = (FORWARD, i if i < layers - 1 else LAYER_POST)
        return hook

    def backward_pre(i):
        def hook(module, grad_output):
            log.tag = (BACKWARD, i)
        return hook

    stack = _decoder_stack(model, layers)
    for name, module in model.named_modules():
        i = _layer_index(name, stack)
        if i is None or name != f"{stack}.{i}":
            continue
        handles.append(module.register_forward_pre_hook(pre(i)))
        handles.append(module.register_forward_hook(post(i)))
        handles.append(module.register_full_backward_pre_hook(backward_pre(i)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _layout(model, layers: int) -> list[list[int]]:
    """Every parameter in the order the stack loads it: the base model's in the order of their names
    (as `from_pretrained` reads a checkpoint), then the adapters in module order:
    `[elements, bytes per element as traced, quantized, trainable, layer, adapter]`."""
    quantized = {id(m.weight) for m in model.modules() if isinstance(m, _Fake4bitLinear)}
    stack = _decoder_stack(model, layers)
    base, adapters = [], []
    seen_layers = False
    for name, p in model.named_parameters():  # module order: before the decoder layers, in them, after
        layer = _layer_index(name, stack)
        seen_layers = seen_layers or layer is not None
        if layer is None:
            layer = LAYER_POST if seen_layers else LAYER_PRE
        adapter = "lora_" in name
        row = [p.numel(), p.element_size(), int(id(p) in quantized), int(p.requires_grad), layer, int(adapter)]
        (adapters if adapter else base).append((name.replace(".base_layer", ""), row))
    base.sort(key=lambda item: item[0])  # a checkpoint's tensors load in the order of their sorted names
    return [row for _, row in base + adapters]


class _FlaCrossEntropy(torch.autograd.Function):
    """fla's FusedCrossEntropyLoss(inplace_backward=True): keeps the logits and an fp32
    log-sum-exp per row; backward writes the gradient into the logits' storage."""

    @staticmethod
    def forward(ctx, logits, target):
        lse = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        ctx.save_for_backward(logits, lse)
        return torch.empty((), dtype=torch.float32, device=logits.device)

    @staticmethod
    def backward(ctx, grad):
        logits, _ = ctx.saved_tensors
        return logits, None


class _FlaFusedCrossEntropy(torch.nn.Module):
    """Stands in for fla's FusedCrossEntropyLoss in a trace (`_fla_fake_kernels`)."""

    def __init__(self, inplace_backward: bool = False, reduction: str = "mean", **kwargs):
        super().__init__()
        self.reduction = reduction
        self.ignore_index = kwargs.get("ignore_index", -100)

    def forward(self, logits, target):
        return _FlaCrossEntropy.apply(logits, target)


@contextlib.contextmanager
def _fla_fake_kernels(active: bool):
    """Replace fla_cpu's reference kernels (which save every intermediate of a recurrent loop) by
    autograd functions that save what fla's Triton kernels save:
    * chunk_gla: q, k, v, g, the fp32 cumulative gate (shape of g) and the intra-chunk attention
      A (B, T, H, 64) in fp32; it returns o and the final state.
    * fused RMSNorm (optionally gated): x (and the gate), and the fp32 reciprocal std per row.
    * fused SwiGLU: its two inputs.
    * fused cross entropy (inplace_backward): the logits and an fp32 log-sum-exp are kept; the
      gradient is written into the logits' storage.
    """
    if not active:
        yield
        return
    # optional: the gla extra (flash-linear-attention), only for its models
    import fla.layers.gla as gla_layer

    # optional: the gla extra (flash-linear-attention), only for its models
    import fla.modules.mlp as mlp

    # optional: the gla extra (flash-linear-attention), only for its models
    from fla.modules import (
        FusedRMSNormGated,
        RMSNorm,
    )

    class ChunkGLA(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, g):
            B, T, H, _ = q.shape
            g_cumsum = torch.empty(g.shape, dtype=torch.float32, device=q.device)
            A = torch.empty((B, T, H, 64), dtype=torch.float32, device=q.device)
            ctx.save_for_backward(q, k, v, g, g_cumsum, A)
            return torch.empty(v.shape, dtype=v.dtype, device=v.device)

        @staticmethod
        def backward(ctx, do):
            q, k, v, g, _, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g)

    def chunk_gla(q, k, v, g=None, gk=None, initial_state=None, output_final_state=False, scale=None,
                  cu_seqlens=None, **_):
        gate = gk if gk is not None else g
        o = ChunkGLA.apply(q, k, v, gate)
        state = None
        if output_final_state:
            B, _, H, K = q.shape
            state = torch.empty((B, H, K, v.shape[-1]), dtype=torch.float32, device=q.device)
        return o, state

    class Norm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, gate):
            rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
            ctx.save_for_backward(x, weight, gate if gate is not None else x, rstd)
            ctx.gated = gate is not None
            return torch.empty(x.shape, dtype=x.dtype, device=x.device)

        @staticmethod
        def backward(ctx, dy):
            x, weight, gate, _ = ctx.saved_tensors
            dw = None if weight is None or not weight.requires_grad else torch.empty_like(weight)
            return torch.empty_like(x), dw, (torch.empty_like(gate) if ctx.gated else None)

    def rms_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None:
            x = x + residual
        y = Norm.apply(x, self.weight, None)
        return (y, x) if prenorm else y

    def gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None:
            x = x + residual
        y = Norm.apply(x, self.weight, g)
        return (y, x) if prenorm else y

    class SwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return torch.empty(x.shape, dtype=x.dtype, device=x.device)

        @staticmethod
        def backward(ctx, do):
            x, y = ctx.saved_tensors
            return torch.empty_like(x), torch.empty_like(y)

    def swiglu(x, y):
        return SwiGLU.apply(x, y)

    def swiglu_linear(x, y, weight, bias):
        return torch.nn.functional.linear(SwiGLU.apply(x, y), weight, bias)

    # optional: the gla extra (flash-linear-attention), only for its models
    import fla.models.modeling_utils as modeling_utils

    patches = [(gla_layer, "chunk_gla", chunk_gla), (gla_layer, "fused_chunk_gla", chunk_gla),
               (mlp, "swiglu", swiglu), (mlp, "swiglu_linear", swiglu_linear),
               (RMSNorm, "forward", rms_forward), (FusedRMSNormGated, "forward", gated_forward),
               (modeling_utils, "FusedCrossEntropyLoss", _FlaFusedCrossEntropy)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:  # only for the trace: the rest of the process keeps fla (or harness.models.fla_cpu) as it was
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
