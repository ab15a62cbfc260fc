"""The predictor's allocated stage: the most the step holds allocated at once, by the route's method.

* `terms`: the closed-form states (harness.predict.states) beside the larger of the trace's step peak
  (forward, backward, loss and logits), the optimizer step's transient, and under ZeRO-3 the most parameters
  gathered at once beside what a forward keeps, or every layer's frozen weights retained (reentrant
  checkpointing);
* `zero3_step_stream`: the allocator model's allocated peak over the step built as one stream with
  DeepSpeed's gathers among the model's allocations (harness.predict.zero3.stream), the gathered bytes and
  the activations each as they are at that moment; the terms' figure is kept as `allocated_by_terms`;
* `zero2_stream`: the terms' peak, or the allocator model's allocated peak over the ZeRO-2 stream
  (harness.predict.zero2.stream) where that is higher: the stream holds DeepSpeed's flat copy of the
  parameters beside the model's own at the engine's start and the gradient partition at the step, which
  the traced step does not. On one rank the partition is the whole model: Phi-3-mini's full fine-tune
  under optimizer offload, traced step 8.68 GiB, stream 14.23, measured 14.14.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.predict.allocator.stream import start_states
from harness.predict.constants import COPY_BYTES_PER_S, HOST_S_PER_ALLOCATION, GiB
from harness.predict.job import Job
from harness.predict.margin import MARGIN_FLOOR
from harness.predict.trace.trace import extrapolate
from harness.predict.traced import Traced
from harness.predict.zero2 import stream as zero2_stream
from harness.predict.zero3 import stream as zero3_stream


@dataclass
class Allocated:
    """The allocated peak and the parts the reserved stage weighs again."""

    peak: int
    backward_peak: int  # the forward/backward's (loss and logits)
    retention_peak: int  # a gather with every layer's frozen weights retained; 0 where none are
    gather_peak: int  # the most ZeRO-3 parameters gathered at once beside the activations; 0 elsewhere
    gathered_above: int  # of those, the bytes above what is gathered when backward starts
    stepped: zero3_stream.OnePoolRun | None  # the step's stream, where the route built it
    # the ZeRO-2 stream's run from each device state the load can begin from, where the route built them
    zero2: tuple[zero2_stream.Zero2Run, ...] = ()


def step_stream(job: Job, notes: list[str]) -> zero3_stream.OnePoolRun | None:
    """The step built as one stream with the coordinator's gathers among the model's allocations (each
    layer's hook events spread over its chunk; where the trace recorded them for the one-pool configs with
    the parameters on the host), whatever stream they run on. None where the route does not build it, or
    where it cannot be built."""
    if job.route.allocated != "zero3_step_stream":
        return None
    # the same shape as the one-pool reserve's where both apply: one stream for both figures
    shape = zero3_stream.OnePoolShape.of(job.case, job.arch, job.layers, zero3_stream.placement_for(job.case))
    return zero3_stream.simulated_or_none(job.trace_spec, shape, "the step's stream with the gathers",
                                          "the terms' peak", notes, "allocated")


def _gather_peak(job: Job, t: Traced, resident: int, above: int) -> tuple[int, int, int]:
    """(gather peak, gathered bytes above the backward's start, activations held then): the most ZeRO-3
    parameters gathered at once (harness.predict.zero3.coordinator) beside the activations a forward keeps.

    Where the replay puts that peak in a layer's backward, the layers above it are done: their saved layer
    inputs (the checkpoints) are freed, and what a forward through this layer and those below it keeps is
    held beside it (the output the training loop keeps, logits included, stays); in the embedding's backward
    every layer's and the loss's are done, and of what the forward kept only that output is left. The
    gathered bytes and the activations peak together where their sum does: each layer's backward and the
    embedding's are weighed with what is held there."""
    gathered, r1, r2, held = t.gathered, t.r1, t.r2, t.held
    peak_layer = gathered.peak_backward_layer if gathered is not None else -1
    held_at_gather = held if peak_layer < 0 else min(held, int(extrapolate(r1.held_after_forward,
                                                                           r2.held_after_forward, peak_layer + 1)))
    gathered_above = above
    if above and gathered is not None and gathered.layer_backward_peaks:
        # the replay's own peak where it falls outside the layers' backward and the embedding's, beside all
        # that a forward keeps
        outside = gathered.peak_bytes == gathered.outside_peak > max(gathered.layer_backward_peaks)
        candidates = [(gathered.peak_bytes + held, gathered.peak_bytes, held)] if outside else []
        for i, g in enumerate(gathered.layer_backward_peaks):
            h = min(held, int(extrapolate(r1.held_after_forward, r2.held_after_forward, i + 1)))
            candidates.append((g + h, g, h))
        if gathered.below_backward_peak:
            h = min(held, int(r1.logits))
            candidates.append((gathered.below_backward_peak + h, gathered.below_backward_peak, h))
        _, at, held_at_gather = max(candidates)
        gathered_above = max(0, at - gathered.backward_start_bytes)
    return (resident + gathered_above + held_at_gather if above else 0), gathered_above, held_at_gather


def allocated(job: Job, t: Traced) -> Allocated:
    """The stage: the terms' peak, and the step stream's in its place where the route built one."""
    case, states, notes, terms = job.case, t.states, job.notes, job.terms
    dev = dict(states.device)
    resident = states.resident
    grads_in_trace = case.deepspeed is None and case.train.grad_accum == 1
    before_step = resident - (dev.get("grads", 0) if grads_in_trace else 0)
    backward_peak = before_step + t.peak
    optimizer_peak = resident + states.optimizer_step_extra
    # ZeRO-3 + reentrant checkpointing + frozen weights: every layer's gathered weights held at once
    # (harness.predict.states.zero3_reentrant_retention), at the moment the next parameter is gathered
    retained = states.step_only.get("zero3_reentrant_retained_weights", 0)
    retention_peak = resident + retained if retained else 0
    # ZeRO-3: the most parameters gathered at once, above the backward's start where DeepSpeed keeps gathered
    # weights for reuse or (reentrant checkpointing) ties recomputed frozen weights to the root module
    above = states.step_only.get("zero3_gathered_above_backward_start", 0)
    gather_peak, gathered_above, held_at_gather = _gather_peak(job, t, resident, above)
    peak = max(backward_peak, optimizer_peak, retention_peak, gather_peak)
    notes += t.stream_notes

    terms.update({k: int(v) for k, v in dev.items()})
    terms.update({k: int(v) for k, v in states.step_only.items()})
    terms["activations_held_after_forward"] = t.held
    if gather_peak and gathered_above != above:  # the gathered bytes where they and the activations peak together
        terms["zero3_gathered_above_backward_start"] = int(gathered_above)
    if gather_peak and held_at_gather != t.held:
        terms["activations_held_at_gather_peak"] = held_at_gather
    terms["logits"] = int(t.r1.logits)
    terms["step_transient_peak"] = t.peak
    terms["optimizer_step_transient"] = states.optimizer_step_extra
    where = {backward_peak: "the forward/backward (loss and logits)", optimizer_peak: "the optimizer step",
             retention_peak: "a parameter gather with every layer's frozen weights retained (reentrant checkpointing)",
             gather_peak: "the most ZeRO-3 parameters gathered at once"}
    by_terms = peak
    method, zero2 = "terms", ()
    if t.stepped is not None:
        peak, method = _stepped_peak(job, t.stepped, by_terms, where[by_terms]), "zero3_step_stream"
    elif job.route.allocated == "zero2_stream":
        shape = zero2_stream.Zero2Shape.of(job.case, job.layers, job.hidden)
        zero2 = tuple(zero2_stream.simulated(job.trace_spec, s) for s in start_states(shape))
        peak, method = _zero2_peak(job, zero2, by_terms, where[by_terms])
    else:
        notes.append("peak during " + where[by_terms])
    job.record("allocated", method, allocated=peak,
               by_terms=by_terms, forward_backward=backward_peak, optimizer_step=optimizer_peak,
               reentrant_retention=retention_peak, zero3_gathers=gather_peak)
    return Allocated(peak, backward_peak, retention_peak, gather_peak, gathered_above, t.stepped, zero2)


def _zero2_peak(job: Job, runs: tuple[zero2_stream.Zero2Run, ...], by_terms: int, where: str) -> tuple[int, str]:
    """The ZeRO-2 stream's allocated peak where it is above the terms' (of the runs from each device state
    the load can begin from, `start_states`: the higher)."""
    stream_peak = max(run.peak_allocated for run in runs)
    if stream_peak <= by_terms:
        job.notes.append("peak during " + where)
        return by_terms, "terms"
    job.terms["allocated_by_terms"] = by_terms
    job.notes.append(f"allocated: the ZeRO-2 stream's peak, {stream_peak / GiB:.2f} GiB (DeepSpeed's flat buffers "
                     f"among the model's allocations), above the terms' {by_terms / GiB:.2f} GiB during {where}")
    return stream_peak, "zero2_stream"


def _stepped_peak(job: Job, stepped: zero3_stream.OnePoolRun, by_terms: int, where: str) -> int:
    """The step stream's allocated peak in place of the terms', its notes and terms added."""
    notes, terms = job.notes, job.terms
    terms["allocated_by_terms"] = by_terms
    terms["zero3_gathered_at_allocated_peak"] = stepped.gathered_at_allocated_peak
    notes.append(f"allocated: the peak of the step's stream with DeepSpeed's gathers in it (zero.Init's load, the "
                 f"engine's buffers, four micro-steps), {stepped.peak_allocated / GiB:.2f} GiB during the "
                 f"{stepped.allocated_phase}, {stepped.gathered_at_allocated_peak / GiB:.2f} GiB of it gathered; "
                 f"the terms' peak during {where} was {by_terms / GiB:.2f} GiB")
    peak = stepped.peak_allocated
    inputs = stepped.gather_inputs_at_allocated_peak
    if inputs:
        terms["zero3_gather_inputs_at_allocated_peak"] = inputs
    if stepped.peak_allocated_held > peak:
        terms["allocated_with_gather_inputs_held"] = stepped.peak_allocated_held
    if stepped.peak_allocated_held - peak > MARGIN_FLOOR * peak or inputs > MARGIN_FLOOR * peak:
        notes.append(f"allocated: {inputs / GiB:.2f} GiB of it are host partition copies handed to NCCL as "
                     "gather inputs; NCCL lets one go once its watchdog (polling every 100 ms) has seen the "
                     "gather done and another collective is launched, so the step is timed (a host spending "
                     f"{HOST_S_PER_ALLOCATION * 1e6:.0f} us per allocation and copying at "
                     f"{COPY_BYTES_PER_S / 1e9:.0f} GB/s, faster than any recorded) and the figure is its "
                     "worst watchdog phase; with every copy held to its gather's wait, "
                     f"{stepped.peak_allocated_held / GiB:.2f} GiB, the most any host's run can reach")
    return peak
