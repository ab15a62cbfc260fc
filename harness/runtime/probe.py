"""The probe phase: ablations measured after training on one batch (checkpointing off, every logit,
timed passes), the figures behind the cases' relative claims. A probe that does not fit is recorded,
never a failed run."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path


def _measured_forward(model, batch, meas, grad: bool, **kwargs) -> tuple[int, int, int | None]:
    """One forward from a synchronised start: (bytes it leaves alive, its peak above the start,
    the bytes of its logits)."""
    import torch

    meas.sync()
    start = meas.current()
    meas.reset()
    with torch.set_grad_enabled(grad):
        out = model(input_ids=batch, **kwargs)
        meas.sync()
        held = meas.current() - start
        logits = out.logits.numel() * out.logits.element_size() if out.logits is not None else None
    del out
    return held, meas.figures().allocated - start, logits


@contextlib.contextmanager
def _checkpointing_as(model, on: bool | None):
    """Checkpointing turned on or off for a probe (None: as the case configures it), then restored."""
    from harness.runtime.build import checkpointing_active, set_checkpointing

    base = getattr(model, "module", model)  # DeepSpeed engine -> peft/HF model
    hf = base.get_base_model() if hasattr(base, "get_base_model") else base
    was = checkpointing_active(hf)
    toggled = on is not None and on != was
    if toggled:
        set_checkpointing(hf, on)
    try:
        yield
    finally:
        if toggled:
            set_checkpointing(hf, was)


def _forward_probe(model, batch, meas, checkpointing: bool | None):
    """Bytes a training forward leaves alive for backward (activations, logits, loss), measured
    without running backward, so neither gradients nor optimizer state move."""
    with _checkpointing_as(model, checkpointing):
        held, _, logits = _measured_forward(model, batch, meas, grad=True, labels=batch)
    return held, logits


def _timed_passes(model, batch, meas, checkpointing: bool, repeats: int = 3) -> list[float]:
    """Seconds of `repeats` training forwards and backwards with checkpointing on or off, after one
    untimed warm-up; gradients are dropped after each. What checkpointing costs in speed: the
    optimizer step, the same either way, is left out."""
    times = []
    with _checkpointing_as(model, checkpointing):
        for i in range(repeats + 1):
            try:
                meas.sync()
                start = time.perf_counter()
                model(input_ids=batch, labels=batch).loss.backward()
                meas.sync()
                if i:
                    times.append(time.perf_counter() - start)
            finally:  # also when a pass runs out of memory: the next probe needs the card
                model.zero_grad(set_to_none=True)
    return times


@contextlib.contextmanager
def card_to_itself(out_dir: Path, local_rank: int, shared: bool):
    """Jobs sharing one card (`launch.procs_per_card` > 1) take turns for their probes. Their
    training steps run side by side, as on the real card; a probe measures one job's ablation
    (checkpointing off, every logit), and two jobs' ablations at once can run out of the emulated
    card where neither training does: guide 004 plan A's probes did on an H100 on 2026-11-26, the
    one job 10.80 GiB in its forward without checkpointing while the other held 12.70 GiB in its
    timed backward. Only for jobs without collectives: a DeepSpeed rank waiting here while its
    peers gather parameters in their probes would hang them all."""
    if not shared:
        yield
        return
    # filelock (a dependency of torch) rather than fcntl by hand: it releases on process death too
    from filelock import FileLock

    with FileLock(str(out_dir / f"probes-card{local_rank}.lock")):
        try:
            yield
        finally:
            _release_cache()


def _release_cache():
    """Hand the allocator's cached blocks back to the card (for the next job's probe)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_probes(case, runner, engine, batch, meas):
    """The ablations behind the relative claims, measured after training on one batch. A probe that
    does not fit the card is recorded as such (`Probes.did_not_fit`) and the next still runs: the
    run trained, and an ablation it does not use must not fail it."""
    import torch

    from harness.measure.records import Probes

    start = time.time()
    probes = Probes()

    def fitting(name, probe, *args):
        try:
            return probe(*args)
        except torch.OutOfMemoryError as exc:
            probes.did_not_fit[name] = str(exc).strip().splitlines()[0][:300]
            _release_cache()
            return None

    configured = fitting("forward", _forward_probe, runner, batch, meas, None)
    if configured:
        probes.activation_bytes, probes.train_logits_bytes = configured
    if case.train.gradient_checkpointing:
        without = fitting("forward_without_checkpointing", _forward_probe, runner, batch, meas, False)
        if without:
            probes.activation_bytes_without_checkpointing = without[0]
        if configured and without:
            probes.checkpointing_effective = probes.activation_bytes < probes.activation_bytes_without_checkpointing
        if engine is None and any(c.kind == "checkpointing_speed_cost" for c in case.claims):
            probes.pass_s_with_checkpointing = fitting("passes_with_checkpointing", _timed_passes,
                                                       runner, batch, meas, True)
            probes.pass_s_without_checkpointing = fitting("passes_without_checkpointing", _timed_passes,
                                                          runner, batch, meas, False)
    if case.train.logits_to_keep:
        kept = fitting("eval", _eval_probe, runner, batch, meas, case.train.logits_to_keep)
        if kept:
            probes.eval_peak_bytes, probes.eval_logits_bytes = kept
        every = fitting("eval_all_logits", _eval_probe, runner, batch, meas, 0)
        if every:
            probes.eval_peak_bytes_all_logits, probes.eval_logits_bytes_all = every
    probes.window = (start, time.time())
    return probes


def _eval_probe(model, batch, meas, logits_to_keep: int):
    """Peak above the start and logits bytes of an evaluation forward with `logits_to_keep`."""
    model.eval()
    try:
        _, peak, logits = _measured_forward(model, batch, meas, grad=False, logits_to_keep=logits_to_keep)
        return peak, logits
    finally:
        model.train()
