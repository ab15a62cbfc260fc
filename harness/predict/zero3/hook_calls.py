"""DeepSpeed's ZeRO-3 hooks on a model, driving a coordinator that only writes each call down.

DeepSpeed drives its parameter coordinator from hooks on every module (`DeepSpeedZeRoOffload.
setup_zero_stage3_hooks`, runtime/zero/parameter_offload.py). `hooked` registers exactly those, from the
installed DeepSpeed, on a model with a `Recorder` standing in for the coordinator: nothing is gathered or
partitioned. `harness.predict.zero3.hooks.record` writes the order the hooks fire in over a step;
`positions`, used by the trace (`harness.predict.trace.fake`), writes where among the step's allocations each
fires.
"""

from __future__ import annotations

import contextlib
import sys

from harness.predict.zero3.order import BWD_POST, BWD_PRE, FWD_POST, FWD_PRE


class Recorder:
    """Stands in for DeepSpeed's `PartitionedParameterCoordinator`: every call DeepSpeed's hooks make on it
    is written down, nothing is gathered."""

    def __init__(self, names: dict[int, str]):
        self.names = names
        self.events: list[tuple[int, str]] = []

    def _note(self, event: int, module) -> None:
        self.events.append((event, self.names[id(module)]))

    def fetch_sub_module(self, module, forward: bool) -> None:
        self._note(FWD_PRE if forward else BWD_PRE, module)

    def release_sub_module(self, module, forward: bool = False) -> None:
        self._note(FWD_POST if forward else BWD_POST, module)

    def trace_prologue(self, module) -> None:
        pass

    def is_record_trace(self) -> bool:
        return False

    def is_invalid_trace(self) -> bool:
        return True

    def reset_step(self) -> None:
        pass


class _Positions(Recorder):
    """A `Recorder` that writes down, with each event, where the trace's allocation log stands: `[log
    position, in backward (0 or 1), event, module name]`."""

    def __init__(self, names: dict[int, str], where, out: list):
        super().__init__(names)
        self.where, self.out = where, out

    def _note(self, event: int, module) -> None:
        self.out.append([*self.where(), event, self.names[id(module)]])


@contextlib.contextmanager
def module_stack_kept():
    """DeepSpeed keeps the modules whose forward runs in a global list (`FWD_MODULE_STACK`): a step run with
    its hooks leaves it as it was."""
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time logging (see zero3._deepspeed)
        # heavy: DeepSpeed (and torch), imported only to replay its coordinator
        from deepspeed.runtime.zero import parameter_offload
    saved = list(parameter_offload.FWD_MODULE_STACK)
    try:
        yield
    finally:
        parameter_offload.FWD_MODULE_STACK[:] = saved


@contextlib.contextmanager
def positions(model, where, out: list):
    """While the trace runs a step of `model`, DeepSpeed's own hooks on it append `[position, backward, event,
    module name]` to `out` for every event, `position, backward` what `where()` gives then (the allocation
    log's length, whether the backward has begun):
    where among the step's allocations and frees each hook fires, which the coordinator's gathers of a
    replayed step are placed by (`harness.predict.zero3.stream`, placement "recorded")."""
    with module_stack_kept():
        handles = hooked(model, _Positions({id(m): name or "root" for name, m in model.named_modules()}, where, out))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def hooked(model, recorder: Recorder) -> list:
    """DeepSpeed's own ZeRO-3 hook registration on `model`, driving `recorder`."""
    # heavy: DeepSpeed (and torch), imported only to replay its coordinator
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    offload = object.__new__(DeepSpeedZeRoOffload)  # only the hook methods are used: no partitioning
    offload.module, offload.param_coordinator, offload.zenflow = model, recorder, False
    offload.forward_hooks, offload.backward_hooks = [], []
    offload.setup_zero_stage3_hooks()
    return [*offload.forward_hooks, *offload.backward_hooks]
