"""The predictor's first stage: the step traced on fake tensors, and ZeRO-3's gathered set replayed.

`traced(job)` gives the 1- and 2-layer traces of the case's step (harness.predict.trace.trace), their figures
extrapolated to the case's depth, and the parameter inventory the closed-form states are sized from;
`with_states(job, traced)` DeepSpeed's coordinator replayed over the step (harness.predict.zero3.coordinator)
and the closed-form states beside it. On a cold start of a ZeRO-3 case the trace and the replay run side by
side, the trace in a forked child (`trace_alongside`).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections import Counter
from dataclasses import dataclass, field

from harness.models.registry import Architecture
from harness.predict.dispatch import route_for
from harness.predict.job import Job
from harness.predict.states import Inventory, States, model_states
from harness.predict.step import LAYER_POST, LAYER_PRE
from harness.predict.trace import trace
from harness.predict.zero3 import coordinator
from harness.predict.zero3 import stream as zero3_stream
from harness.predict.zero3.step import full_depth_sizes
from harness.spec.schema import Case


def inventory(r1, r2, layers: int):
    p1, p2 = r1.params, r2.params
    c1, c2 = Counter(p1.sizes), Counter(p2.sizes)
    per_layer = c2 - c1
    fixed = c1 - per_layer
    sizes = list((fixed + Counter({k: v * layers for k, v in per_layer.items()})).elements())
    ex = lambda a, b: round(trace.extrapolate(a, b, layers))  # noqa: E731
    return Inventory(quantizable=ex(p1.quantizable, p2.quantizable), other=ex(p1.other, p2.other),
                     trainable=ex(p1.trainable, p2.trainable), head=p1.head,
                     largest_layer_module=p1.largest_layer_module, sizes=sizes,
                     layer_sizes=list(per_layer.elements()), layers=layers,
                     largest_trainable=max((row[0] for row in (*r1.layout, *r2.layout) if row[3]), default=0),
                     trainable_sizes=_trainable_rows(r1, layers))


def _trainable_rows(r1, layers: int) -> list[int]:
    """The element counts of r1's trainable parameters at the case's depth (layer 0's repeated)."""
    rows = [r for r in r1.layout if r[3]]
    return ([r[0] for r in rows if r[4] in (LAYER_PRE, LAYER_POST)]
            + [r[0] for r in rows if r[4] not in (LAYER_PRE, LAYER_POST)] * layers)


def zero3_gathered(case: Case, arch: Architecture, layers: int, notes: list[str]):
    """DeepSpeed's coordinator replayed over the case's step (harness.predict.zero3.coordinator), for LoRA, QLoRA and
    full fine-tunes alike; None where the case is not ZeRO-3 or DeepSpeed is not installed (states.py then
    uses its closed form)."""
    if case.deepspeed is None or case.deepspeed.stage != 3:
        return None
    try:
        return coordinator.gathered(coordinator.spec_for(case, arch, layers))
    except ImportError as exc:
        notes.append(f"ZeRO-3 gathered set: the closed form; DeepSpeed's coordinator could not be imported ({exc})")
    except (ValueError, RuntimeError, AssertionError) as exc:  # a model or hook order the replay cannot follow
        notes.append(f"ZeRO-3 gathered set: the closed form; DeepSpeed's coordinator could not be replayed ({exc})")
    return None


# Trace specs this process has traced or read: their layout and replay are in its caches too.
_TRACED: set = set()


@dataclass
class TracedAlongside:
    """The step traced in a forked child while this process replays DeepSpeed's coordinator; where this
    process replays the step stream's steps under their own spec, the child replays the gathered set after
    the trace."""

    child: object  # multiprocessing.Process
    conn: object  # the read end of a pipe the child sends the traces, then (gathered, notes), through
    gathers: bool  # whether the child replays the gathered set

    def keep_trace(self, trace_spec) -> None:
        """The child's traces, kept for `trace_pair`; none where it sent none (it failed: `trace_pair` then
        traces here, where the failure is met again and reported)."""
        try:
            trace.keep_pair(trace_spec, self.conn.recv())
        except (EOFError, OSError):
            self.gathers = False  # nothing more comes

    def take_gathered(self, notes: list[str]):
        """The child's (gathered figures,), its notes added to `notes`; None where it replays none or sent
        nothing (the caller then replays in-process, where a failure is met again and reported)."""
        try:
            if not self.gathers:
                return None
            value, child_notes = self.conn.recv()
        except (EOFError, OSError):
            return None
        finally:
            self.conn.close()
            self.child.join()
        notes += child_notes
        return (value,)


def trace_alongside(case: Case, arch: Architecture, layers: int, trace_spec) -> TracedAlongside | None:
    """On a cold start of a ZeRO-3 case, trace the step in a forked child while this process replays
    DeepSpeed's coordinator: once the model's module layout is built here (transformers imported once),
    the two are independent and each takes seconds. This process replays what the step stream is built
    from (`coordinator.replayed_steps`, four steps), then builds that stream with the child's traces while the
    child replays the gathered set (two steps); where the two specs are one, or no step stream is built,
    this process replays the gathered set (`coordinator.gathered`, which keeps its steps) and the child only
    traces. None where nothing is gained or forking is not safe: a trace this process or the disk cache
    already has, one CPU, or threads running in this process (a forked child holds only the forking
    thread, and a lock another thread held stays locked in it)."""
    if (case.deepspeed is None or case.deepspeed.stage != 3
            or trace_spec in _TRACED
            or (os.cpu_count() or 1) < 2 or threading.active_count() > 1
            or "fork" not in multiprocessing.get_all_start_methods() or trace._load(trace_spec) is not None):
        return None
    try:  # the model's layout first, here: it builds the model as the trace will
        coordinator.layout(trace_spec)
        spec = coordinator.spec_for(case, arch, layers)
        steps = (zero3_stream.step_spec(zero3_stream.OnePoolShape.of(case, arch, layers))
                 if route_for(case).allocated == "zero3_step_stream" else spec)
    except Exception:  # met again, and reported, by the in-process trace and replay
        return None
    child_gathers = steps != spec
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_trace_in_child, args=(case, arch, layers, trace_spec, child_gathers, send),
                        daemon=True)
    child.start()
    send.close()
    try:
        if child_gathers:
            coordinator.replayed_steps(steps)
        else:
            coordinator.gathered(spec)
    except Exception:  # met again, and reported, where the prediction replays
        pass
    return TracedAlongside(child, receive, child_gathers)


def _trace_in_child(case: Case, arch: Architecture, layers: int, trace_spec, gathers: bool, send) -> None:
    """The forked child: sends the traces, then, where `gathers`, (gathered, notes); it stops at what fails
    (the parent then does it in-process, where the failure is met again and reported). Its torch runs on one
    thread: the OpenMP thread team the parent may have started is not in a forked process, and a parallel
    region waiting on it there never ends."""
    import torch  # heavy, and needed only by the child that traces (a warm prediction imports no torch)

    torch.set_num_threads(1)
    try:
        send.send(trace.trace_pair(trace_spec))
        if gathers:
            notes: list[str] = []
            send.send((zero3_gathered(case, arch, layers, notes), notes))
    except Exception:
        pass
    finally:
        send.close()


def trainable_sizes(case: Case, r1, layers: int, r2=None) -> list[int]:
    """The trainable parameters' elements in module order at the case's depth: every parameter of a full
    fine-tune (from the 1- and 2-layer models), the adapters of a LoRA or QLoRA one (layer 0's
    repeated)."""
    if case.method.kind == "full":
        return full_depth_sizes(r1.params.sizes, r2.params.sizes, layers)
    rows = [r for r in r1.layout if r[3]]
    before = [r[0] for r in rows if r[4] == LAYER_PRE]
    after = [r[0] for r in rows if r[4] == LAYER_POST]
    return before + [r[0] for r in rows if r[4] not in (LAYER_PRE, LAYER_POST)] * layers + after




@dataclass
class Traced:
    """The step as traced, at the case's depth, and what the states stage adds to it."""

    r1: object  # harness.predict.trace.trace.TraceResult at 1 layer
    r2: object  # and at 2
    peak: int  # the step's transient peak above the model states
    held: int  # the activations a forward keeps
    inv: Inventory
    alongside: TracedAlongside | None = None  # the forked child that traced, where one did
    stepped: object | None = None  # harness.predict.zero3.stream.OnePoolRun: the step's stream, where built
    stream_notes: list[str] = field(default_factory=list)  # its notes, added where it is used
    gathered: object | None = None  # harness.predict.zero3.coordinator.Gathered: the replayed gathered set, ZeRO-3 only
    states: States | None = None


def traced(job: Job) -> Traced:
    """Stage 1: the step of the real model code at full width with 1 and 2 layers on fake tensors, as the
    case's stack builds and trains it, extrapolated affinely to the case's depth."""
    case, arch, layers = job.case, job.arch, job.layers
    alongside = trace_alongside(case, arch, layers, job.trace_spec)
    if alongside is not None:
        alongside.keep_trace(job.trace_spec)
    r1, r2 = trace.trace_pair(job.trace_spec)
    _TRACED.add(job.trace_spec)
    if r1.attention_note:
        job.notes.append(r1.attention_note)
    t = Traced(r1, r2, int(trace.extrapolate(r1.peak, r2.peak, layers)),
               int(trace.extrapolate(r1.held_after_forward, r2.held_after_forward, layers)), inventory(r1, r2, layers),
               alongside)
    job.record("trace", "fake tensors, 1 and 2 layers, extrapolated", step_transient_peak=t.peak,
               activations_held_after_forward=t.held, logits=r1.logits, parameters=t.inv.total)
    return t


def with_states(job: Job, t: Traced) -> None:
    """Stage 2: the gathered set (waited for from the forked child, else replayed here) and the closed-form
    model states (harness.predict.states) beside it."""
    replayed = t.alongside.take_gathered(job.notes) if t.alongside is not None else None
    t.gathered = replayed[0] if replayed is not None else zero3_gathered(job.case, job.arch, job.layers, job.notes)
    t.states = model_states(job.case, t.inv, job.hidden, t.gathered)
    job.notes += t.states.notes
    job.record("states", "closed form" + (", DeepSpeed's coordinator replayed" if t.gathered is not None else ""),
               resident=t.states.resident, **{k: v for k, v in t.states.device.items()})
