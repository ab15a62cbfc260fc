"""The worker: one training process of one case. It builds, trains, measures and writes JSON.

It runs the phases in order, each in a module of its own: load (`runtime.build`: the model as the
case's stack builds it), engine (`runtime.engine`), step (`runtime.train`, over `runtime.data`'s
synthetic batches), probe (`runtime.probe`), all measured by `runtime.measurement`. This module
holds the order, the report and what a failure in any phase becomes.

Run by the launcher, never in the test process (one fresh process per case run):

    python -m harness.runtime.worker --case cases/003-....yaml --fidelity tiny --out-dir DIR

Each rank writes DIR/rank<R>[-slot<S>].json (a `RankReport`), also when it fails: an OOM is
recorded with its numbers and the phase it happened in, and the exit code says what happened
(0 ok, 3 out of memory, 1 any other error, 5 the report could not be written: a full disk or an
unwritable folder).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from harness.runtime.reports import EXIT_NO_REPORT, write_report

EXIT_OK, EXIT_ERROR, EXIT_OOM = 0, 1, 3
def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers", "peft", "deepspeed", "bitsandbytes", "flash-linear-attention",
                 "accelerate", "llamafactory", "liger-kernel", "trl"):
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


def run(args) -> int:
    import torch

    from harness.measure.clocks import host_cpu
    from harness.measure.records import ErrorInfo, Failure, RankReport, Zero, short_of
    from harness.runtime import compile_cache
    from harness.runtime.build import build_model, prepare_checkpoint
    from harness.runtime.data import examples, loader
    from harness.runtime.engine import start_engine
    from harness.runtime.measurement import Measurement, local_bytes, offload, weights
    from harness.runtime.platform import Platform, detect, dist_backend, parse_oom
    from harness.runtime.probe import card_to_itself, run_probes
    from harness.runtime.stacks import through_trainer
    from harness.runtime.train import train_steps
    from harness.runtime.turns import Turns
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
    turns = None
    out_path = Path(args.out_dir) / (f"rank{rank}" + (f"-slot{args.slot}" if args.slot else "") + ".json")
    t_start = time.perf_counter()

    def progress(what: str) -> None:  # to the case's log.txt, so a slow or hung run shows where it is
        _stop_if_asked()
        print(f"[harness.runtime.worker] {case.id} rank {rank} slot {args.slot}: {what} "
              f"({time.perf_counter() - t_start:.1f} s)", file=sys.stderr, flush=True)

    phase = "setup"
    code = EXIT_OK
    cache_entries = compile_cache.entries(compile_cache.triton_cache_dir())
    meas = Measurement(device, args.emulate_card_bytes)
    from harness.runtime.memory_history import History, wanted

    history = History(wanted(platform != Platform.cpu, rank), device, Path(args.out_dir), dict(
        case_id=case.id, variant=args.variant, fidelity=args.fidelity, platform=platform.value,
        device_name=device_name, rank=rank, world_size=world, versions=report.versions,
        emulated_card_bytes=args.emulate_card_bytes))
    report.card_free_at_start = meas.card_free_at_start
    if short_of(meas.card_free_at_start, args.emulate_card_bytes):
        progress(f"the card has {meas.card_free_at_start / 2**30:.2f} GiB free at the start, less than the emulated "
                 f"{args.emulate_card_bytes / 2**30:.2f} GiB card: another process holds memory on it")
    try:
        with meas:
            turns = Turns.from_env(rank, args.slot, shape.ranks * case.launch.procs_per_card)
            engine = None
            ds_config = deepspeed_config(
                case, world, shape.grad_accum, shape.hidden_size, platform == Platform.cpu, shape.ds_size_scale
            )
            if ds_config is not None:
                import deepspeed

                deepspeed.init_distributed(dist_backend=dist_backend(platform), verbose=False)
            history.start()
            layers = case.layers if args.fidelity == "real" else None
            job = None
            if through_trainer(case):  # the framework's own parsing, loader and trainer
                from harness.runtime.stacks.callback import MeasuringCallback
                from harness.runtime.stacks.job import prepare as prepare_stack_job

                job = prepare_stack_job(case, args.fidelity, shape, device, layers, Path(args.out_dir), rank,
                                        ds_config)
                report.stack = job.record
                phase = "load"
                meas.reset()
                built = job.load()
            else:
                checkpoint = prepare_checkpoint(case, args.fidelity, device, shape.seq_len, layers)
                phase = "load"
                meas.reset()
                built = build_model(case, args.fidelity, device, ds_config, shape.seq_len, layers, checkpoint)
            model = built.model
            report.model_config_used = built.config_dict
            report.attn_implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
            report.context_bytes = meas.context_bytes
            meas.sync()
            meas.check_cpu_limit()
            report.load = meas.figures()
            params_before_engine = sum(local_bytes(p) for p in model.parameters())

            progress(f"loaded, {report.load.allocated / 2**30:.2f} GiB peak allocated")
            phase = "engine"
            history.phase("engine")
            vocab = int(built.config_dict["vocab_size"])
            if job is not None:  # the trainer builds its engine, then the callback starts the step phase
                job.train(examples(shape, vocab),
                          MeasuringCallback(meas, report, progress, history, shape.steps, turns))
                phase = "step"
                if not job.checkpointing_as_asked():
                    raise RuntimeError(f"{case.id}: activation checkpointing is not as the case asks "
                                       f"({'on' if case.train.gradient_checkpointing else 'off'}) in the model "
                                       f"{job.record.name} trained")
                model, engine = job.model, job.engine
                runner = engine if engine is not None else model
            else:
                trainer = start_engine(case, model, ds_config)
                engine, runner = trainer.engine, trainer.runner
                meas.check_cpu_limit()

                progress("engine ready")
                phase = "step"
                batches = iter(loader(case, shape, vocab, platform == Platform.cpu, shape.steps * shape.grad_accum))
                meas.sync()
                meas.reset()
                train_steps(trainer, shape, batches, device, meas, report, progress, history, turns)
            report.step = meas.figures()
            if turns is not None:  # the last gate: no probe runs while the other arm of a compare trains
                turns.before_step(len(report.step_times_s))
            history.finish()  # before the probes, whose allocations are not the step's
            report.clocks = meas.sampler.clocks()
            report.weights = weights(model)
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
                    report.offload = offload(engine, platform == Platform.cpu)

            phase = "probe"
            meas.lift_cap()
            progress("probes")
            probe_batch = next(iter(loader(case, shape, vocab, True, 1))).to(device)
            with card_to_itself(Path(args.out_dir), local_rank, engine is None and case.launch.procs_per_card > 1):
                report.probes = run_probes(case, runner, engine, probe_batch, meas)
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
        if history.finish() is not None:  # at an OOM too: the timeline up to it is the most telling part
            report.memory_timeline = history.path.name
        used_triton = platform != Platform.cpu and compile_cache.uses_triton_kernels()
        report.triton_cache = compile_cache.state(
            cache_entries, compile_cache.entries(compile_cache.triton_cache_dir()) if used_triton else 0, used_triton)
        if not write_report(report, out_path):
            code = EXIT_NO_REPORT
    if report.error is not None:
        print(f"[harness.runtime.worker] {case.id} rank {rank}: {report.error.kind.value} in {phase}: "
              f"{report.error.message.splitlines()[-1] if report.error.message else ''}", file=sys.stderr)
    return code


class Stopped(BaseException):
    """SIGTERM, as an exception: a BaseException, so no library's `except Exception` swallows it."""


_stopped_by: int | None = None  # the signal that asked this worker to stop


def _stop(signum, frame):
    global _stopped_by
    _stopped_by = signum
    _stop_if_asked()


def _stop_if_asked() -> None:
    """Raise `Stopped` once a stop was asked for. The handler raises it at once; where that lands in
    a finalizer (a garbage collection during the step), Python prints it and swallows it, so
    every progress line asks again."""
    if _stopped_by is not None:
        raise Stopped(f"stopped by {signal.Signals(_stopped_by).name}: a launcher stops every rank once one has "
                      "failed")


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
    # torchrun and DeepSpeed's launcher stop every rank with SIGTERM once one has failed: the
    # survivors still write what they measured, and say why they stopped
    signal.signal(signal.SIGTERM, _stop)
    # every thread's stack into the rank's stack file shortly before the launcher's deadline
    # (harness.runtime.process_tree)
    from harness.runtime.process_tree import arm_stack_dump, exit_with_owner

    arm_stack_dump(Path(args.out_dir), int(os.environ.get("RANK", "0")), args.slot)
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
