"""`oom-harness fit` adds DeepSpeed ZeRO offload to a one-GPU job without DeepSpeed, on a stack that reads
`deepspeed`, before anything --allow unlocks: a full fine-tune too big for its card gets ZeRO-3 with the
optimizer and the parameters offloaded, written as a DeepSpeed JSON the importer reads back, launched as
one rank, priced slower and said to be modelled where no baseline measured its kind, and kept within the
host's RAM where it is given; a job that fits, a multi-GPU job and a plain script's own loop get none."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from harness.cli.main import main
from harness.fit.knobs import LEAN_BUCKETS, _deepspeed_options, apply, knobs_of
from harness.fit.throughput import OffloadKind, calibrate, step_work
from harness.fit.writer import write_fitted
from harness.fit.zero_offload import NewDeepSpeed, offload_config, why_not
from harness.predict.step import reentrant_checkpointing
from harness.premerge.importers import JobSpec, import_config, read_deepspeed
from harness.premerge.importers.model import hidden_size
from harness.spec.schema import Offload
from harness.spec.units import GIB

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "benchmarks" / "architectures" / "models"
H100 = "nvidia-h100-80gb-hbm3-x1"


def _lf_full(folder: Path, model: str = "qwen2.5-1.5b") -> Path:
    """A LLaMA-Factory full fine-tune: 1.5B parameters in fp32 with Adam, about 30 GiB on the card."""
    path = folder / "full.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({
        "model_name_or_path": str(MODELS / model), "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "alpaca_en_demo", "template": "qwen", "cutoff_len": 1024, "output_dir": "saves/full",
        "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "learning_rate": 1e-5, "bf16": True}))
    return path


def _hf_full(folder: Path, **extra) -> Path:
    """The same job as TrainingArguments for the HF Trainer."""
    path = folder / "args.json"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "model_name_or_path": str(MODELS / "qwen2.5-1.5b"), "output_dir": "out", "bf16": True,
        "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8, "max_length": 1024,
        "gradient_checkpointing": True, **extra}))
    return path


def _fit(capsys, *argv) -> tuple[int, dict]:
    code = main(["fit", *map(str, argv), "--json", "--search-seconds", "900"])
    return code, json.loads(capsys.readouterr().out)


def _zero(ds_path: Path, config: Path):
    """The written DeepSpeed JSON as the harness's importer reads it."""
    arch = import_config(config, JobSpec(gpus=1, gpu_memory=12 * GIB)).arch
    return read_deepspeed(ds_path, json.loads(ds_path.read_text()), hidden_size(arch))


def test_a_one_gpu_full_fine_tune_too_big_for_its_card_gets_zero_offload_without_allow(tmp_path, capsys):
    config = _lf_full(tmp_path / "in")
    job = ["--gpu-memory", "12GiB", "--gpus", "1"]
    code, out = _fit(capsys, config, *job, "--out", tmp_path / "out")
    assert code == 0 and not out["input"]["fits"] and out["fits"]
    assert "ZeRO-3+opt offload+param offload" in out["predicted"]["knobs"]
    # no baseline measures a one-GPU full fine-tune under offload: its price is said to be modelled
    assert "modelled, not measured" in out["predicted"]["tokens_per_s_note"]
    assert out["predicted_tokens_per_s"] < out["input"]["predicted_tokens_per_s"]  # offload is slower

    files = [Path(f) for f in out["files"]]
    fitted = next(f for f in files if f.suffix == ".yaml")
    data = yaml.safe_load(fitted.read_text())
    ds_path = Path(data["deepspeed"])
    assert ds_path.is_absolute() and ds_path in [f.resolve() for f in files]
    zero = _zero(ds_path, fitted)
    assert (zero.stage, zero.offload_optimizer, zero.offload_param) == (3, "cpu", "cpu")
    assert zero.micro_batch is None and zero.grad_accum is None  # "auto": the Trainer's own batch
    assert data["per_device_train_batch_size"] * data["gradient_accumulation_steps"] == 8  # the global batch
    assert out["check"]["fits"] and out["check"]["card_peak_gib"] == out["predicted"]["card_peak_gib"]
    launch = (fitted.parent / "launch.sh").read_text()
    assert "export FORCE_TORCHRUN=1" in launch and "export NPROC_PER_NODE=1" in launch
    assert {"deepspeed", "launch.sh"} <= {c[0] for c in out["changes"]}


def test_the_hosts_ram_rules_out_offload_that_does_not_fit_it(tmp_path, capsys):
    """Pinned buffers round up to a power of two: on a host whose usable RAM (80%) holds the pageable
    offload and not the pinned one, fit writes pageable buffers; on one too small for either, nothing fits."""
    config = _lf_full(tmp_path / "in")
    job = ["--gpu-memory", "12GiB", "--gpus", "1"]
    code, roomy = _fit(capsys, config, *job, "--out", tmp_path / "roomy", "--host-ram", "512GiB")
    assert code == 0 and roomy["check"]["host_ram_fits"]
    pinned = roomy["check"]["host_ram_node_gib"]
    roomy_ds = json.loads(next(Path(f) for f in roomy["files"] if f.endswith(".ds_offload.fitted.json")).read_text())
    assert roomy_ds["zero_optimization"]["offload_param"]["pin_memory"] is True

    tight = f"{pinned / 0.8 - 0.3:.2f}GiB"  # below what the pinned config needs
    code, out = _fit(capsys, config, *job, "--out", tmp_path / "tight", "--host-ram", tight)
    assert code == 0 and out["check"]["host_ram_fits"] and out["check"]["host_ram_node_gib"] < pinned
    written = json.loads(next(Path(f) for f in out["files"] if f.endswith(".ds_offload.fitted.json")).read_text())
    assert written["zero_optimization"]["offload_param"]["pin_memory"] is False

    code, out = _fit(capsys, config, *job, "--out", tmp_path / "small", "--host-ram", "16GiB")
    assert code == 1 and not out["fits"]


def test_a_job_that_fits_unchanged_gets_no_deepspeed(tmp_path, capsys):
    """... and an earlier fit's offload JSON in the folder, which --force replaces the answer of, goes with it:
    left, it would read as part of this answer."""
    config = _lf_full(tmp_path / "in")
    stale = tmp_path / "out" / "full.ds_offload.fitted.json"
    stale.parent.mkdir()
    stale.write_text('{"zero_optimization": {"stage": 3}}\n')
    job = ["--gpu-memory", "80GiB", "--gpus", "1", "--out", tmp_path / "out"]
    assert main(["fit", *map(str, [config, *job]), "--json"]) == 2  # refused without --force
    assert "full.ds_offload.fitted.json: exists; pass --force" in capsys.readouterr().err and stale.exists()
    code, out = _fit(capsys, config, *job, "--force")
    assert out["removed"] == [str(stale)] and not stale.exists()
    assert code == 0 and out["input"]["fits"]
    assert "no DeepSpeed" in out["predicted"]["knobs"]
    fitted = next(Path(f) for f in out["files"] if f.endswith(".yaml"))
    assert "deepspeed" not in yaml.safe_load(fitted.read_text())
    assert not list((tmp_path / "out").glob("*.ds_offload.fitted.json"))
    assert "FORCE_TORCHRUN" not in (tmp_path / "out" / "launch.sh").read_text()


def test_a_trainingarguments_config_gets_a_json_its_trainer_reads_and_a_one_rank_launch(tmp_path):
    """Every offload candidate reads back, through the importer, as the case fit predicted: the block,
    the optimizer DeepSpeed's AdamW replaces, and the launch. With --script naming a Trainer script the
    launch line runs it under torchrun as one rank."""
    script = tmp_path / "in" / "train.py"
    config = _hf_full(tmp_path / "in", optim="adamw_torch_fused")
    script.write_text("from transformers import Trainer, TrainingArguments\n"
                      "args = TrainingArguments(output_dir='o')\nTrainer(model=None, args=args).train()\n")
    imported = import_config(config, JobSpec(gpus=1, gpu_memory=12 * GIB, script=script))
    assert why_not(imported) is None
    case0, k0 = imported.case, knobs_of(imported.case)
    new = NewDeepSpeed(hidden_size(imported.arch), imported.init_order.order)
    for n, (stage, opt, par, pin, lean) in enumerate(o for o in _deepspeed_options(k0, offload=True) if o[0]):
        k = dataclasses.replace(k0, stage=stage, offload_optimizer=opt, offload_param=par, pin_memory=pin,
                                lean_buckets=lean)
        written = write_fitted(imported, k0, k, tmp_path / f"out{n}", deepspeed_arg=None, alloc_env=True, force=True)
        args = json.loads(written.config.read_text())
        assert Path(args["deepspeed"]) == written.deepspeed.resolve()
        again = import_config(written.config, JobSpec(gpus=1, gpu_memory=12 * GIB, script=script))
        assert again.case.deepspeed == apply(case0, k, new).deepspeed
        fitted = apply(case0, k, new)
        assert reentrant_checkpointing(again.case) == reentrant_checkpointing(fitted)  # written out by apply only
        skip = {"checkpointing_reentrant"}
        assert again.case.train.model_dump(exclude=skip) == fitted.train.model_dump(exclude=skip)
        assert again.case.launch == fitted.launch
        assert case0.train.optim == "adamw_torch_fused" and again.case.train.optim is None
        assert (again.deepspeed.offload_pin_memory, again.deepspeed.stage) == (pin, stage)
        if lean and stage == 3:
            assert again.case.deepspeed.stage3_max_live_parameters == LEAN_BUCKETS["stage3_max_live_parameters"]
        launch = (written.config.parent / "launch.sh").read_text().splitlines()
        assert launch[-1].startswith(f"torchrun --nproc_per_node 1 {script.resolve()} ")
    no_script = import_config(config, JobSpec(gpus=1, gpu_memory=12 * GIB))
    k = dataclasses.replace(k0, stage=2, offload_optimizer=True)
    written = write_fitted(no_script, k0, k, tmp_path / "plain-launch", deepspeed_arg=None, alloc_env=False)
    assert "# torchrun --nproc_per_node 1 " in (written.config.parent / "launch.sh").read_text()


@pytest.mark.parametrize("spec, says", [
    (JobSpec(gpus=2, gpu_memory=12 * GIB), "one-GPU jobs only"),
    (JobSpec(gpus=1, gpu_memory=12 * GIB, procs_per_gpu=2), "one-GPU jobs only"),
    (JobSpec(gpus=1, gpu_memory=12 * GIB, stack="plain"), "own loop"),
    (JobSpec(gpus=1, gpu_memory=12 * GIB, stack="peft"), "own loop"),
])
def test_multi_gpu_jobs_and_a_scripts_own_loop_get_no_deepspeed(tmp_path, spec, says):
    config = _hf_full(tmp_path / "in")
    imported = import_config(config, spec)
    assert says in why_not(imported)
    assert [o[0] for o in _deepspeed_options(knobs_of(imported.case), offload=why_not(imported) is None)] == [None]


def test_a_peft_script_that_hands_its_arguments_to_a_trainer_takes_deepspeed(tmp_path):
    config = _hf_full(tmp_path / "in")
    own_loop, trainer = tmp_path / "in" / "loop.py", tmp_path / "in" / "sft.py"
    own_loop.write_text("from transformers import AutoModelForCausalLM\n"
                        "model = AutoModelForCausalLM.from_pretrained('m')\nfor batch in []:\n    model(**batch)\n")
    trainer.write_text("from trl import SFTTrainer\nfrom transformers import AutoModelForCausalLM\n"
                       "model = AutoModelForCausalLM.from_pretrained('m')\nSFTTrainer(model=model).train()\n")
    spec = JobSpec(gpus=1, gpu_memory=12 * GIB, stack="peft")
    assert "own loop" in why_not(import_config(config, dataclasses.replace(spec, script=own_loop)))
    imported = import_config(config, dataclasses.replace(spec, script=trainer))
    assert why_not(imported) is None
    # this script builds its model before any DeepSpeed config: under ZeRO-3 the whole model lands on the card
    z3 = dataclasses.replace(knobs_of(imported.case), stage=3, offload_optimizer=True, offload_param=True)
    new = NewDeepSpeed(hidden_size(imported.arch), imported.init_order.order)
    assert apply(imported.case, z3, new).launch.init_order == "model_first"


def test_a_job_already_on_deepspeed_keeps_its_own_stage_options(tmp_path):
    config = _hf_full(tmp_path / "in", deepspeed=str(ROOT / "tests" / "data" / "fit" / "ds_z2_offload.json"))
    for gpus in (1, 2):
        imported = import_config(config, JobSpec(gpus=gpus, gpu_memory=12 * GIB, launcher="torchrun"))
        assert "already runs DeepSpeed" in why_not(imported)
        k0 = knobs_of(imported.case)
        options = _deepspeed_options(k0)
        assert _deepspeed_options(k0, offload=True) == options and {o[0] for o in options} == {0, 2, 3}


def test_a_plain_stack_too_big_for_its_card_is_not_answered_with_deepspeed(tmp_path, capsys):
    config = _hf_full(tmp_path / "in")
    code, out = _fit(capsys, config, "--gpu-memory", "12GiB", "--gpus", "1", "--stack", "plain",
                     "--out", tmp_path / "out")
    assert code == 1 and not out["fits"]
    assert "ZeRO" not in out["closest"]["knobs"] and "own loop" in out["search"]["zero_offload_not_searched"]


def test_offload_at_one_rank_is_priced_slower_and_said_modelled_where_unmeasured(tmp_path):
    imported = import_config(_lf_full(tmp_path / "in"), JobSpec(gpus=1, gpu_memory=12 * GIB))
    case0, config = imported.case, imported.arch.config
    k0 = dataclasses.replace(knobs_of(case0), checkpointing=True)
    new = NewDeepSpeed(hidden_size(imported.arch))

    def case(**knobs):
        return apply(case0, dataclasses.replace(k0, **knobs), new)

    none = case()
    z2, z2_pageable = case(stage=2, offload_optimizer=True), case(stage=2, offload_optimizer=True, pin_memory=False)
    z3 = case(stage=3, offload_optimizer=True, offload_param=True)
    model = calibrate(platform=H100)
    rates = [model.predict(c, config) for c in (none, z2, z2_pageable, z3)]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == 4
    # one rank: no collectives; CPU Adam over every parameter through the host's memory and threads
    work = step_work(z3, config, threads=8)
    counts = dict(zip(("flops", "linear", "4bit", "fla", "hooks", "engine", "pcie", "pageable", "host_memory", "net",
                       "adam", "steps"), work.counts, strict=True))
    assert counts["net"] == 0 and counts["pcie"] > 0 and counts["host_memory"] > 0 and counts["adam"] > 0
    assert model.unmeasured(z3) and "one-GPU full fine-tune under ZeRO-3" in model.unmeasured(z3)
    assert model.unmeasured(none) is None
    # a one-GPU LoRA under ZeRO-3 with both offloads is measured on one H100 (guide 001's rung 4)
    assert OffloadKind(one_rank=True, full=False, stage=3, params=True) in model.offload_measured
    assert z3.deepspeed.offload_param == Offload.cpu and z3.launch.init_order == "deepspeed_first"


def test_the_written_json_is_llamafactorys_offload_example_with_deepspeeds_adamw():
    z3 = offload_config(3, pin_memory=False)
    assert z3["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    assert z3["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert z3["optimizer"]["type"] == "AdamW" and z3["optimizer"]["params"]["lr"] == "auto"
    z2 = offload_config(2, pin_memory=True, lean=LEAN_BUCKETS)
    assert "offload_param" not in z2["zero_optimization"]
    assert not [k for k in z2["zero_optimization"] if k.startswith("stage3_")]
    assert z2["zero_optimization"]["reduce_bucket_size"] == LEAN_BUCKETS["reduce_bucket_size"]
