"""The worker: one training process of one case. It builds, trains, measures and writes JSON.

Run by the launcher, never in the test process (one fresh process per case run):

    python -m harness.runtime.worker --case cases/003-....yaml --fidelity tiny --out-dir DIR

Each rank writes DIR/rank<R>[-slot<S>].json (a `RankReport`), also when it fails: an OOM is
recorded with its numbers and the phase it happened in, and the exit code says what happened
(0 ok, 3 out of memory, 1 any other error).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_OOM = 0, 1, 3


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "deepspeed", "bitsandbytes", "flash-linear-attention", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    import torch

    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    if torch.version.hip:
        out["hip"] = torch.version.hip
    if torch.cuda.is_available() and not torch.version.hip:
        try:
            import pynvml

            pynvml.nvmlInit()
            out["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # nvidia-ml-py missing: the driver stays unrecorded
            pass
    return out


class CardLimitExceeded(Exception):
    pass


class Measurement:
    """The phase-by-phase figures of one process, on whichever platform it runs."""

    def __init__(self, device, emulated_card_bytes: int | None):
        import torch

        from harness.measure.trackers import (
            AcceleratorTracker,
            LiveTensorTracker,
            Sampler,
            clock_reader,
            device_memory_reader,
        )

        self.device = device
        self.on_cpu = device.type == "cpu"
        self.limit = emulated_card_bytes
        self.context_bytes = None
        reader = device_memory_reader(device)
        if self.on_cpu:
            self.alloc = LiveTensorTracker()
        else:
            self.alloc = AcceleratorTracker(device)
            torch.zeros(1, device=device)  # create the context, so its size can be read
            if reader is not None and reader.per_process:
                self.context_bytes = max(0, (reader.read() or 0) - torch.cuda.memory_reserved(device))
            if emulated_card_bytes:
                # A smaller card on a bigger one: the allocator may use what the card has left
                # after this process's context (which the real card holds too).
                total = torch.cuda.get_device_properties(device).total_memory
                usable = emulated_card_bytes - (self.context_bytes or 0)
                torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, usable / total)), device)
        self.sampler = Sampler(reader, clock_reader=clock_reader(device))

    def __enter__(self):
        self.sampler.__enter__()
        if self.on_cpu:
            self.alloc.__enter__()
        return self

    def __exit__(self, *exc):
        if self.on_cpu:
            self.alloc.__exit__(*exc)
        self.sampler.__exit__(*exc)
        return False

    def check_cpu_limit(self):
        """On a CPU, an emulated card limit turns into the same kind of error a GPU raises."""
        if self.on_cpu and self.limit and self.alloc.peak_bytes() > self.limit:
            import torch

            raise torch.OutOfMemoryError(
                f"CPU out of memory (emulated card). Tried to allocate {self.alloc.peak_bytes() - self.limit} B "
                f"above the emulated card of {self.limit} B"
            )

    def reset(self):
        self.alloc.reset_peak()
        self.sampler.reset()

    def figures(self):
        from harness.measure.records import Memory

        self.sampler.sample()
        reserved = None if self.on_cpu else self.alloc.peak_reserved()
        device = self.sampler.device_peak
        if device is not None and reserved is not None and self.context_bytes is not None:
            # NVML is sampled every 20 ms and can miss a short spike; the process held at least
            # its reserved peak plus its context at that moment.
            device = max(device, reserved + self.context_bytes)
        return Memory(
            allocated=self.alloc.peak_bytes(),
            reserved=reserved,
            device=device,
            host_rss=self.sampler.host_peak,
            host_anon=self.sampler.host_anon_peak,
            resident=self.alloc.current(),
        )

    def lift_cap(self):
        """Probes measure byte deltas of ablations (checkpointing off, all logits), which may not
        fit the emulated card; they run without its cap."""
        if not self.on_cpu and self.limit:
            import torch

            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        self.limit = None

    def current(self) -> int:
        return self.alloc.current()

    def sync(self):
        if not self.on_cpu:
            import torch

            torch.cuda.synchronize(self.device)


def _logical_numel(p) -> int:
    if hasattr(p, "ds_numel"):
        return int(p.ds_numel)
    qs = getattr(p, "quant_state", None)
    if qs is not None and getattr(qs, "shape", None) is not None:
        import math

        return math.prod(qs.shape)
    return p.numel()


def _local_bytes(p) -> int:
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel() * p.ds_tensor.element_size()
    return p.numel() * p.element_size()


def _weights(model):
    from harness.measure.records import Weights

    params = list(model.parameters())
    q_bytes = q_bf16 = 0
    found_q = False
    bnb = sys.modules.get("bitsandbytes")  # loaded by the QLoRA path only
    if bnb is not None:
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                found_q = True
                w = module.weight
                q_bytes += w.numel() * w.element_size()
                qs = getattr(w, "quant_state", None)
                if qs is not None:
                    for t in (qs.absmax, getattr(qs, "code", None)):
                        if t is not None:
                            q_bytes += t.numel() * t.element_size()
                    nested = getattr(qs, "state2", None)
                    if nested is not None:
                        q_bytes += nested.absmax.numel() * nested.absmax.element_size()
                q_bf16 += _logical_numel(w) * 2
    return Weights(
        params_total=sum(_logical_numel(p) for p in params),
        params_trainable=sum(_logical_numel(p) for p in params if p.requires_grad),
        param_bytes_local=sum(_local_bytes(p) for p in params),
        quantized_linear_bytes=q_bytes if found_q else None,
        quantized_linear_bf16_bytes=q_bf16 if found_q else None,
    )


def _offload(engine, on_cpu: bool):
    from harness.measure.records import Offload

    zero_opt = engine.optimizer
    inner = getattr(zero_opt, "optimizer", zero_opt)
    offloaded = bool(getattr(zero_opt, "cpu_offload", False) or getattr(zero_opt, "offload_optimizer", False))
    tensors = []
    for state in inner.state.values():
        tensors += [t for t in state.values() if hasattr(t, "numel") and t.dim() > 0]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        tensors += list(getattr(zero_opt, name, []) or [])
    device_bytes = host_bytes = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        # On a GPU the tensor's device says where it lives. On a CPU the accelerator *is* the
        # host, so the placement DeepSpeed chose (its offload flag) is what we can report.
        on_host = (t.device.type == "cpu") if not on_cpu else offloaded
        if on_host:
            host_bytes += nbytes
        else:
            device_bytes += nbytes
    return Offload(optimizer_class=type(inner).__name__, device_state_bytes=device_bytes, host_state_bytes=host_bytes)


class SyntheticTokens:
    """A map-style dataset of fixed random token sequences (labels = inputs). A few distinct
    sequences, cycled, so a tiny model's loss visibly falls within a few steps."""

    def __init__(self, vocab: int, seq_len: int, distinct: int, length: int, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (distinct, seq_len), generator=g)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.data[i % len(self.data)]


def _loader(case, shape, vocab, on_cpu, micro_steps):
    import torch
    from torch.utils.data import DataLoader

    ds = SyntheticTokens(vocab, shape.seq_len, distinct=shape.micro_batch * 2, length=shape.micro_batch * micro_steps)
    kwargs = {}
    if case.train.dataloader_workers > 0:
        kwargs["prefetch_factor"] = case.train.prefetch_factor or 2
        kwargs["persistent_workers"] = False
    return DataLoader(
        ds,
        batch_size=shape.micro_batch,
        num_workers=case.train.dataloader_workers,
        pin_memory=case.train.pin_memory and not on_cpu and torch.cuda.is_available(),
        **kwargs,
    )


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
def _card_to_itself(out_dir: Path, local_rank: int, shared: bool):
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


def _run_probes(case, runner, engine, batch, meas):
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


def run(args) -> int:
    import torch

    from harness.measure.clocks import host_cpu
    from harness.measure.records import ErrorInfo, Failure, RankReport, Zero
    from harness.runtime import compile_cache
    from harness.runtime.build import build_model, prepare_checkpoint
    from harness.runtime.platform import Platform, detect, dist_backend, parse_oom
    from harness.spec.cases import load_case
    from harness.spec.dsconfig import deepspeed_config
    from harness.spec.shape import run_shape
    from harness.spec.variants import parse_variant

    case = parse_variant(args.variant).apply(load_case(args.case))
    shape = run_shape(case, args.fidelity, args.steps)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    platform = detect()
    if platform == Platform.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    device_name = "cpu" if platform == Platform.cpu else torch.cuda.get_device_name(device)

    report = RankReport(
        case_id=case.id,
        fidelity=args.fidelity,
        rank=rank,
        world_size=world,
        process_slot=args.slot,
        platform=platform.value,
        device_name=device_name,
        emulated_card_bytes=args.emulate_card_bytes,
        seq_len=shape.seq_len,
        micro_batch=shape.micro_batch,
        grad_accum=shape.grad_accum,
        tokens_per_step=shape.tokens_per_step,
        versions=_versions(),
        cpu_threads=torch.get_num_threads(),
        host_cpu=host_cpu(),
    )
    out_path = Path(args.out_dir) / (f"rank{rank}" + (f"-slot{args.slot}" if args.slot else "") + ".json")
    t_start = time.perf_counter()

    def progress(what: str) -> None:  # to the case's log.txt, so a slow or hung run shows where it is
        print(f"[harness.runtime.worker] {case.id} rank {rank} slot {args.slot}: {what} "
              f"({time.perf_counter() - t_start:.1f} s)", file=sys.stderr, flush=True)

    phase = "setup"
    code = EXIT_OK
    cache_entries = compile_cache.entries(compile_cache.triton_cache_dir())
    meas = Measurement(device, args.emulate_card_bytes)
    try:
        with meas:
            engine = None
            ds_config = deepspeed_config(
                case, world, shape.grad_accum, shape.hidden_size, platform == Platform.cpu, shape.ds_size_scale
            )
            if ds_config is not None:
                import deepspeed

                deepspeed.init_distributed(dist_backend=dist_backend(platform), verbose=False)
            layers = case.layers if args.fidelity == "real" else None
            checkpoint = prepare_checkpoint(case, args.fidelity, device, shape.seq_len, layers)
            phase = "load"
            meas.reset()
            built = build_model(case, args.fidelity, device, ds_config, shape.seq_len, layers, checkpoint)
            model = built.model
            report.model_config_used = built.config_dict
            report.context_bytes = meas.context_bytes
            meas.sync()
            meas.check_cpu_limit()
            report.load = meas.figures()
            params_before_engine = sum(_local_bytes(p) for p in model.parameters())

            progress(f"loaded, {report.load.allocated / 2**30:.2f} GiB peak allocated")
            phase = "engine"
            if ds_config is not None:
                import deepspeed

                trainable = [p for p in model.parameters() if p.requires_grad]
                engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=trainable,
                                                               config=ds_config)
                runner = engine
            else:
                optimizer = torch.optim.AdamW(
                    [p for p in model.parameters() if p.requires_grad], lr=case.train.learning_rate
                )
                runner = model
            meas.check_cpu_limit()

            progress("engine ready")
            phase = "step"
            vocab = int(built.config_dict["vocab_size"])
            loader = _loader(case, shape, vocab, platform == Platform.cpu, shape.steps * shape.grad_accum)
            batches = iter(loader)
            meas.sync()
            meas.reset()
            for _ in range(shape.steps):
                meas.sync()
                t0 = time.perf_counter()
                losses = []
                for _micro in range(shape.grad_accum):
                    batch = next(batches).to(device, non_blocking=True)
                    out = runner(input_ids=batch, labels=batch)
                    loss = out.loss
                    if engine is not None:
                        engine.backward(loss)
                        engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
                    else:
                        (loss / shape.grad_accum).backward()
                    losses.append(float(loss.detach()))
                    del out, loss
                    meas.check_cpu_limit()
                if engine is None:
                    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                meas.sync()
                report.step_times_s.append(time.perf_counter() - t0)
                report.losses.append(statistics.fmean(losses))
                progress(f"step {len(report.step_times_s)}/{shape.steps} in {report.step_times_s[-1]:.2f} s")
                if len(report.step_times_s) == report.warmup_steps:
                    meas.sampler.reset_clocks()  # the clock of the timed steps, not of the warm-up's compilation
            report.step = meas.figures()
            report.clocks = meas.sampler.clocks()
            report.weights = _weights(model)
            from harness.measure.flops import flops_per_token, linear_weight_count

            report.flops_per_token = flops_per_token(
                linear_weight_count(model, built.config_dict), built.config_dict, shape.seq_len,
                case.method.kind == "full"
            )
            if engine is not None:
                ds = case.deepspeed
                report.zero = Zero(
                    stage=ds.stage,
                    zero_init=built.zero_init,
                    local_param_numel=sum(
                        (p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()) for p in model.parameters()
                    ),
                    total_param_numel=report.weights.params_total,
                    materialised_param_bytes_before_engine=params_before_engine,
                )
                if ds.stage > 0:  # ZeRO partitions optimizer state from stage 1 on
                    report.offload = _offload(engine, platform == Platform.cpu)

            phase = "probe"
            meas.lift_cap()
            progress("probes")
            probe_batch = next(iter(_loader(case, shape, vocab, True, 1))).to(device)
            with _card_to_itself(Path(args.out_dir), local_rank, engine is None and case.launch.procs_per_card > 1):
                report.probes = _run_probes(case, runner, engine, probe_batch, meas)
    except BaseException as exc:  # every failure becomes a report, then an exit code
        text = f"{type(exc).__name__}: {exc}"
        oom = parse_oom(text)
        if isinstance(exc, torch.OutOfMemoryError) or oom is not None:
            report.error = ErrorInfo(
                kind=Failure.oom, message=(oom.message if oom else text)[:2000],
                tried_to_allocate=oom.tried_to_allocate if oom else None, phase=phase,
            )
            code = EXIT_OOM
        else:
            tb = "".join(traceback.format_exception(exc))[-4000:]
            report.error = ErrorInfo(kind=Failure.crash, message=tb, phase=phase)
            code = EXIT_ERROR
        try:
            report.step = report.step or meas.figures()
        except Exception:  # measuring after a CUDA error can fail too; keep what we have
            pass
    finally:
        report.triton_cache = compile_cache.state(cache_entries,
                                                  platform != Platform.cpu and compile_cache.uses_triton_kernels())
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(report.model_dump_json(indent=1))
        tmp.replace(out_path)
    if code != EXIT_OK:
        print(f"[harness.runtime.worker] {case.id} rank {rank}: {report.error.kind.value} in {phase}: "
              f"{report.error.message.splitlines()[-1] if report.error.message else ''}", file=sys.stderr)
    return code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True)
    parser.add_argument("--fidelity", choices=["tiny", "real"], default="tiny")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--variant", default="",
                        help="measure with fewer ranks/layers/accumulation (harness.spec.variants)")
    parser.add_argument("--slot", type=int, default=0, help="index of this job among jobs sharing one card")
    parser.add_argument("--emulate-card-bytes", type=int, default=None)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by DeepSpeed's launcher; LOCAL_RANK in the environment is used otherwise")
    args = parser.parse_args(argv)
    # every thread's stack into the log shortly before the launcher's deadline (harness.runtime.process_tree)
    from harness.runtime.process_tree import STACK_DUMP_ENV, exit_with_owner

    if os.environ.get(STACK_DUMP_ENV):
        faulthandler.dump_traceback_later(float(os.environ[STACK_DUMP_ENV]), exit=False)
    exit_with_owner()  # a harness stopped without cleaning up leaves no worker on the card
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    from harness.spec.cases import load_case

    if load_case(args.case).method.kind != "qlora":
        # A case that does not quantize never loads bitsandbytes: peft and transformers import it
        # whenever it is installed, and its import pulls in torch's compiler stack (~2 s of CPU per
        # process, most of a tiny run). A None entry makes importlib report it as not installed.
        sys.modules.setdefault("bitsandbytes", None)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
