"""NCCL letting a gather's input go before its wait: the step stream's allocated peak, timed."""

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.predict.allocator.stream import Stream
from harness.predict.constants import HOST_S_PER_ALLOCATION, PHASES, WATCHDOG_POLL_S
from harness.predict.zero3 import gather_release
from harness.predict.zero3.stream import simulate

MiB = 2**20


def _gather(stream: Stream, nbytes: int, launch: bool = True) -> int:
    """A one-parameter gather's input: a host partition copied to the device, its collective launched."""
    ident = stream.alloc(nbytes)
    stream.gathers.add(ident)
    stream.gather_inputs.add(ident)
    stream.host_copies.add(ident)
    if launch:
        stream.launches.add(ident)
    return ident


def _host_work(stream: Stream, seconds: float) -> None:
    """Small allocations and frees that take the host `seconds`."""
    for _ in range(round(seconds / HOST_S_PER_ALLOCATION)):
        stream.free(stream.alloc(512))


def _step(seconds_before_launch: float | None, seconds_after: float = 0.0) -> tuple[Stream, int]:
    """A 64 MiB input gathered ahead of its wait, host work, maybe another gather's launch, more host
    work, then the step's peak (a 256 MiB allocation) before the first input is waited on."""
    stream = Stream([], [], [])
    stream.mark("backward")
    first = _gather(stream, 64 * MiB)
    _host_work(stream, seconds_before_launch or 0.0)
    if seconds_before_launch is not None:
        _gather(stream, 2 * MiB)
    _host_work(stream, seconds_after)
    stream.free(stream.alloc(256 * MiB))
    stream.free(first)
    return stream, first


def test_an_input_goes_at_the_first_launch_after_the_watchdog_has_seen_its_gather_done():
    """A poll period and more after the gather, the next launch lets its input go at every watchdog
    phase: the peak is without it, where the replay's wait-bound figure holds it."""
    stream, _ = _step(1.5 * WATCHDOG_POLL_S)
    run = simulate(stream)
    assert run.peak_allocated_held == (64 + 2 + 256) * MiB
    assert run.peak_allocated == (2 + 256) * MiB
    assert run.gather_inputs_at_allocated_peak == 2 * MiB  # the later gather's input, launched within the poll


def test_an_input_stays_while_no_collective_is_launched():
    """However long the host works after the gather, with no collective launched after it the input is
    held to its wait: guide 000's embedding copy, live at its step's peak."""
    stream, _ = _step(None, seconds_after=3 * WATCHDOG_POLL_S)
    run = simulate(stream)
    assert run.peak_allocated == run.peak_allocated_held == (64 + 256) * MiB
    assert run.gather_inputs_at_allocated_peak == 64 * MiB


def test_the_figure_is_the_worst_watchdog_phase():
    """Half a poll period between the gather and the next launch: the input goes at about half the phases
    (the poll falls between them) and stays at the others; the figure keeps it."""
    stream, first = _step(0.5 * WATCHDOG_POLL_S)
    run = simulate(stream)
    assert run.peak_allocated == run.peak_allocated_held == (64 + 2 + 256) * MiB

    clock = gather_release.Clock()
    held = allocs = 0
    for i, op in enumerate(stream.ops):  # the moments simulate collects, without the allocator
        if op >= 0:
            allocs += 1
            held += stream.sizes[op]
            if op in stream.gathers:
                clock.gather(op, stream.sizes[op], allocs, i, host_copy=op in stream.host_copies,
                             gather_input=op in stream.gather_inputs, launch=op in stream.launches)
        else:
            clock.freed(-op - 1, i)
            held -= stream.sizes[-op - 1]
        clock.allocated.append(held)
    candidates = gather_release._candidates(clock)
    going = [phase for phase in (i * WATCHDOG_POLL_S / PHASES for i in range(PHASES))
             if any(ident == first for *_, ident in gather_release._let_go(clock, phase, candidates))]
    assert abs(len(going) - PHASES / 2) <= 1, len(going)
    assert gather_release.worst_phase(clock).let_go == frozenset()


def test_a_stream_without_gather_inputs_is_not_timed():
    """Gathers of parameters on the device hand NCCL no copy: the allocated peak is the allocator's."""
    stream = Stream([], [], [])
    stream.mark("forward")
    buffer = stream.alloc(8 * MiB)
    stream.gathers.add(buffer)
    stream.launches.add(buffer)
    stream.alloc(4 * MiB)
    stream.free(buffer)
    run = simulate(stream)
    assert run.peak_allocated == run.peak_allocated_held == 12 * MiB
    assert (run.gathered_at_allocated_peak, run.gather_inputs_at_allocated_peak) == (8 * MiB, 0)


# a random step: the model's allocations and frees, gathers whose inputs are freed at their waits, host work
_ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 64)),  # MiB
    st.tuples(st.just("free"), st.integers(0, 10**6)),
    st.tuples(st.just("gather"), st.integers(1, 32)),
    st.tuples(st.just("wait"), st.integers(0, 10**6)),
    st.tuples(st.just("host"), st.integers(1, 4)),  # tenths of a poll period of small allocations
), min_size=1, max_size=40)


def _random_stream(actions) -> Stream:
    stream = Stream([], [], [])
    stream.mark("forward")
    model, inputs = [], []
    for kind, n in actions:
        if kind == "alloc":
            model.append(stream.alloc(n * MiB))
        elif kind == "free" and model:
            stream.free(model.pop(n % len(model)))
        elif kind == "gather":
            inputs.append(_gather(stream, n * MiB))
        elif kind == "wait" and inputs:
            stream.free(inputs.pop(n % len(inputs)))
        elif kind == "host":
            _host_work(stream, n * WATCHDOG_POLL_S / 10)
    return stream


@settings(max_examples=60, deadline=None)
@given(_ACTIONS)
def test_the_timed_peak_lies_between_every_input_let_go_and_every_input_held(actions):
    """Whatever the step, NCCL letting inputs go can only lower the allocated peak, by at most the inputs
    live at the held peak's moment or after; with the inputs held to their waits the figure is the
    allocator's, and the parts at the peak add up."""
    stream = _random_stream(actions)
    run = simulate(stream)
    inputs = sum(stream.sizes[i] for i in stream.gather_inputs)
    assert run.peak_allocated <= run.peak_allocated_held
    assert run.peak_allocated >= run.peak_allocated_held - inputs
    assert 0 <= run.gather_inputs_at_allocated_peak <= run.gathered_at_allocated_peak <= run.peak_allocated
    held = Stream(stream.ops, stream.sizes, stream.phases, set(stream.gathers))  # no inputs: nothing let go
    assert simulate(held).peak_allocated == run.peak_allocated_held
