"""ZeRO-3's optimizer step on the device: the reserve its fp32 gradient takes beside the forward and backward's.

Without optimizer offload, DeepSpeed 0.19.8's ZeRO-3 steps the optimizer one sub-group at a time
(`deepspeed/runtime/zero/stage3.py`, `DeepSpeedZeroOptimizer_Stage3`):

- `_create_fp16_sub_groups` cuts each optimizer parameter group, in its order, into sub-groups: a
  sub-group closes once its parameters' partitions (`partition_numel`, ceil(numel / ranks)) add up to
  at least `sub_group_size` elements (1e9 by default), so the largest holds up to one partition more;
- `_prepare_fp32_grad_for_sub_group` (called from `_prepare_sub_group` only when the optimizer is not
  offloaded) flattens the sub-group's gradient partitions into one half-precision tensor and casts it
  to the master weights' dtype: one contiguous fp32 block of 4 bytes per element of the sub-group,
  held through that sub-group's step and freed by `_release_sub_group`;
- `initialize_optimizer_states` allocates and frees a zeroed fp32 buffer of the largest sub-group
  when the engine is built, and the optimizer's first step creates the Adam moments of every
  sub-group (`fused_adam.py`, lazily).

The caching allocator serves the first step's fp32 gradient from that freed buffer's segment, but the
blocks that first step places next (the Adam moments of the later sub-groups, or the next flatten)
are put in it by best fit, and what the forward and backward free is in smaller blocks (gathered
parameters, logits): from the second step on, the largest sub-group's fp32 gradient finds no cached
block of its size and takes a new segment, on top of what the forward and backward reserved. The
recorded timeline of the Gemma-2-2B full fine-tune (ZeRO-3, 2 ranks,
`results/architectures/timelines/nvidia-h200-x2/`) shows it: the reserved peak, 38.05 GiB, is the
second optimizer step's 3,818 MiB segment for sub-group 0's fp32 gradient (1.0004e9 elements) on the
34.32 GiB that the forward and backward had left reserved, with the first step's engine-init segment
of the same size holding sub-group 1's `exp_avg_sq` (1,170 MiB) and 2,648 MiB free.

Where the forward and backward allocate a block at least that large (long sequences' logits), the
gradient can take its freed segment, and nothing is added. With optimizer offload the fp32 gradient
is built in host memory and nothing is added either.

With optimizer offload, the gradient partitions live in a host buffer, and DeepSpeed's
`partition_grads` works on its own CUDA stream (`reduce_and_partition_stream`), whose blocks the
caching allocator keeps in a pool of that stream, apart from the model's. For each parameter of a
reduce bucket, one after another, it copies the partition to the device (`grad_buffer.to(device)`, or
`cuda_grad_buffer` when accumulating: the gradient dtype), and at the accumulation boundary
`_offload_grad_partition_at_boundary` takes its norm (`_constant_buffered_norm2`: chunks of up to
250M elements cast to fp64, `get_norm_dtype`) and casts it to fp32 for the host's fp32 gradient.
`reduce_stream_reserve` replays that sequence through the allocator model: on the recorded runs the
stream's pool is the largest parameter's copy and norm, 0.461 GiB on Phi-3-mini (49.2M elements per
rank: 94 + 376 MiB, and a small segment for the per-parameter norms) and 3.947 GiB on guide 002's
Gemma-3-27B (704.8M elements, expandable segments: 1,344 + 2,689 MiB in 20 MiB pages, and a small
page), reserved beside the model's pool. It is not in allocated's peak (the boundary comes after
backward's peak) nor in what the ratio sees.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.predict.allocator.allocator import AllocatorConf, CachingAllocator
from harness.predict.constants import DS_DEFAULTS, NORM_BYTES, NORM_CHUNK, ROUND_LARGE, GiB
from harness.spec.schema import Case, Offload


@dataclass(frozen=True)
class Fp32GradSegment:
    bytes: int  # the segment the fp32 gradient of the largest sub-group takes (0: none added)
    sub_groups: list[int]  # elements of each sub-group, per rank
    largest_step_block: int  # the largest block the forward and backward allocate
    note: str


def full_depth_sizes(sizes1: list[int], sizes2: list[int], layers: int) -> list[int]:
    """The parameters' element counts in module order at `layers` decoder layers, from the model at 1
    layer (`sizes1`: before the layers, layer 0, after) and at 2 (one layer's parameters more)."""
    k = len(sizes2) - len(sizes1)
    if k <= 0:
        return list(sizes1)
    n1 = len(sizes1)
    for post in range(n1 - k, -1, -1):  # the longest run after the layers that both share
        cut = n1 - post
        if sizes2[:cut] == sizes1[:cut] and sizes2[cut + k:] == sizes1[cut:]:
            return sizes1[:cut] + sizes2[cut:cut + k] * (layers - 1) + sizes1[cut:]
    return sizes1[:n1 - k] + sizes2[n1 - k:n1] * layers + sizes1[n1:]  # unreachable for a layered model


def sub_groups(partitions: list[int], sub_group_size: int) -> list[int]:
    """Elements of each sub-group, as `_create_fp16_sub_groups` cuts one parameter group."""
    total = sum(partitions)
    if sub_group_size >= total:
        return [total] if partitions else []
    out, current = [], 0
    for i, n in enumerate(partitions):
        current += n
        if current >= sub_group_size or i == len(partitions) - 1:
            out.append(current)
            current = 0
    return out


def fp32_grad_segment(case: Case, trainable_sizes: list[int] | None, trainable: int,
                      largest_step_block: int) -> Fp32GradSegment | None:
    """The segment ZeRO-3's optimizer step takes for the largest sub-group's fp32 gradient beyond what
    the forward and backward reserved; None where the case is not ZeRO-3 with the optimizer on the
    device. `trainable_sizes`: the trainable parameters' element counts in the optimizer's order
    (module order; the no-decay group's norms and biases, a few thousand elements a layer, are left
    in it); None where only their sum `trainable` is known (adapters: one sub-group unless they pass
    `sub_group_size`). `largest_step_block`: the largest block the forward and backward allocate (the
    trace's, or a gathered parameter)."""
    ds = case.deepspeed
    if ds is None or ds.stage != 3 or ds.offload_optimizer != Offload.none or trainable <= 0:
        return None
    ranks = case.launch.ranks
    size = ds.sub_group_size or DS_DEFAULTS["sub_group_size"]
    if trainable_sizes:
        groups = sub_groups([-(-n // ranks) for n in trainable_sizes], size)
    else:
        part = -(-trainable // ranks)
        groups = [part] if part <= size else [size] * (part // size) + ([part % size] if part % size else [])
    largest = max(groups)
    fp32 = 4 * largest  # the master weights' dtype (fp32) whatever the training precision
    segment = -(-fp32 // ROUND_LARGE) * ROUND_LARGE
    where = (f"ZeRO-3 optimizer step: {len(groups)} sub-group(s) of sub_group_size {size:.3g}, the largest "
             f"{largest / 1e6:.1f}M elements per rank; its fp32 gradient ({segment / GiB:.2f} GiB, "
             "stage3.py _prepare_fp32_grad_for_sub_group)")
    if segment <= largest_step_block:
        return Fp32GradSegment(0, groups, largest_step_block,
                               where + " fits a block the forward and backward free: nothing added")
    return Fp32GradSegment(segment, groups, largest_step_block,
                           where + " takes a segment of its own beyond the forward and backward's reserve "
                           f"(their largest block {largest_step_block / GiB:.2f} GiB)")


def reduce_stream_reserve(case: Case, partitions: list[int], conf=None) -> int | None:
    """What the caching allocator reserves for DeepSpeed's reduce stream under ZeRO-3 with optimizer
    offload, over one optimizer step's micro-steps (the last at the accumulation boundary);
    `partitions`: the trainable parameters' partition elements in the order backward reduces them
    (reverse module order). None where the case is not ZeRO-3 with optimizer offload. `conf`: the
    case's `harness.predict.allocator.allocator.AllocatorConf`."""

    ds = case.deepspeed
    if ds is None or ds.stage != 3 or ds.offload_optimizer == Offload.none or not partitions:
        return None
    grad = 4 if case.precision.value == "fp32" else 2  # the gradient accumulation dtype: the training dtype
    sim = CachingAllocator(conf or AllocatorConf())
    # micro-steps before the boundary free all they allocate and repeat one another: one stands for them
    steps = min(2, max(1, case.train.grad_accum))
    norms = []  # norm_for_param_grads: one fp64 scalar per parameter, kept for the step's clipping
    for micro in range(steps):
        boundary = micro == steps - 1
        for n in partitions:
            copy = sim.malloc(grad * n)  # partition_grads: the partition copied to the device
            if boundary:  # _offload_grad_partition_at_boundary
                for start in range(0, n, NORM_CHUNK):
                    sim.free(sim.malloc(NORM_BYTES * min(NORM_CHUNK, n - start)))
                norms.append(sim.malloc(NORM_BYTES))
                sim.free(sim.malloc(4 * n))  # cast to fp32 for the host's fp32 gradient
            sim.free(copy)
    return sim.stats.peak_reserved
