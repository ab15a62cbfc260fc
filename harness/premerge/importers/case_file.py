"""The harness's own case YAML (`cases/*.yaml`); the command line may change its cards, processes,
launcher and model."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from harness.premerge.importers.build import assemble, case_triton_cache
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.init_order import init_order_of
from harness.premerge.importers.job import case_launcher, job_of, launcher_of
from harness.premerge.importers.model import check_model, model_of
from harness.premerge.importers.reading import Reader, read_mapping
from harness.premerge.importers.records import (
    ConfigFormat,
    DeepSpeedFile,
    ImportedConfig,
    InitOrder,
    JobSpec,
    TrainingFile,
)
from harness.premerge.importers.training_common import check_lora_targets, default_reentrant
from harness.spec.cases import CaseError, _describe, load_case
from harness.spec.schema import Case, Offload, Precision


def import_case(path: Path, spec: JobSpec) -> ImportedConfig:
    try:
        written = load_case(path)
    except CaseError as exc:
        raise ConfigError(path, None, "invalid case file: " + "; ".join(exc.problems),
                          "see the schema in harness/spec/schema.py") from None
    job = job_of(spec, path, written)
    notes: list[str] = []
    model = model_of(path, written.model, spec, key="model")
    check_model(path, model, spec, key="model")
    if written.method.lora is not None:  # as peft will match them on the model
        check_lora_targets(Reader(path, {}, "method.lora."), "targets", written.method.lora.targets, model.arch,
                           notes)
    launcher, launcher_from = launcher_of(spec, written.launch.launcher, "the case file")
    has_ds = written.deepspeed is not None
    init = init_order_of(spec, InitOrder(written.launch.init_order, "the case file's launch.init_order", path))
    data = written.model_dump(mode="json")
    # Claims go back as the objects read: dumped, a size range's bounds are bare byte counts, which the
    # schema refuses (a size needs its unit) and which are not what the file says.
    data["claims"] = list(written.claims)
    data["model"] = model.case_model
    ranks = written.launch.ranks
    if spec.gpus is not None or spec.procs_per_gpu is not None or spec.launcher is not None:
        ranks = job.ranks(launcher, has_ds, notes)
    data["launch"].update(launcher=case_launcher(launcher, has_ds), ranks=ranks, procs_per_card=job.procs_per_gpu,
                          triton_cache=written.launch.triton_cache if spec.triton_cache is None
                          else case_triton_cache(model.arch, job),
                          init_order=init.order if has_ds and written.deepspeed.stage == 3 else "deepspeed_first")
    data["target"] = job.target(written.target.card.name if spec.gpu_memory is None else None)
    try:
        case = Case.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(_describe(e) for e in exc.errors())
        raise ConfigError(path, None, f"with the command-line settings: {problems}",
                          "change the flags or the case file") from None
    ds = None if case.deepspeed is None else _deepspeed_of_case(path, case)
    if model.note:
        notes.append(model.note)
    return assemble(case, model, _training_of_case(path, case), ds, launcher=launcher, launcher_from=launcher_from,
                    ranks=case.launch.ranks, job=job, init=init, notes=notes)


def _training_of_case(path: Path, case: Case) -> TrainingFile:
    t = case.train
    reentrant = t.checkpointing_reentrant
    return TrainingFile(
        path=path, format=ConfigFormat.case, keys=frozenset(read_mapping(path)),
        micro_batch=t.micro_batch, grad_accum=t.grad_accum, seq_len=t.seq_len,
        fp16=case.precision == Precision.fp16, bf16=case.precision == Precision.bf16, eval_strategy=None,
        evaluation_strategy=None, gradient_checkpointing=t.gradient_checkpointing,
        gradient_checkpointing_key="train.gradient_checkpointing", method=case.method.kind,
        quantization_bits=4 if case.method.quantization else None, deepspeed_ref=None,
        checkpointing_reentrant=default_reentrant(case.stack.value, case.method.kind) if reentrant is None
        else reentrant,
        checkpointing_reentrant_key="" if reentrant is None else "train.checkpointing_reentrant",
    )


def _deepspeed_of_case(path: Path, case: Case) -> DeepSpeedFile:
    """A case's `deepspeed` block seen as a DeepSpeed file (no "auto", no batch keys, no precision)."""
    d = case.deepspeed
    offloaded = Offload.cpu in (d.offload_optimizer, d.offload_param)
    return DeepSpeedFile(path=path, key_prefix="deepspeed.", keys=frozenset(d.model_fields_set), stage=d.stage,
                         train_batch_size=None, micro_batch=None, grad_accum=None, fp16=None, bf16=None,
                         offload_optimizer=d.offload_optimizer.value, offload_param=d.offload_param.value,
                         offload_pin_memory=d.pin_memory and offloaded, activation_checkpointing=(),
                         zero=d.model_dump(mode="json"))
