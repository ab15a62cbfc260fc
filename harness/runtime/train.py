"""The step phase: the case's optimizer steps, each of `grad_accum` micro-steps, timed one by one from a
synchronised start, with the loss of each; the clocks are read over the steps after the warm-up."""

from __future__ import annotations

import statistics
import time


def train_steps(trainer, shape, batches, device, meas, report, progress, history=None) -> None:
    """Run `shape.steps` optimizer steps; append each step's seconds and mean loss to `report`.
    `history` (harness.runtime.memory_history), where recording, labels each phase of the step."""
    import torch

    def phase(name: str) -> None:
        if history is not None:
            history.phase(name)

    engine, model = trainer.engine, trainer.model
    for _ in range(shape.steps):
        meas.sync()
        t0 = time.perf_counter()
        losses = []
        for _micro in range(shape.grad_accum):
            phase("forward")
            batch = next(batches).to(device, non_blocking=True)
            out = trainer.runner(input_ids=batch, labels=batch)
            loss = out.loss
            phase("backward")
            if engine is not None:
                engine.backward(loss)
                phase("optimizer")
                engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            else:
                (loss / shape.grad_accum).backward()
            losses.append(float(loss.detach()))
            del out, loss
            meas.check_cpu_limit()
        if engine is None:
            phase("optimizer")
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
        meas.sync()
        report.step_times_s.append(time.perf_counter() - t0)
        report.losses.append(statistics.fmean(losses))
        progress(f"step {len(report.step_times_s)}/{shape.steps} in {report.step_times_s[-1]:.2f} s")
        if len(report.step_times_s) == report.warmup_steps:
            meas.sampler.reset_clocks()  # the clock of the timed steps, not of the warm-up's compilation
