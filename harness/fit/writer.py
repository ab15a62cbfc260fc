"""The chosen config written in the input's own format, and every change it makes, key by key.

A LLaMA-Factory YAML and the DeepSpeed JSON it names, or a TrainingArguments JSON (with its DeepSpeed
JSON, or one inlined): the user's files are read again, only the keys a knob changes are set, and the
results are written into the output folder (harness.spec.outputs: refused outside it, never over an
input, never over an existing file without --force, taken back when fit fails). A one-GPU job given ZeRO
offload it did not have gets a DeepSpeed JSON of its own beside the config (`harness.fit.zero_offload`),
named by the config's `deepspeed` key.
The allocator's setting, which no config file holds, goes into `launch.sh` beside them, with the launcher
DeepSpeed needs on one GPU (a one-rank torchrun: LLaMA-Factory's FORCE_TORCHRUN).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness.fit.knobs import LEAN_BUCKETS, STAGE3_ONLY, Knobs
from harness.fit.zero_offload import offload_config, trainer_script, why_not
from harness.premerge.importers import ConfigFormat, ImportedConfig, read_mapping
from harness.spec.files import control_character, inside, printable
from harness.spec.outputs import Outputs

ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_VALUE = "expandable_segments:True"
_SEQ_KEYS = ("max_length", "max_seq_length", "model_max_length")


@dataclass(frozen=True)
class Change:
    key: str  # as the input spells it: 'per_device_train_batch_size', 'ds_z3.json: zero_optimization.stage'
    old: Any
    new: Any
    why: str

    def as_list(self) -> list:
        return [self.key, self.old, self.new, self.why]


@dataclass(frozen=True)
class Written:
    files: tuple[Path, ...]
    config: Path  # the training config to run
    deepspeed: Path | None  # its DeepSpeed JSON, where one was written
    changes: tuple[Change, ...]
    # an earlier fit's file in the folder that this answer has no place for (replaced under --force)
    removed: tuple[Path, ...] = ()


class OverwriteError(ValueError):
    """An input `fit` cannot write a fitted config for: a name holding a control character, or a config
    naming itself as its DeepSpeed JSON."""


def _why(field: str, k0: Knobs, k: Knobs) -> str:
    return {
        "micro_batch": f"micro-batch {k0.micro_batch} -> {k.micro_batch}, gradient accumulation "
                       f"{k0.grad_accum} -> {k.grad_accum}: the same global batch",
        "checkpointing": "recompute activations in backward instead of keeping them" if k.checkpointing
        else "keep activations: no recomputation, faster, and it fits",
        "reentrant": ("non-reentrant checkpointing releases ZeRO-3's gathered frozen weights (guide 000, measured)"
                      if k.stage == 3 else "non-reentrant checkpointing (torch's recommended mode)")
        if not k.reentrant else "reentrant checkpointing",
        "stage": f"ZeRO stage {k0.stage} -> {k.stage}",
        "offload_optimizer": "optimizer state in host memory" if k.offload_optimizer
        else "optimizer state on the card: no CPU Adam, no copies",
        "offload_param": "parameters in host memory" if k.offload_param
        else "parameters on the card: no host-device copies per pass",
        "pin_memory": "page-locked offload buffers: faster copies" if k.pin_memory
        else "pageable offload buffers: less host RAM (pinned ones round up to a power of two)",
        "lean_buckets": "smaller DeepSpeed buckets, prefetch and live set (guide 000's aggressive values)",
        "workers": f"fewer dataloader workers: {k.workers} (each holds host memory; jobs share the host)",
        "seq_len": f"shorter cutoff: {k.seq_len} tokens (allowed by --allow cutoff; longer samples are cut)",
        "lora_r": f"LoRA rank {k.lora_r}, alpha scaled alike (allowed by --allow rank)",
        "four_bit": "4-bit nf4 base weights (allowed by --allow quantization)",
        "liger": "Liger's kernels: the fused linear cross-entropy never builds the logits, and the step is faster"
        if k.liger else "without Liger's kernels",
    }[field]


def _changed(k0: Knobs, k: Knobs) -> list[str]:
    fields = ["micro_batch", "checkpointing", "reentrant", "stage", "offload_optimizer", "offload_param", "pin_memory",
              "lean_buckets", "workers", "seq_len", "lora_r", "four_bit", "liger"]
    out = [f for f in fields if getattr(k0, f) != getattr(k, f)]
    if "reentrant" in out and not k.checkpointing:
        out.remove("reentrant")
    if k.stage is None or not (k.offload_optimizer or k.offload_param):
        out = [f for f in out if f != "pin_memory"]
    return out


class _Editor:
    """Sets keys of one mapping and records each change."""

    def __init__(self, data: dict, prefix: str = ""):
        self.data, self.prefix, self.changes = data, prefix, []

    def set(self, key: str, value: Any, why: str, default: Any = None) -> None:
        *parents, leaf = key.split(".")
        node = self.data
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        old = node.get(leaf, default)
        if old != value:
            node[leaf] = value
            self.changes.append(Change(self.prefix + key, old, value, why))

    def drop(self, key: str, why: str) -> None:
        *parents, leaf = key.split(".")
        node = self.data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            self.changes.append(Change(self.prefix + key, node.pop(leaf), None, why))


def _edit_training(ed: _Editor, fmt: ConfigFormat, k0: Knobs, k: Knobs, fields: list[str], precision: str) -> None:
    data = ed.data
    if "micro_batch" in fields:
        why = _why("micro_batch", k0, k)
        ed.set("per_device_train_batch_size", k.micro_batch, why, 8)
        ed.set("gradient_accumulation_steps", k.grad_accum, why, 1)
    lf = fmt == ConfigFormat.llamafactory
    if "checkpointing" in fields:
        if lf:
            ed.set("disable_gradient_checkpointing", not k.checkpointing, _why("checkpointing", k0, k), False)
            if "gradient_checkpointing" in data:
                ed.set("gradient_checkpointing", k.checkpointing, _why("checkpointing", k0, k))
        else:
            ed.set("gradient_checkpointing", k.checkpointing, _why("checkpointing", k0, k), False)
    if k.checkpointing and ("reentrant" in fields or ("checkpointing" in fields and not lf)):
        if lf:
            ed.set("use_reentrant_gc", k.reentrant, _why("reentrant", k0, k), True)
        else:
            kwargs = data.get("gradient_checkpointing_kwargs")
            if isinstance(kwargs, str):
                kwargs = json.loads(kwargs) if kwargs.strip() else {}
            data["gradient_checkpointing_kwargs"] = dict(kwargs or {})
            ed.set("gradient_checkpointing_kwargs.use_reentrant", k.reentrant, _why("reentrant", k0, k))
    if "workers" in fields:
        ed.set("dataloader_num_workers", k.workers, _why("workers", k0, k), 0)
    if "liger" in fields:
        ed.set("enable_liger_kernel" if lf else "use_liger_kernel", k.liger, _why("liger", k0, k), False)
    if "seq_len" in fields:
        key = "cutoff_len" if lf else next((s for s in _SEQ_KEYS if s in data), "max_length")
        ed.set(key, k.seq_len, _why("seq_len", k0, k), 2048 if lf else None)
    if "lora_r" in fields:
        key = "lora_rank" if lf else next((s for s in ("lora_r", "lora_rank") if s in data), "lora_r")
        ed.set(key, k.lora_r, _why("lora_r", k0, k), 8)
        alpha = data.get("lora_alpha") or 2 * (k0.lora_r or 8)
        scaled = alpha * k.lora_r / k0.lora_r
        ed.set("lora_alpha", int(scaled) if float(scaled).is_integer() else scaled, _why("lora_r", k0, k), None)
    if "four_bit" in fields:
        why = _why("four_bit", k0, k)
        if lf:
            ed.set("quantization_bit", 4, why)
        else:
            ed.set("load_in_4bit", True, why, False)
            ed.set("bnb_4bit_quant_type", "nf4", why)
            ed.set("bnb_4bit_use_double_quant", True, why)
            ed.set("bnb_4bit_compute_dtype", {"fp16": "float16"}.get(precision, "bfloat16"), why)


def _edit_deepspeed(ed: _Editor, k0: Knobs, k: Knobs, fields: list[str]) -> None:
    z = "zero_optimization."
    if "stage" in fields:
        ed.set(z + "stage", k.stage, _why("stage", k0, k), 0)
        if k.stage != 3:
            for key in STAGE3_ONLY + tuple(s.removeprefix("stage3_") for s in STAGE3_ONLY):
                ed.drop(z + key, "a stage-3 setting; DeepSpeed ignores it at this stage")
    for block, on, name in (("offload_optimizer", k.offload_optimizer, "offload_optimizer"),
                            ("offload_param", k.offload_param, "offload_param")):
        if name in fields:
            if on:
                ed.set(f"{z}{block}.device", "cpu", _why(name, k0, k), "none")
            else:
                ed.drop(z + block, _why(name, k0, k))
        if on and ("pin_memory" in fields or name in fields):
            ed.set(f"{z}{block}.pin_memory", k.pin_memory, _why("pin_memory", k0, k), False)
    if "lean_buckets" in fields and k.lean_buckets:
        for key, value in LEAN_BUCKETS.items():
            if key in STAGE3_ONLY and k.stage != 3:
                continue
            if key == "allgather_bucket_size" and k.stage == 3:
                continue
            ed.set(z + key, value, _why("lean_buckets", k0, k))
    data = ed.data
    if "micro_batch" in fields:  # explicit batch figures must agree with the new split ("auto" stays auto)
        why = _why("micro_batch", k0, k)
        for key, value in (("train_micro_batch_size_per_gpu", k.micro_batch), ("gradient_accumulation_steps",
                                                                              k.grad_accum)):
            if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool):
                ed.set(key, value, why)


@dataclass(frozen=True)
class Plan:
    """The files `fit` writes for one input, named and checked before the search (harness.spec.outputs)."""

    folder: Path
    config: Path
    deepspeed: Path | None  # None where the config has none, or has it inline under `deepspeed`
    launch: Path
    added_deepspeed: Path | None = None  # where a job without DeepSpeed given ZeRO offload has its JSON written


def fit_inputs(imported: ImportedConfig, script: Path | None = None) -> list[Path]:
    """The files fit reads, never written over: the training config, its DeepSpeed JSON, the script."""
    return [*imported.sources, *([Path(script)] if script else [])]


def plan_outputs(imported: ImportedConfig, out_dir: Path, outputs: Outputs, script: Path | None = None) -> Plan:
    """Name fit's outputs in `out_dir` and check them (`Outputs.folder`, `Outputs.file`): refused before any
    work where an input's name holds a control character, an output is one of the inputs, is there without
    --force, or is not a regular file. A DeepSpeed JSON named as the training config (two `train.json`
    in two folders) is written as `<name>.deepspeed.fitted.json`, so no output takes another's name."""
    t, ds = imported.training, imported.deepspeed
    for path in fit_inputs(imported, script):
        bad = control_character(str(path))
        if bad:
            raise OverwriteError(f"{printable(str(path))}: the file name holds the control character {bad}, which "
                                 "would become a line of the written files. Fix: rename the file without control "
                                 "characters")
    if ds is not None and not ds.key_prefix and ds.path.resolve() == t.path.resolve():
        raise OverwriteError(f"{t.path}: deepspeed: names this config itself; fit writes the DeepSpeed settings as a "
                             "file of their own. Fix: name a DeepSpeed JSON of its own, or inline it under `deepspeed`")
    folder = outputs.folder(out_dir, "--out")

    def output(name: str, what: str) -> Path:
        path = outputs.file(folder / name, what)  # a link is refused as a link, before it is resolved
        inside(folder, name)  # OutsideFolderError: a name that leaves the folder
        return path

    config = output(f"{t.path.stem}.fitted{t.path.suffix}", "the fitted config")
    ds_path = None
    if ds is not None and not ds.key_prefix:
        name = f"{ds.path.stem}.fitted.json"
        if name == config.name:
            name = f"{ds.path.stem}.deepspeed.fitted.json"
        ds_path = output(name, "the fitted DeepSpeed JSON")
    launch = output("launch.sh", "launch.sh")
    added = None
    if ds is None and imported.case is not None and why_not(imported) is None:
        added = output(f"{t.path.stem}.ds_offload.fitted.json", "the DeepSpeed JSON of the ZeRO offload fit adds")
    return Plan(folder=folder, config=config, deepspeed=ds_path, launch=launch, added_deepspeed=added)


def write_fitted(imported: ImportedConfig, k0: Knobs, k: Knobs, out_dir: Path, *,
                 deepspeed_arg: Path | None, alloc_env: bool, outputs: Outputs | None = None,
                 force: bool = False) -> Written:
    """Write the config with knobs `k` into `out_dir`: the training config, its DeepSpeed JSON where it
    has one, and launch.sh. Returns the files and the changes. `outputs`: the command's outputs, where
    `plan_outputs` named them before the search; without it, they are named and checked here (`force`:
    replace existing files) and taken back if a write fails."""
    if outputs is None:
        with Outputs(force=force, inputs=fit_inputs(imported)) as own:
            return write_fitted(imported, k0, k, out_dir, deepspeed_arg=deepspeed_arg, alloc_env=alloc_env,
                                outputs=own)
    plan = plan_outputs(imported, out_dir, outputs)
    t = imported.training
    fmt = t.format
    fields = _changed(k0, k)
    data = read_mapping(t.path)
    ed = _Editor(data)
    _edit_training(ed, fmt, k0, k, fields, imported.case.precision.value)
    ds_changes: list[Change] = []
    files: list[Path] = []
    ds = imported.deepspeed
    if ds is not None and ds.key_prefix:  # inline in the training config
        ds_ed = _Editor(data["deepspeed"], "deepspeed.")
        _edit_deepspeed(ds_ed, k0, k, fields)
        ds_changes += ds_ed.changes
    elif ds is not None:
        ds_data = read_mapping(ds.path)
        ds_ed = _Editor(ds_data, f"{ds.path.name}: ")
        _edit_deepspeed(ds_ed, k0, k, fields)
        ds_changes += ds_ed.changes
        outputs.write(plan.deepspeed, json.dumps(ds_data, indent=2) + "\n", root=plan.folder)
        files.append(plan.deepspeed)
        if deepspeed_arg is None:  # the config names its DeepSpeed file: name the fitted one, beside it
            ed.set("deepspeed", plan.deepspeed.name, "the fitted DeepSpeed JSON, written beside this config")
    added = None
    removed = []
    if ds is None and k.stage is not None:
        added = _add_deepspeed(ed, k, plan, outputs)
        files.append(added)
    elif plan.added_deepspeed is not None and outputs.remove(plan.added_deepspeed):
        removed.append(plan.added_deepspeed)  # an earlier fit's offload, which this config does not name
    model = imported.case.model
    if Path(model).is_absolute() and data.get("model_name_or_path") not in (None, model):
        ed.set("model_name_or_path", model, "the model's folder as an absolute path, found from the output folder")
    changes = list(ed.changes) + ds_changes
    if fmt == ConfigFormat.llamafactory:
        header = (f"# {printable(t.path.name)} fitted by oom-harness fit to {imported.gpus} x "
                  f"{imported.gpu_memory / 2**30:.2f} GiB cards; every change is listed in fit's report\n")
        text = header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=110)
    else:
        text = json.dumps(data, indent=2) + "\n"
    outputs.write(plan.config, text, root=plan.folder)
    files.append(plan.config)
    if alloc_env:
        changes.append(Change(f"launch.sh: {ALLOC_ENV}", None, ALLOC_VALUE,
                              "measured 3-9% less reserved at equal speed on 7-14B LoRA/QLoRA; not credited in the "
                              "prediction, so it adds to the margin"))
    ds_arg = plan.deepspeed if deepspeed_arg is not None else None
    launch = _launch_script(imported, plan.config, ds_arg, alloc_env, deepspeed_on=k.stage is not None)
    if ds is None and k.stage is not None:
        changes.append(Change("launch.sh", None, _launcher_words(imported),
                              "DeepSpeed runs in a distributed process, which a one-GPU job starts as one rank"))
    outputs.write(plan.launch, launch, root=plan.folder)
    files.append(plan.launch)
    return Written(files=tuple(files), config=plan.config, deepspeed=added or plan.deepspeed, changes=tuple(changes),
                   removed=tuple(removed))


def _add_deepspeed(ed: _Editor, k: Knobs, plan: Plan, outputs: Outputs) -> Path:
    """Write the ZeRO offload JSON of knobs `k` for a config without DeepSpeed and name it in the config's
    `deepspeed` key, by its absolute path: the trainer opens it from the working directory, not from the
    config's folder."""
    if plan.added_deepspeed is None:
        raise ValueError("fit chose ZeRO offload for a job its plan gave no DeepSpeed JSON")
    data = offload_config(k.stage, k.pin_memory, LEAN_BUCKETS if k.lean_buckets else None)
    outputs.write(plan.added_deepspeed, json.dumps(data, indent=2) + "\n", root=plan.folder)
    what = "the optimizer and the parameters" if k.offload_param else "the optimizer"
    why = (f"DeepSpeed ZeRO-{k.stage} with {what} in host memory ({'pinned' if k.pin_memory else 'pageable'} buffers"
           + (", guide 000's lean buckets" if k.lean_buckets else "") + "): the card holds less, the step is "
           "slower (CPU Adam, host-device copies); AdamW as DeepSpeed's optimizer, the Trainer's hyperparameters")
    path = plan.added_deepspeed.resolve()
    ed.set("deepspeed", str(path), why)
    return plan.added_deepspeed


def _launcher_words(imported: ImportedConfig) -> str:
    if imported.training.format == ConfigFormat.llamafactory:
        return "FORCE_TORCHRUN=1 NPROC_PER_NODE=1 llamafactory-cli train"
    return "torchrun --nproc_per_node 1"


def _launch_script(imported: ImportedConfig, config: Path, deepspeed: Path | None, alloc_env: bool, *,
                   deepspeed_on: bool = False) -> str:
    """launch.sh: the allocator's setting and the command. A config on DeepSpeed is started as ranks even on one
    GPU (LLaMA-Factory refuses DeepSpeed without FORCE_TORCHRUN; the HF Trainer needs a launcher's
    environment to initialise DeepSpeed's process group)."""
    here = '"$(dirname "$0")"'
    name = shlex.quote(config.name)
    lines = ["#!/bin/sh", "# written by oom-harness fit: the environment the fitted config was chosen for"]
    if alloc_env:
        lines.append(f"export {ALLOC_ENV}={ALLOC_VALUE}")
    one_gpu = imported.gpus == 1 and imported.procs_per_gpu == 1
    if imported.training.format == ConfigFormat.llamafactory:
        if deepspeed_on:
            lines.append("export FORCE_TORCHRUN=1  # LLaMA-Factory starts DeepSpeed through torchrun only")
            if one_gpu:
                lines.append("export NPROC_PER_NODE=1")
        lines.append(f"llamafactory-cli train {here}/{name}")
    else:
        ds = f" --deepspeed {here}/{shlex.quote(deepspeed.name)}" if deepspeed else ""
        script = imported.init_order.path
        if deepspeed_on and one_gpu and script is not None and trainer_script(script):
            lines.append(printable(f"# {Path(script).name} as one rank, with the fitted arguments as its JSON file "
                                   "(HfArgumentParser.parse_json_file)"))
            lines.append(f"torchrun --nproc_per_node 1 {shlex.quote(str(Path(script).resolve()))} {here}/{name}{ds}")
        elif deepspeed_on and one_gpu:
            lines.append(printable(f"# your training script as one rank, with the arguments of {name}{ds}:"))
            lines.append(printable(f"# torchrun --nproc_per_node 1 YOUR_SCRIPT.py {name}{ds}"))
        else:
            lines.append(printable(f"# your training script, with the arguments of {name}{ds}"))
    return "\n".join(lines) + "\n"
