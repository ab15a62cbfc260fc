"""The worker's probes: ablations after training that must never fail a run that trained."""

import pytest
import torch

from harness.runtime import probe
from harness.spec.cases import CASES_DIR, load_case

PLAN_A = load_case(CASES_DIR / "004-gla-plan-a-minimal.yaml")  # checkpointing, logits_to_keep, speed cost


class _Meas:
    def sync(self):
        pass


@pytest.fixture
def probes_that_oom_without_checkpointing(monkeypatch):
    """Probe functions as on a card too small for any ablation without checkpointing."""
    released = []

    def forward(model, batch, meas, checkpointing):
        if checkpointing is False:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 ...")
        return 100, 40

    def passes(model, batch, meas, checkpointing):
        if not checkpointing:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB.")
        return [0.3, 0.3, 0.3]

    monkeypatch.setattr(probe, "_forward_probe", forward)
    monkeypatch.setattr(probe, "_timed_passes", passes)
    monkeypatch.setattr(probe, "_eval_probe", lambda model, batch, meas, keep: (10, 1 if keep else 8))
    monkeypatch.setattr(probe, "_release_cache", lambda: released.append(True))
    return released


def test_a_probe_out_of_memory_is_recorded_and_the_other_probes_still_run(probes_that_oom_without_checkpointing):
    probes = probe.run_probes(PLAN_A, runner=None, engine=None, batch=None, meas=_Meas())
    assert set(probes.did_not_fit) == {"forward_without_checkpointing", "passes_without_checkpointing"}
    assert "Tried to allocate 32.00 MiB" in probes.did_not_fit["forward_without_checkpointing"]
    assert (probes.activation_bytes, probes.train_logits_bytes) == (100, 40)
    assert probes.activation_bytes_without_checkpointing is None and probes.checkpointing_effective is None
    assert probes.pass_s_with_checkpointing == [0.3, 0.3, 0.3] and probes.pass_s_without_checkpointing is None
    assert (probes.eval_logits_bytes, probes.eval_logits_bytes_all) == (1, 8)
    assert len(probes_that_oom_without_checkpointing) == 2  # the cache went back to the card after each
    assert probes.window[0] <= probes.window[1]


def test_an_error_other_than_out_of_memory_in_a_probe_still_fails_the_run(monkeypatch):
    def broken(model, batch, meas, checkpointing):
        raise RuntimeError("shape mismatch in the probe")

    monkeypatch.setattr(probe, "_forward_probe", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        probe.run_probes(PLAN_A, runner=None, engine=None, batch=None, meas=_Meas())
