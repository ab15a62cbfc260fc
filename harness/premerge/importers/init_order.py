"""Does a training script build the model before DeepSpeed is configured? (guide 002's mistake)"""

from __future__ import annotations

import ast
from pathlib import Path

from harness.models.inputs import InputError, read_text
from harness.premerge.importers.errors import ConfigError
from harness.premerge.importers.records import InitOrder, JobSpec

MAX_SCRIPT_BYTES = 4 * 2**20  # a training script; far above any real one
_MODEL_LOADERS = ("from_pretrained", "from_config")
_DS_CONFIGURERS = ("HfDeepSpeedConfig", "TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig", "Init",
                   "initialize", "Accelerator")


def scan_init_order(script: Path) -> InitOrder:
    """Which comes first in a training script: building the model (`*.from_pretrained`, `from_config`)
    or configuring DeepSpeed (`HfDeepSpeedConfig`, `TrainingArguments(deepspeed=...)`, `zero.Init`,
    `deepspeed.initialize`). Under ZeRO-3 a model built first is materialised whole on every rank
    (guide 002). A static look at the source: the first of each, by line."""
    script = Path(script)
    try:
        tree = ast.parse(read_text(script, MAX_SCRIPT_BYTES), filename=str(script))
    except InputError as exc:
        raise ConfigError(exc.path, None, exc.problem, exc.fix or "check the --script path") from None
    except SyntaxError as exc:
        raise ConfigError(script, None, f"not valid Python at line {exc.lineno}: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise ConfigError(script, None, "nests too deep to parse", "name the training script itself") from None
    loads, configures = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            callee = ast.unparse(node.func)
            if name in _MODEL_LOADERS and "Tokenizer" not in callee and "Config." not in callee:
                loads.append(node.lineno)
            elif name.endswith(_DS_CONFIGURERS) or name in _DS_CONFIGURERS:
                configures.append(node.lineno)
    if not loads:
        return InitOrder("deepspeed_first", f"{script.name}: no from_pretrained/from_config call found", script)
    first_load = min(loads)
    first_conf = min(configures) if configures else None
    if first_conf is None or first_load < first_conf:
        after = (f", {script.name}:{first_conf} configures DeepSpeed" if first_conf
                 else ", and nothing configures DeepSpeed before it")
        return InitOrder("model_first", f"{script.name}:{first_load} builds the model{after}", script)
    return InitOrder("deepspeed_first", f"{script.name}:{first_conf} configures DeepSpeed before "
                     f"{script.name}:{first_load} builds the model", script)


def init_order_of(spec: JobSpec, default: InitOrder) -> InitOrder:
    """The order --script shows, else the format's (or the case file's) own."""
    return scan_init_order(spec.script) if spec.script is not None else default
