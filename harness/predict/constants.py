"""Every number the predictor assumes, copies from upstream code or starts a fit from, with its provenance.

One home, so that a figure is changed in one place and its source is read beside it. Three kinds:

* **copied**: a value read from a library's source, cited by file and version. It changes when the library
  does; check it against the new source when the supported version set moves.
* **assumed**: a figure no baseline fits, chosen and said why. A prediction that leans on one says so in its
  notes (host memory, for instance).
* **fitted**: a prior, the value used only where results/ holds no baseline to fit the constant on; the fit
  runs at call time over the blessed baselines (`harness.predict.calibration`), so nothing here is
  rewritten by hand. `python benchmarks/fitted_constants.py` prints every fitted value per platform and the
  runs it was fitted on.

Replay bounds (how many steps a model replays) are not figures of any run: they bound the work and are
chosen so that a further step changes no recorded figure, as each comment says.

The throughput model's constants are named data with their priors and provenance in
`harness/fit/throughput.json`, read by `harness.fit.throughput`.
"""

from __future__ import annotations

import sys

# DeepSpeed's ZeRO-1/2 alignment is defined beside the DeepSpeed config the runs build, below this layer
from harness.spec.dsconfig import NCCL_START_ALIGNMENT  # noqa: F401  (re-exported: the predictor's one home)

KiB = 2**10
MiB = 2**20
GiB = 2**30

# --- element sizes ---------------------------------------------------------------------------------------

FP32_BYTES = 4  # an fp32 element: DeepSpeed's master weights, moments and gradient partitions
# fp64: DeepSpeed's get_norm_dtype() is torch.double where the device has fp64 (CUDA, ROCm)
NORM_BYTES = 8
# bytes per element of the training precision's half dtype, by `Precision.value` (fp32 training keeps 4)
HALF_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# --- copied: PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.x) ---------------

MIN_BLOCK = 512  # kMinBlockSize: every size is rounded to at least 512 B
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool segment
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests below it take a 20 MiB segment
ROUND_LARGE = 2 << 20  # kRoundLarge: larger segments are rounded to 2 MiB
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a large pool segment for mid-size requests; expandable page
POWER2_INTERVALS = 16  # roundup_power2_divisions intervals: 1 MiB, 2 MiB, ... 32 GiB and above

# --- copied: cuBLAS workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize) --------

# One cuBLAS handle's workspace, taken through the caching allocator at the handle's first matmul, one for
# the forward's thread and one for autograd's. torch's default on Hopper (sm_90) is 4096 KiB x 8 = 32 MiB
# (elsewhere ":4096:2:16:8", 8 MiB + 128 KiB); the recorded H200 timelines (torch 2.11) show 32 MiB each.
CUBLAS_HANDLE_WORKSPACE = 32 * MiB
# The closed-form states' term for the two handles (`harness.predict.states`, the allocated peak by terms):
# 128 KiB per handle above the Hopper default, the ":16:8" part of the non-Hopper default added to it. The
# step streams use `CUBLAS_HANDLE_WORKSPACE`. Kept as it is so that every prediction and the error table
# stay what they were; 2 x CUBLAS_HANDLE_WORKSPACE is the upstream figure (256 KiB less).
CUBLAS_WORKSPACES_STATES = 2 * (CUBLAS_HANDLE_WORKSPACE + 128 * KiB)

# --- copied: DeepSpeed 0.19's defaults (deepspeed/runtime/zero/config.py, DeepSpeed 0.19.8) ---------------

# where neither the case nor 'auto' sets a value
DS_DEFAULTS = {
    "prefetch": 50_000_000,  # stage3_prefetch_bucket_size: pp_int(5e7)
    "max_live": 1_000_000_000,  # stage3_max_live_parameters: pp_int(1e9)
    "max_reuse": 1_000_000_000,  # stage3_max_reuse_distance: pp_int(1e9)
    "persistence": 100_000,  # stage3_param_persistence_threshold: pp_int(1e5)
    "model_persistence": sys.maxsize,  # model_persistence_threshold: pp_int(sys.maxsize)
    "sub_group_size": 1_000_000_000,  # sub_group_size: pp_int(1e9)
    "reduce_bucket_size": 500_000_000,  # reduce_bucket_size: pp_int(5e8)
}
# stage3.py _constant_buffered_norm2(buffer_size=250000000): the gradient norm's chunk
NORM_CHUNK = 250_000_000

# --- copied: bitsandbytes' 4-bit storage (bitsandbytes/functional.py quantize_4bit, bitsandbytes 0.50.2) ------

BNB_BLOCKSIZE = 64  # one fp32 absmax per 64 elements (quantize_4bit's default block)
# double quantization (compress_statistics): the absmax itself quantized in blocks of 256
# (`quantize_blockwise(absmax - offset, blocksize=256)`), one fp32 absmax per block
BNB_NESTED_BLOCKSIZE = 256

# --- copied: transformers' load (transformers/modeling_utils.py caching_allocator_warmup, transformers 5.17) ----

# the warm-up block is made only where it would take more than this beyond the cache already held unused
# ("If we only need to reallocate less than 1.5 GiB of what is already allocated, then don't allocate more")
WARMUP_MIN_NEW = 1.5 * GiB

# --- copied: the card (NVIDIA's H100 SXM and H200 specifications, compute capability 9.0) ---------------------

# streaming multiprocessors, and the threads each holds: how `gpu_reduce_kernel` (aten/src/ATen/native/cuda/
# Reduce.cuh) splits a reduction across blocks (`harness.predict.trace.fake._global_reduction`)
SMS = 132  # streaming multiprocessors of an H100 SXM and of an H200
THREADS_PER_SM = 2048  # resident threads per multiprocessor, compute capability 9.0

# --- copied: CUDA's local memory (the CUDA runtime's cudaLimitStackSize; NVIDIA's description of the driver) --

# The driver sizes a context's local memory for the most any launched kernel needs per thread, times every
# thread the card keeps resident, and keeps it (`harness.predict.local_memory`). Each thread's figure is the
# kernel's stack frame plus a syscall stack, rounded up; at the start it is the default stack limit's.
CUDA_DEFAULT_STACK = 1024  # cudaLimitStackSize's default, bytes per thread
CUDA_SYSCALL_STACK = 512  # bytes per thread the driver adds to a kernel's own (assumed: NVIDIA's forum)
CUDA_LOCAL_GRANULE = 256  # the per-thread figure is rounded up to this (assumed: NVIDIA's forum says 128 or 256)
# A survey of a step's Triton kernels (`harness.predict.triton_kernels`) runs it at two sequences, so that no
# batch-sized argument is specialized as 1. Not a figure of any run: the kernels' block sizes and head
# dimensions, which set their stacks, do not depend on the batch (GLA at 512 tokens: 1, 2 and 4 compile the
# same 408 candidates, the same largest stack).
SURVEY_BATCH = 2
# A survey's compile is stopped after this long (assumed: the GLA step's 408 candidates take 5 minutes on two
# busy cores with an empty Triton cache; six times that is a compiler that hangs, not one that works)
SURVEY_TIMEOUT_S = 1800

# --- copied: Triton's autotuner (triton/backends/nvidia/driver.py get_empty_cache_for_benchmark, Triton 3.6-3.9) -

# `do_bench` clears the L2 cache between timings by writing a buffer it takes with torch.empty on the device,
# through PyTorch's caching allocator, and drops after each tuning: only on a cold cache, where tunings run
TRITON_BENCH_BUFFER = 256 * MiB

# --- copied: cuDNN attention's admission rules (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch 2.11) --

CUDNN_MAX_BATCH_OR_HEADS = 65535  # check_cudnn_tensor_shapes: batch and heads at most this
CUDNN_MAX_HEAD_DIM = 256  # check_cudnn_tensor_shapes: query/key and value head dims at most this ...
CUDNN_HEAD_DIM_MULTIPLE = 8  # ... and multiples of this
CUDNN_BACKWARD_HEAD_DIM = 128  # check_cudnn_d256_bprop_head_dim: a backward takes d <= this, or one of:
CUDNN_BACKWARD_HEAD_DIMS = ((192, 128), (256, 256))  # (query/key, value) head dims a backward takes beyond it
CUDNN_DROPOUT_STEPS = 16  # dropout a whole multiple of 1/16 (cuDNN's dropout granularity)

# --- copied: NCCL's watchdog (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp) -----------------------------

WATCHDOG_POLL_S = 0.1  # ProcessGroupNCCL's watchdog sleeps 100 ms between its checks of the work list

# --- assumed ------------------------------------------------------------------------------------------------

# A tensor made on the device before the model is loaded: torchaudio's import makes one of 4 bytes (the first
# action of every recorded run on hosts that have torchaudio, `transformers/audio_utils.py`).
TENSOR_BEFORE_LOAD = 4
# A host's time per allocator action while it launches a gather: under the fastest recorded warm step (170 us
# per allocator action), so the step it times is never slower than a recorded one
HOST_S_PER_ALLOCATION = 150e-6
# A pinned host partition copied to the device: PCIe Gen5 x16, faster than any recorded copy
COPY_BYTES_PER_S = 50e9
# Host memory (not fitted: the baselines hold no host figure yet; each prediction says so in its notes)
HOST_PROCESS_BASE = 3 * GiB  # torch + CUDA libraries + Python of one training process
HOST_PER_WORKER = int(0.5 * GiB)  # one dataloader worker (forked, copy-on-write)

# --- fitted: the priors of `harness.predict.calibration`'s constants ------------------------------------------

# Used only where results/ holds no baseline to fit a constant on (a prediction then says so in its notes).
# Assumed starting values, each replaced by its fit where a baseline exists; what each one measures and how
# it is fitted: harness.predict.calibration. zero3_cached_gathers 2.0: about two blocks of the largest
# gathered parameter stay cached, as on guide 000's 32B.
PRIORS = {"reserved_over_allocated": 1.05, "zero3_cached_gathers": 2.0, "device_overhead": 0.6 * GiB,
          "device_overhead_deepspeed": 0.5 * GiB}

# --- replay bounds (not figures of any run) ---------------------------------------------------------------

# At most this many optimizer steps are replayed while the allocator's state still changes from one step to
# the next (a bound on the replay's time: see `harness.predict.allocator.stream.simulate_run`).
MAX_STEPS = 8
# ZeRO-3's coordinator: the first step records DeepSpeed's trace, the second uses it
ROUNDS = 2
# The gather stream's pool: over as many steps as the recorded runs made (two optimizer steps of two
# micro-steps); on guide 000's it still grew in the third, on Phi-3-mini's and Gemma-2-2B's not after the
# second. LoRA with its parameters offloaded too: its recorded gather streams settle in the second micro-step
# (guide 000's 32B, Mistral-7B), and a fourth replayed step changes no figure of those runs; four are
# replayed, as the step stream the allocated peak is taken from is built over (harness.predict.zero3.stream),
# so one replay serves both
POOL_ROUNDS = 4
# ZeRO-3's step stream: two optimizer steps of two micro-steps, as the recorded runs made
MICRO_STEPS = 4
# LoRA with its parameters offloaded: no optimizer step on the model's stream (the optimizer is on the host,
# the gradients' copies on the reduce stream), so every micro-step after the first repeats the second's
# allocations; the recorded streams peak in the first backward (guide 000, Mistral-7B) or the second (rung 4)
OFFLOAD_MICRO_STEPS = 2
# ZeRO-3's hook recording: layer 0, and layer 1 standing for every later one
RECORDED_LAYERS = 2
# the hooks fire per module call, whatever the batch: one sequence this long is recorded for every shape of
# a config, so configs that differ only in batch, length or accumulation (fit's candidates) share one recording
RECORDED_TOKENS = 64
# NCCL's watchdog phases tried, evenly over one poll period (`harness.predict.zero3.gather_release`)
PHASES = 20
