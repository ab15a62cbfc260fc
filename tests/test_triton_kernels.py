"""harness.predict.triton_kernels reads each Triton kernel's per-thread stack from sm_90 cubins built on a CPU:
its parsing of cuobjdump, its interception of launches (an autotuned kernel's pruned candidates bound and
compiled, none run) and its survey; and the benchmark that prints it against the recorded cold runs."""

import json

import pytest
import torch
import triton
import triton.language as tl

from benchmarks import triton_autotune_stack as tas
from harness.predict import triton_kernels as tk

HOPPER = tk.Target(sm=90, sms=132, shared_per_block=232448, name="NVIDIA H100 80GB HBM3")

CUOBJDUMP_TEXT = """
Resource usage:
 Common:
  GLOBAL:0
 Function chunk_gla_bwd_kernel_inter:
  REG:255 STACK:1208 SHARED:0 LOCAL:0 CONSTANT[0]:620 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function k:
  REG:22 STACK:0 SHARED:16 LOCAL:40 CONSTANT[0]:560 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_cuobjdump_resource_usage_is_read_per_function():
    usage = tk.parse_resource_usage(CUOBJDUMP_TEXT)
    assert usage == {
        "chunk_gla_bwd_kernel_inter": {"REG": 255, "STACK": 1208, "SHARED": 0, "LOCAL": 0},
        "k": {"REG": 22, "STACK": 0, "SHARED": 16, "LOCAL": 40},
    }
    assert tk.parse_resource_usage("cuobjdump info    : File 'x.cubin' does not contain device code\n") == {}


def test_a_thread_needs_its_stack_frame_or_its_local_bytes_whichever_is_larger():
    assert tk.local_bytes_per_thread({"REG": 255, "STACK": 1208, "LOCAL": 0}) == 1208
    assert tk.local_bytes_per_thread({"REG": 22, "STACK": 0, "LOCAL": 40}) == 40
    assert tk.local_bytes_per_thread({"REG": 22}) == 0


def test_the_benchmark_converts_between_bytes_a_thread_and_gib():
    threads = 132 * 2048
    assert tas.resident_gib(1024, threads) == pytest.approx(1024 * 270_336 / 2**30)  # 0.264 GiB
    assert tas.bytes_per_thread_for(3.55, threads) == pytest.approx(14_100, abs=1)
    assert tas.resident_gib(round(tas.bytes_per_thread_for(3.55, threads)), threads) == pytest.approx(3.55, abs=1e-3)


def test_config_label_shows_tuned_values_else_block_sizes():
    tuned = {"BK": 64, "BV": 128, "num_warps": 4, "num_stages": 3, "num_ctas": 1}
    assert tk.config_label({"BT": 64, "K": 256}, tuned, 4, 3) == "BK=64 BV=128 w4 s3"
    assert tk.config_label({"BT": 64, "K": 256, "USE_G": True}, {}, 8, 2) == "BT=64 w8 s2"


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        tas.parse_args(["--out", "x.json", "--case", "no/such/case.yaml"])
    assert exc.value.code == 2 and "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        tas.parse_args(["--out", "x.json", "--only", "("])
    assert exc.value.code == 2 and "not a regular expression" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        tas.parse_args(["--out", "x.json", "--batch", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        tas.parse_args(["--out", "x.json", "--platform", "rtx-4090-x1"])
    assert exc.value.code == 2 and "cards.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        tas.parse_args(["--out", "x.json", "--save", "--only", "dv"])
    assert exc.value.code == 2 and "--save" in capsys.readouterr().err


def _keep_wide(configs, nargs, **kwargs):
    return [c for c in configs if c.kwargs["BLOCK"] >= 1024]


@triton.autotune(
    configs=[triton.Config({"BLOCK": b}, num_warps=1) for b in (256, 1024, 8192)],
    key=["n"], prune_configs_by={"early_config_prune": _keep_wide})
@triton.jit
def _double(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x - tl.sum(x), mask=offs < n)


def test_pruned_candidates_are_bound_compiled_and_never_run():
    undo = tk.pretend(HOPPER)
    interceptor = tk.Interceptor()
    interceptor.install()
    x = torch.arange(4096, dtype=torch.float32)
    try:
        _double[(1,)](x, 4096)
    finally:
        interceptor.remove()
        undo()
    assert torch.equal(x, torch.arange(4096, dtype=torch.float32))  # nothing ran
    launches = sorted(interceptor.launches.values(), key=lambda x: x.tuned["BLOCK"])
    assert [x.tuned["BLOCK"] for x in launches] == [1024, 8192]  # the pruned-away 256 is not launched
    assert all(x.candidates == 2 and x.options["num_warps"] == 1 for x in launches)
    assert launches[0].signature == {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    assert [x.constexprs for x in launches] == [{"BLOCK": 1024}, {"BLOCK": 8192}]
    rows = tk.compile_all(launches, sm=90)
    assert all("error" not in r for r in rows), rows
    narrow, wide = rows
    assert narrow["config"] == "BLOCK=1024 w1 s3" and 0 < narrow["reg"] <= 255
    # 8192 floats held by one warp (256 a thread) through a reduction cannot stay in registers: they spill
    assert wide["stack"] > narrow["stack"] and wide["bytes_per_thread"] == max(wide["stack"], wide["local"])


def test_each_kernel_keeps_its_largest_candidate_and_failures_are_left_out():
    def row(kernel, config, stack, reg=255, autotuned=True):
        return {"kernel": kernel, "config": config, "autotuned": autotuned, "reg": reg, "stack": stack,
                "bytes_per_thread": stack}

    rows = [row("dv", "BK=32 BV=64 w8 s2", 0, reg=94), row("dv", "BK=64 BV=128 w2 s2", 13288, reg=32),
            row("dv", "BK=32 BV=128 w4 s2", 1872), row("norm", "BT=64 w4 s3", 40, autotuned=False),
            {"kernel": "dv", "config": "BK=64 BV=128 w1 s2", "autotuned": True, "error": "PTXASError: x"}]
    kernels = tk.per_kernel(rows)
    assert list(kernels) == ["dv", "norm"]  # largest first
    assert kernels["dv"] == {"specializations": 3, "autotuned": True, "min_bytes_per_thread": 0,
                             "max_bytes_per_thread": 13288, "max_config": "BK=64 BV=128 w2 s2", "max_reg": 32}
    assert kernels["norm"]["specializations"] == 1 and kernels["norm"]["max_bytes_per_thread"] == 40


def test_the_observed_figure_is_the_cold_runs_extra_per_process_in_the_baselines(tmp_path):
    """Cold less warm of (card peak / processes - reserved), over the finished runs of guide 004's cases."""
    gib = 2**30
    (tmp_path / "h200").mkdir()
    runs = [{"outcome": "ok", "triton_cache": "cold", "per_card_peak": 8 * gib, "reserved_peak": 3 * gib},
            {"outcome": "ok", "triton_cache": "warm", "per_card_peak": 4 * gib, "reserved_peak": 3 * gib},
            {"outcome": "oom", "triton_cache": "cold", "per_card_peak": 20 * gib, "reserved_peak": 3 * gib}]
    (tmp_path / "h200" / "004-gla-plan-c-1proc.json").write_text(
        json.dumps({"case_id": "004-gla-plan-c-1proc", "runs": runs}))
    two = [{"outcome": "ok", "triton_cache": "cold", "per_card_peak": 16 * gib, "reserved_peak": 4 * gib}]
    (tmp_path / "h200" / "004-gla-plan-a-minimal.json").write_text(  # two processes per card
        json.dumps({"case_id": "004-gla-plan-a-minimal", "runs": two}))
    assert tas.cold_extra_from_baselines(tmp_path) == ((5 + 4) / 2 - 1)
    assert tas.cold_extra_from_baselines(tmp_path / "none") is None
