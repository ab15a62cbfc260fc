"""The engine phase: what trains the built model. DeepSpeed's engine where the case has a DeepSpeed
config (it owns the optimizer, ZeRO's partitions and offload), else torch's AdamW over the trainable
parameters, as the HF Trainer sets it up without DeepSpeed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Trainer:
    runner: object  # what a training forward calls: the DeepSpeed engine, or the model itself
    engine: object | None  # the DeepSpeed engine (it steps at the accumulation boundary itself)
    optimizer: object
    model: object


def start_engine(case, model, ds_config: dict | None) -> Trainer:
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    if ds_config is not None:
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)
        return Trainer(engine, engine, optimizer, model)
    optimizer = torch.optim.AdamW(trainable, lr=case.train.learning_rate)
    return Trainer(model, None, optimizer, model)
