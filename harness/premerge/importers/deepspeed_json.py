"""DeepSpeed JSON: "auto" values resolved as the Hugging Face integration resolves them, left-out keys at
DeepSpeed's defaults, and which DeepSpeed config a job uses (--deepspeed, a path, or inline).

Keys that change memory beyond what the case's `deepspeed` block models (a partial optimizer offload,
ZeRO++, MiCS, an `optimizer` block other than Adam, gradient and communication dtypes) are recorded as
read but not modelled (`records.NotModelled`, listed in docs/case-format.md); the check names them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.premerge.importers.detect import detect_format
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.keys import (
    DEEPSPEED_ALIASES,
    DEEPSPEED_DEFAULTS,
    DEEPSPEED_KEYS,
    DEEPSPEED_NOT_MODELLED,
    DEEPSPEED_OFFLOAD_KEYS,
    DEEPSPEED_OPTIMIZERS,
    DEEPSPEED_ZERO_KEYS,
    check_keys,
)
from harness.premerge.importers.reading import DEEPSPEED_TRUTH, PYDANTIC, Reader, read_mapping, resolve_path
from harness.premerge.importers.records import ConfigFormat, DeepSpeedFile, JobSpec, NotModelled, ReadAs
from harness.spec.dsconfig import auto_sizes

_DS = DEEPSPEED_NOT_MODELLED

_STAGE3_SIZES = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                 "stage3_max_live_parameters", "stage3_max_reuse_distance")


def _auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def read_deepspeed(path: Path, data: dict[str, Any], hidden_size: int, key_prefix: str = "") -> DeepSpeedFile:
    """A DeepSpeed config with its "auto" buckets and thresholds resolved for this model's hidden size
    (what transformers' HfTrainerDeepSpeedConfig writes) and left-out keys at DeepSpeed's defaults."""
    check_keys(path, data, DEEPSPEED_KEYS, prefix=key_prefix)
    reads: list[ReadAs] = []
    unmodelled: list[NotModelled] = []
    top = Reader(path, data, key_prefix, DEEPSPEED_TRUTH, reads, unmodelled)
    zero_raw = data.get("zero_optimization") or {}
    if not isinstance(zero_raw, dict):
        raise ConfigError(path, key_prefix + "zero_optimization", "must be a mapping")
    zprefix = key_prefix + "zero_optimization."
    check_keys(path, zero_raw, DEEPSPEED_ZERO_KEYS, prefix=zprefix)
    zero = {DEEPSPEED_ALIASES.get(k, k): v for k, v in zero_raw.items()}
    z = Reader(path, zero, zprefix, PYDANTIC, reads, unmodelled)  # DeepSpeedZeroConfig: a pydantic model
    stage = z.int("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise z.fail("stage", f"ZeRO stage {stage} does not exist", "use 0, 1, 2 or 3")

    def offload(name: str) -> tuple[str, bool]:
        block = zero.get(name)
        if block is None:
            return "none", False
        if not isinstance(block, dict):
            raise z.fail(name, "must be a mapping like {\"device\": \"cpu\", \"pin_memory\": false}")
        check_keys(path, block, DEEPSPEED_OFFLOAD_KEYS, prefix=f"{zprefix}{name}.")
        r = z.sub(block, f"{zprefix}{name}.")
        device = r.choice("device", ("none", "cpu", "nvme"), "none")
        if device == "nvme":
            raise r.fail("device", "NVMe offload is not modelled by the predictor", "offload to 'cpu' or 'none'")
        if name == "offload_param" and "ratio" in block:
            raise r.fail("ratio", "is a key of offload_optimizer only (DeepSpeed refuses it here)", "remove it")
        ratio = r.float("ratio", 1.0)
        if not 0 <= ratio <= 1:
            raise r.fail("ratio", f"must be between 0 and 1 (the share of the optimizer offloaded), got {ratio:g}")
        if device != "none" and ratio < 1:
            r.not_modelled_key("ratio", _DS["zero_optimization.offload_optimizer.ratio"].entry(),
                               f"{1 - ratio:.0%} of it stays on the card")
        return device, device != "none" and r.bool("pin_memory", False)

    opt_dev, opt_pin = offload("offload_optimizer")
    par_dev, par_pin = offload("offload_param")
    _zero_extensions(z, stage)
    _optimizer_block(top)
    _dtypes(top)
    if zero.get("cpu_offload") is True and opt_dev == "none":  # DeepSpeed's legacy spelling
        opt_dev, opt_pin = "cpu", z.bool("cpu_offload_use_pin_memory", False)
    if par_dev != "none" and stage != 3:
        raise z.fail("offload_param", f"parameter offload needs ZeRO stage 3 (this config has stage {stage})",
                     "set zero_optimization.stage to 3, or remove offload_param")
    if opt_dev != "none" and stage == 0:
        raise z.fail("offload_optimizer", "optimizer offload needs ZeRO stage 1, 2 or 3", "set a stage")

    auto = auto_sizes(hidden_size)

    def size(key: str) -> int | None:
        value = zero.get(key)
        if _auto(value):
            return auto.get(key, DEEPSPEED_DEFAULTS.get(key))
        if value is None:
            return DEEPSPEED_DEFAULTS.get(key)
        return z.int(key, None)

    block: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": opt_dev,
        "offload_param": par_dev,
        "pin_memory": opt_pin or par_pin,
        "overlap_comm": z.bool("overlap_comm", stage == 3),
        "contiguous_gradients": z.bool("contiguous_gradients", True),
        "reduce_bucket_size": size("reduce_bucket_size"),
        "allgather_bucket_size": size("allgather_bucket_size"),
        "sub_group_size": size("sub_group_size"),
    }
    if stage == 3:
        block.update({key: size(key) for key in _STAGE3_SIZES})

    def precision(name: str) -> bool | None:
        sub = data.get(name)
        if sub is None:
            return None
        enabled = sub.get("enabled") if isinstance(sub, dict) else sub
        if enabled is None or _auto(enabled):
            return None
        # DeepSpeedFP16Config / DeepSpeedBF16Config: pydantic models
        return Reader(path, {"enabled": enabled}, f"{key_prefix}{name}.", PYDANTIC, reads, unmodelled).bool(
            "enabled", False)

    def batch(key: str) -> int | None:
        return None if _auto(data.get(key)) else top.int(key, None, minimum=1)

    ac = data.get("activation_checkpointing") or {}
    ac_on = tuple(k for k, v in ac.items() if v is True) if isinstance(ac, dict) else ()
    return DeepSpeedFile(
        path=path, key_prefix=key_prefix, keys=frozenset(data), stage=stage,
        train_batch_size=batch("train_batch_size"), micro_batch=batch("train_micro_batch_size_per_gpu"),
        grad_accum=batch("gradient_accumulation_steps"), fp16=precision("fp16"),
        bf16=precision("bf16") if "bf16" in data else precision("bfloat16"),
        offload_optimizer=opt_dev, offload_param=par_dev, offload_pin_memory=opt_pin or par_pin,
        activation_checkpointing=ac_on, zero=block, not_modelled=tuple(unmodelled), read_as=tuple(reads),
    )


def _zero_extensions(z: Reader, stage: int) -> None:
    """ZeRO++ (hpZ, qwZ, qgZ) and MiCS: read, not modelled (the case's `deepspeed` block has no place for them)."""
    hpz = z.int("zero_hpz_partition_size", 1, minimum=1)
    if hpz > 1 and stage == 3:
        z.not_modelled_key("zero_hpz_partition_size", _DS["zero_optimization.zero_hpz_partition_size"].entry(),
                           f"1/{hpz} of the model per rank")
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if z.bool(key, False):
            z.not_modelled_key(key, _DS[f"zero_optimization.{key}"].entry())
    mics = z.int("mics_shard_size", -1, minimum=-1)
    if mics > 0:
        z.not_modelled_key("mics_shard_size", _DS["zero_optimization.mics_shard_size"].entry(),
                           f"groups of {mics} ranks")


def _optimizer_block(top: Reader) -> None:
    """DeepSpeed's own `optimizer`: Adam and AdamW hold what the predictor models (two fp32 moments per
    trainable parameter); other types are read but not modelled."""
    block = top.data.get("optimizer")
    if block is None:
        return
    if not isinstance(block, dict):
        raise top.fail("optimizer", "must be a mapping like {\"type\": \"AdamW\", \"params\": {...}}")
    kind = str(block.get("type") or "").strip()
    effect = DEEPSPEED_OPTIMIZERS.get(kind.lower().replace("_", ""))
    if effect == "modelled":
        return
    opt = top.sub(block, "optimizer.")
    opt.not_modelled_key("type", _DS["optimizer.type"].entry(raises=effect != "smaller"),
                         f"{kind or 'no type'}: {'less' if effect == 'smaller' else 'other'} state than Adam's")


def _dtypes(top: Reader) -> None:
    """Gradient accumulation and communication dtypes other than DeepSpeed's defaults."""
    types = top.data.get("data_types")
    if isinstance(types, dict) and types.get("grad_accum_dtype") is not None:
        top.sub(types, "data_types.").not_modelled_key("grad_accum_dtype", _DS["data_types.grad_accum_dtype"].entry())
    if top.data.get("communication_data_type") is not None:
        top.not_modelled_key("communication_data_type", _DS["communication_data_type"].entry())


def deepspeed_of(config_path: Path, ref: Any, spec: JobSpec,
                 hidden_size: int) -> tuple[DeepSpeedFile | None, list[str]]:
    """The DeepSpeed config of a job: --deepspeed, else the config's `deepspeed` (a path or inline)."""
    if spec.deepspeed is not None:
        path = Path(spec.deepspeed)
        notes = []
        if isinstance(ref, str) and resolve_path(ref, config_path).resolve() != path.resolve():
            notes.append(f"--deepspeed {path} replaces the config's deepspeed: {ref}")
        return read_deepspeed(path, _read_deepspeed_file(path, None, None), hidden_size), notes
    if ref is None:
        return None, []
    if isinstance(ref, dict):
        return read_deepspeed(config_path, ref, hidden_size, key_prefix="deepspeed."), []
    path = resolve_path(str(ref), config_path)
    return read_deepspeed(path, _read_deepspeed_file(path, config_path, "deepspeed"), hidden_size), []


def _read_deepspeed_file(path: Path, referrer: Path | None, key: str | None) -> dict[str, Any]:
    if not path.exists():  # a FIFO or a device: the reader refuses it by its kind
        if referrer is not None:
            raise ConfigError(referrer, key, f"the DeepSpeed config {path} does not exist",
                              "give a path relative to this config's folder, or pass --deepspeed")
        raise ConfigError(path, None, "no such DeepSpeed config file", "check the --deepspeed path")
    data = read_mapping(path)
    if detect_format(path, data) != ConfigFormat.deepspeed and "zero_optimization" not in data:
        raise ConfigError(path, None, "is not a DeepSpeed config (no zero_optimization or batch keys)",
                          "pass a DeepSpeed JSON such as LLaMA-Factory's ds_z3_config.json")
    return data
