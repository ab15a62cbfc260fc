"""One framework's run of a case, in the worker's phases: prepared (checkpoint written, arguments parsed),
loaded (the load phase), trained (engine and steps, inside the framework's `train()`).

The same three calls for LLaMA-Factory and the HF Trainer, so the worker measures both alike
(`harness.runtime.worker`); what differs is each framework's own module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.measure.records import StackRun
from harness.runtime.build import Built, checkpointing_active, model_config_dict, random_checkpoint, train_dtype
from harness.runtime.stacks import hf_trainer, llamafactory
from harness.spec.schema import Case, Stack


@dataclass
class StackJob:
    case: Case
    device: Any
    checkpoint: Path
    config_dict: dict
    parsed: Any  # the framework's parsed arguments
    record: StackRun
    loaded: Any = None
    trainer: Any = None

    def load(self) -> Built:
        """The framework's model loading (the measured load phase)."""
        if self.case.stack == Stack.llamafactory:
            self.loaded = llamafactory.load(self.parsed)
            model = self.loaded.model
        else:
            model = hf_trainer.load(self.case, self.checkpoint, train_dtype(self.case, self.device.type == "cpu"),
                                    self.device)
            self.loaded = model
        zero_init = any(hasattr(p, "ds_id") for p in model.parameters())
        return Built(model=model, config_dict=self.config_dict, zero_init=zero_init, hf_ds_config=None)

    def train(self, dataset, callback) -> Any:
        """The framework's trainer over `dataset`, measured by `callback`; returns the trainer."""
        if self.case.stack == Stack.llamafactory:
            self.trainer = llamafactory.make_trainer(self.loaded, dataset, [callback])
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
            self.trainer = hf_trainer.make_trainer(self.loaded, self.parsed, tokenizer, dataset, [callback])
        self.record.trainer = type(self.trainer).__name__
        self.trainer.train()
        return self.trainer

    @property
    def model(self):
        """The trained module (the DeepSpeed engine's or accelerate's wrapped one unwrapped)."""
        return self.trainer.model if self.trainer is not None else None

    @property
    def engine(self):
        """The DeepSpeed engine the trainer made, or None."""
        return getattr(self.trainer, "deepspeed", None) if self.trainer is not None else None

    def checkpointing_as_asked(self) -> bool:
        return checkpointing_active(self.model) == self.case.train.gradient_checkpointing


def prepare(case: Case, fidelity: str, shape, device, layers: int | None, out_dir: Path, rank: int,
            ds_config: dict | None) -> StackJob:
    """Write what the framework loads (the checkpoint, the DeepSpeed config) and parse the arguments, as
    the user's job does before it loads the model (outside the measured phases)."""
    on_cpu = device.type == "cpu"
    config_dict = model_config_dict(case, fidelity, shape.seq_len, layers)
    if config_dict["model_type"] == "gla" and on_cpu:
        from harness.models import fla_cpu

        fla_cpu.apply()
    checkpoint = random_checkpoint(config_dict, train_dtype(case, on_cpu), device)
    ds_path = None
    if ds_config is not None:
        ds_path = out_dir / f"deepspeed.rank{rank}.json"
        ds_path.write_text(json.dumps(ds_config, indent=1))
    if case.stack == Stack.llamafactory:
        arguments = llamafactory.run_arguments(case, shape, checkpoint, out_dir, ds_path, on_cpu)
        parsed = llamafactory.parse(arguments)
        record = StackRun(name="llamafactory", version=llamafactory.version(), notes=arguments.notes)
    else:
        values, notes = hf_trainer.run_arguments(case, shape, out_dir, ds_path, on_cpu)
        parsed = hf_trainer.parse(values)
        record = StackRun(name="hf_trainer", version=hf_trainer.version(), notes=notes)
    return StackJob(case=case, device=device, checkpoint=checkpoint, config_dict=config_dict, parsed=parsed,
                    record=record)
