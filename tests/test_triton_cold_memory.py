"""benchmarks/triton_cold_memory.py runs on a GPU host only: what can go wrong there without a GPU to
try it on is checked here (its arguments, its refusals, its hooks on Triton's launch path driven by
stand-in classes, the summary and the JSON it writes after a failure)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import triton_cold_memory as tcm
from harness.spec.cases import CASES_DIR

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "triton_cold_memory.py"
MODULE_BYTES, STACK_STEP = 4 << 20, 1 << 10


class FakeProbe:
    """Device memory that grows by MODULE_BYTES at each module load and, at a launch of a spilling
    kernel, by what the driver's grown stack takes (the stack limit rises STACK_STEP)."""

    def __init__(self):
        self.device, self.reserved, self.stack = 1 << 30, 1 << 29, 1024

    def snap(self, phase=None):
        out = {"device": self.device, "reserved": self.reserved, "outside": self.device - self.reserved,
               "stack": self.stack, "card_used": self.device}
        return {"phase": phase, **out} if phase else out

    def local_bytes(self, function):
        return 64 if function else None


PROBE = FakeProbe()


class FakeCompiled:
    def __init__(self, name, spills):
        self.name, self.hash, self.module, self.function, self.spills = name, f"h-{name}", None, None, spills
        self.asm, self.launched = {"cubin": b"x" * 100}, False

    def _init_handles(self):
        if self.module is not None:
            return
        PROBE.device += MODULE_BYTES
        self.module, self.function, self.n_regs, self.n_spills = 1, 0xABC, 255, self.spills

    def launch(self):
        self._init_handles()
        if self.n_spills and not self.launched:  # the driver grows the stack once, never shrinks it
            PROBE.stack += STACK_STEP
            PROBE.device += STACK_STEP * 132 * 2048
        self.launched = True


class FakeJIT:
    def __init__(self, name, spills=0):
        self.__name__, self.spills, self.kernels = name, spills, {}

    def run(self, *args, grid, warmup, **kwargs):
        key = tcm.config_label(kwargs)
        kernel = self.kernels.get(key) or self._do_compile(key)
        if not warmup:
            kernel.launch()
        return kernel

    def _do_compile(self, key):
        self.kernels[key] = FakeCompiled(self.__name__, self.spills)
        return self.kernels[key]


class FakeAutotuner:
    def __init__(self, fn, configs):
        self.fn, self.configs, self.cache, self.base_fn = fn, configs, {}, fn

    def _bench(self, *args, config, **meta):
        self.fn.run(*args, grid=(1,), warmup=False, **meta, **config)
        if config["BLOCK"] == 128:
            PROBE.reserved += 256 << 20  # the benchmark buffer, through torch's allocator
        return [float(config["BLOCK"])]

    def run(self, *args, **kwargs):
        if "key" not in self.cache:
            timings = {i: self._bench(*args, config=c, **kwargs) for i, c in enumerate(self.configs)}
            self.cache["key"] = self.configs[min(timings, key=timings.get)]
        return self.fn.run(*args, grid=(1,), warmup=False, **kwargs, **self.cache["key"])


@pytest.fixture
def hooks():
    global PROBE
    PROBE = FakeProbe()
    originals = (FakeJIT.run, FakeJIT._do_compile, FakeCompiled._init_handles, FakeAutotuner.run, FakeAutotuner._bench)
    h = tcm.Hooks(PROBE)
    assert set(h.install(FakeJIT, FakeCompiled, FakeAutotuner).values()) == {"hooked"}
    yield h
    h.uninstall()
    assert (FakeJIT.run, FakeJIT._do_compile, FakeCompiled._init_handles, FakeAutotuner.run,
            FakeAutotuner._bench) == originals


def test_each_new_kernel_is_measured_once_at_its_load_and_its_first_launch(hooks):
    plain, spilling = FakeJIT("plain"), FakeJIT("spilling", spills=12)
    for _ in range(3):
        plain.run(grid=(1,), warmup=False, BLOCK=64)
        spilling.run(grid=(1,), warmup=False, BLOCK=64)
    assert [k["name"] for k in hooks.kernels] == ["plain", "spilling"]
    first, second = hooks.kernels
    assert first["config"] == "BLOCK=64" and first["n_spills"] == 0 and first["local_bytes"] == 64
    assert first["load_jump"]["outside"] == MODULE_BYTES and first["launch_jump"]["outside"] == 0
    assert second["launch_jump"] == {"device": STACK_STEP * 132 * 2048, "reserved": 0,
                                     "outside": STACK_STEP * 132 * 2048, "stack": STACK_STEP,
                                     "card_used": STACK_STEP * 132 * 2048}
    assert second["jump"]["outside"] == MODULE_BYTES + STACK_STEP * 132 * 2048
    assert second["cubin_bytes"] == 100 and "compile_s" in second


def test_a_kernel_compiled_at_warmup_is_measured_at_its_load(hooks):
    fn = FakeJIT("warmed")
    fn.run(grid=(1,), warmup=True, BLOCK=32)
    fn.run(grid=(1,), warmup=False, BLOCK=32)
    compiled, loaded = hooks.kernels
    assert "after_load" not in compiled and compiled["jump"]["outside"] == 0
    assert "before" not in loaded and loaded["jump"]["outside"] == MODULE_BYTES


def test_an_autotuning_counts_its_candidates_and_its_reserved_growth(hooks):
    tuner = FakeAutotuner(FakeJIT("tuned", spills=1), [{"BLOCK": 64}, {"BLOCK": 128}, {"BLOCK": 256}])
    for _ in range(2):
        tuner.run(T=512)
    (tune,) = hooks.tunes
    assert tune["name"] == "tuned" and tune["configs"] == 3 and tune["benchmarked"] == 3
    assert tune["new_kernels"] == 3 and tune["jump"]["reserved"] == 256 << 20
    assert len(hooks.kernels) == 3  # the winner's later launches compile nothing new
    summary = tcm.summarize([PROBE.snap("cuda init"), PROBE.snap("end")], hooks.kernels, hooks.tunes,
                            {"multi_processor_count": 132, "max_threads_per_multi_processor": 2048})
    assert summary["configs_benchmarked"] == 3 and summary["sum_autotune_reserved_jumps"] == 256 << 20
    assert summary["sum_load_outside_jumps"] == 3 * MODULE_BYTES
    assert summary["local_memory_for_end_stack"] == (1024 + 3 * STACK_STEP) * 132 * 2048


def test_a_missing_hook_point_is_reported_and_the_rest_hooked():
    class OldJIT:
        def run(self, *args, grid, warmup, **kwargs):
            return None

    h = tcm.Hooks(FakeProbe())
    status = h.install(OldJIT, None, FakeAutotuner)
    h.uninstall()
    assert status == {"OldJIT.run": "hooked", "OldJIT._do_compile": "missing", "None._init_handles": "missing",
                      "FakeAutotuner.run": "hooked", "FakeAutotuner._bench": "hooked"}


def test_the_installed_triton_has_every_hook_point():
    pytest.importorskip("triton")
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    h = tcm.Hooks(FakeProbe())
    assert set(h.install(JITFunction, CompiledKernel, Autotuner).values()) == {"hooked"}
    assert JITFunction.run is not run
    h.uninstall()
    assert JITFunction.run is run


def test_summary_ranks_kernels_by_their_jump_outside_the_allocator():
    def snap(phase, device, reserved, stack):
        return {"phase": phase, "device": device, "reserved": reserved, "outside": device - reserved, "stack": stack}

    timeline = [snap("cuda init", 500, 0, 1024), snap("step 1 start", 4000, 3000, 1024),
                snap("step 1 end", 7500, 3200, 4096), snap("end", 7600, 3200, 4096)]
    kernels = [{"name": f"k{i}", "jump": {"outside": i * 10}, "n_spills": i % 2, "local_bytes": i} for i in range(15)]
    kernels.append({"name": "failed", "jump": {"outside": None}})
    s = tcm.summarize(timeline, kernels, [], {"multi_processor_count": None})
    assert s["outside_growth_first_step"] == 4300 - 1000 and s["outside_growth_whole_run"] == 4400 - 500
    assert [j["name"] for j in s["largest_jumps"]] == [f"k{i}" for i in range(14, 4, -1)]
    assert s["sum_kernel_outside_jumps"] == sum(i * 10 for i in range(15)) and s["kernels_spilling"] == 7
    assert s["stack_limit"] == {"start": 1024, "end": 4096} and s["local_memory_for_end_stack"] is None
    assert s["max_local_bytes_per_thread"] == 14


def test_deltas_leave_a_figure_unknown_where_a_snapshot_lacks_it():
    assert tcm.deltas({"device": 5, "stack": None}, {"device": 9, "stack": 4, "error": "x"}) == {
        "device": 4, "reserved": None, "outside": None, "stack": None, "card_used": None}


def test_arguments_and_the_cache_folder(tmp_path):
    args = tcm.parse_args(["--out", "r.json"])
    assert (args.triton_cache, args.case, args.steps) == (None, tcm.DEFAULT_CASE, 2)
    assert (ROOT / tcm.DEFAULT_CASE).is_file()
    with pytest.raises(SystemExit) as exc:
        tcm.parse_args(["--out", "r.json", "--steps", "0"])
    assert exc.value.code == 2
    fresh, files = tcm.prepare_cache(None)
    assert files == 0 and fresh.is_dir() and not any(fresh.iterdir())
    fresh.rmdir()
    (tmp_path / "c" / "ab").mkdir(parents=True)
    (tmp_path / "c" / "ab" / "k.cubin").write_bytes(b"x")
    assert tcm.prepare_cache(str(tmp_path / "c")) == ((tmp_path / "c").resolve(), 1)


def test_bad_cases_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # main sets it; restored after the test
    out = tmp_path / "r.json"
    assert tcm.main(["--out", str(out), "--case", str(tmp_path / "nope.yaml"), "--triton-cache", str(tmp_path)]) == 2
    assert "no such file" in capsys.readouterr().err
    two = CASES_DIR / "004-gla-failing-bs4-2procs.yaml"
    assert tcm.main(["--out", str(out), "--case", str(two), "--triton-cache", str(tmp_path)]) == 2
    assert "launch.procs_per_card 2" in capsys.readouterr().err
    assert not out.exists()


def test_a_failed_run_still_writes_what_it_measured(tmp_path):
    """In a process of its own: main sets the case's environment and stubs bitsandbytes out, as the worker does."""
    out, cache = tmp_path / "sub" / "r.json", tmp_path / "cache"
    code = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from benchmarks import triton_cold_memory as tcm
        torch.cuda.is_available = lambda: True
        def measure(case, shape, result):
            result["timeline"].append({{"phase": "cuda init", "outside": 1}})
            raise RuntimeError("CUDA error: an illegal memory access")
        tcm.measure = measure
        sys.exit(tcm.main(["--out", {str(out)!r}, "--triton-cache", {str(cache)!r}, "--steps", "3"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(out.read_text())
    assert "illegal memory access" in data["error"] and data["timeline"] == [{"phase": "cuda init", "outside": 1}]
    assert data["case"] == "004-gla-plan-c-1proc" and data["steps"] == 3 and data["cache"] == "cold"
    assert data["triton_cache"] == str(cache.resolve()) and data["env"]["TRITON_CACHE_DIR"] == str(cache.resolve())
    assert data["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert not out.with_name("r.json.tmp").exists()
