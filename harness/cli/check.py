"""`oom-harness check`: does a training config fit its cards? Predicted on a CPU, with lints.

    oom-harness check llamafactory.yaml --gpu-memory 64GiB --gpus 8
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.cli.arguments import fraction, memory_size, positive_int
from harness.models.inputs import InputError
from harness.predict.explain import explain_dict, explain_lines
from harness.premerge.check import EXIT_BAD_INPUT, PredictFn, as_json, run_check, table
from harness.premerge.importers import LAUNCHERS, TRITON_CACHES, ConfigError, JobSpec, parse_size_arg
from harness.spec.schema import Stack


def add_parser(subparsers) -> None:
    chk = subparsers.add_parser(
        "check", help="pre-merge: predict whether a training config fits its cards, and lint it")
    add_arguments(chk)
    chk.set_defaults(func=run)


def add_arguments(parser) -> None:
    """The check's options (also read by `pytest -m premerge`'s premerge.yaml)."""
    add_job_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--explain", action="store_true",
                        help="also print how the prediction was made: the dispatch table's row the config took, "
                             "the method that sized each part of the peak and each stage's figures "
                             "(docs/predictor.md, \"How it works\")")


def add_job_arguments(parser) -> None:
    """A training config and the job it runs as: what `check` and `case-from` both read (`spec_from_args`)."""
    parser.add_argument("config", help="LLaMA-Factory YAML, TrainingArguments JSON or harness case YAML")
    parser.add_argument("--deepspeed", help="DeepSpeed JSON (replaces the config's own `deepspeed`)")
    parser.add_argument("--gpu-memory", type=memory_size,
                        help="memory per GPU with a unit, e.g. 64GiB, 80GB (case files: optional)")
    parser.add_argument("--gpus", type=positive_int, help="GPUs of the job (case files: optional)")
    parser.add_argument("--procs-per-gpu", type=positive_int,
                        help="independent training processes sharing each GPU (default 1)")
    parser.add_argument("--headroom", type=fraction, help="fraction of a card a job may use (default 0.9)")
    parser.add_argument("--host-ram", type=memory_size,
                        help="host memory per node with a unit, for the pinned-offload lint")
    parser.add_argument("--vendor", choices=["nvidia", "hygon", "amd"], help="card vendor (default nvidia)")
    parser.add_argument("--launcher", choices=list(LAUNCHERS),
                        help="how the job is started (default: llamafactory-cli for LLaMA-Factory YAML, else torchrun "
                             "on several GPUs, python on one)")
    parser.add_argument("--model", help="registry name, hub id or local directory with a config.json "
                                        "(replaces model_name_or_path)")
    parser.add_argument("--stack", choices=[s.value for s in Stack], help="the training stack (see README)")
    parser.add_argument("--script", help="the training script, scanned for building the model before DeepSpeed")
    parser.add_argument("--platform", help="calibrate the prediction on this platform's baselines (e.g. "
                                           "nvidia-h200-x1); its card also sizes a cold Triton cache's local memory")
    parser.add_argument("--triton-cache", choices=list(TRITON_CACHES),
                        help="Triton kernels (flash-linear-attention models) compiled at the start (cold: a job's "
                             "first launch on a host, the default for a training config) or loaded (warm)")


def spec_from_args(args) -> JobSpec:
    return JobSpec(
        gpus=args.gpus,
        gpu_memory=None if args.gpu_memory is None else parse_size_arg(args.gpu_memory, "--gpu-memory"),
        procs_per_gpu=args.procs_per_gpu,
        headroom=args.headroom,
        host_ram=None if args.host_ram is None else parse_size_arg(args.host_ram, "--host-ram"),
        vendor=args.vendor,
        launcher=args.launcher,
        model=args.model,
        deepspeed=None if args.deepspeed is None else Path(args.deepspeed),
        stack=args.stack,
        script=None if args.script is None else Path(args.script),
        triton_cache=args.triton_cache,
    )


def run(args, predict: PredictFn | None = None) -> int:
    """`oom-harness check`: print the table (or JSON); return the exit code."""
    try:
        result = run_check(args.config, spec_from_args(args), platform=args.platform, predict=predict)
    except ConfigError as exc:
        _bad_input(str(exc), args.json)
        return EXIT_BAD_INPUT
    except InputError as exc:  # a value the prediction refuses (launch.env's PYTORCH_CUDA_ALLOC_CONF): name the file
        if exc.path is None:
            exc.path = Path(args.config)
        _bad_input(str(exc), args.json)
        return EXIT_BAD_INPUT
    explain = getattr(args, "explain", False) and result.prediction is not None
    if args.json:
        out = as_json(result)
        if explain:
            out["explain"] = explain_dict(result.prediction)
        print(json.dumps(out, indent=1))
    else:
        print(table(result))
        if explain:
            print("\n" + "\n".join(explain_lines(result.prediction)))
    return result.exit_code


def _bad_input(message: str, as_json_output: bool) -> None:
    if as_json_output:
        print(json.dumps({"error": message}))
    print(f"oom-harness check: {message}", file=sys.stderr)
