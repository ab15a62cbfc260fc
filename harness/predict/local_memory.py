"""What a cold Triton cache adds outside the allocator: CUDA local memory grown by spilling autotune candidates.

On a cold cache the Triton autotuner launches every candidate config of each autotuned kernel in the first
step; on a warm one flash-linear-attention reads the winners back and launches only them. When a kernel
whose threads need N bytes of local memory (stack frame, spills) is launched, the CUDA driver sizes the
context's local memory for N (plus a syscall stack, rounded up) on every thread the card keeps resident,
and keeps it for the process's life. The context starts sized for the default stack limit, so what a
cold cache adds is

    (round(max N + syscall) - round(default stack + syscall)) x multiprocessors x threads per multiprocessor

with N the largest over every candidate the step launches. N comes from compiling those candidates for
the card with the Triton release the job runs (`harness.predict.triton_kernels`, a survey), never from
memory runs: it is the same figure for every batch and every process.

Which Triton the job runs: the platform's device record names it (`python -m harness.runtime.device_probe`
writes the release beside the parts it measured); without one, the Triton installed here. A survey is
looked up in results/triton-kernels/ (kept with the project, with its provenance), then in the harness's
cache; where neither holds it and the installed Triton is the job's, it is compiled once (minutes) and
cached. Where it cannot be, a kept survey of the job's Triton for another flash-linear-attention release
stands in, else one of the Triton installed here; the note says which. With neither, there is no survey,
and the caller says so.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.measure.card_compute import CardCompute, card_compute
from harness.measure.device_parts import record_for
from harness.predict.constants import (
    CUDA_DEFAULT_STACK,
    CUDA_LOCAL_GRANULE,
    CUDA_SYSCALL_STACK,
    SURVEY_BATCH,
    SURVEY_TIMEOUT_S,
    GiB,
)
from harness.predict.device import DEVICE_DIR
from harness.predict.triton_kernels import Survey, cuobjdump
from harness.predict.triton_kernels import installed_version as _version  # a module name tests replace
from harness.runtime import compile_cache
from harness.spec.files import WriteError, write_atomic
from harness.spec.schema import Case
from harness.spec.suite import ROOT

SURVEY_DIR = ROOT / "results" / "triton-kernels"


def _rounded(n: int) -> int:
    return -(-n // CUDA_LOCAL_GRANULE) * CUDA_LOCAL_GRANULE


def growth_bytes(per_thread: int, resident_threads: int) -> int:
    """Local memory the driver adds when a kernel needing `per_thread` bytes a thread is first launched on a
    context still sized for the default stack."""
    grown = _rounded(per_thread + CUDA_SYSCALL_STACK) - _rounded(CUDA_DEFAULT_STACK + CUDA_SYSCALL_STACK)
    return max(0, grown) * resident_threads


@dataclass(frozen=True)
class SurveyKey:
    """What a step's Triton kernels depend on: the model's shapes, the sequence, the card, the releases."""

    model: str
    config_sha: str  # sha256 of the model's config.json, as built
    seq_len: int
    sm: int
    sms: int
    shared_per_block: int
    triton: str
    fla: str | None

    def file_name(self, fla: str | None = None) -> str:
        """The survey's file; `fla="*"` names every release of flash-linear-attention (a glob)."""
        fla = self.fla if fla is None else fla
        return (f"{self.model}-t{self.seq_len}-sm{self.sm}-{self.sms}sms-triton{self.triton}-fla{fla}-"
                f"{self.config_sha[:8]}.json")


def survey_key(case: Case, config: dict, card: CardCompute, triton: str) -> SurveyKey:
    sha = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return SurveyKey(model=case.model, config_sha=sha, seq_len=case.train.seq_len, sm=card.sm, sms=card.sms,
                     shared_per_block=card.shared_per_block,
                     triton=triton, fla=_version("fla-core"))


@dataclass(frozen=True)
class ColdLocalMemory:
    """The term, with what it stands on."""

    bytes: int  # per process
    survey: Survey
    card: CardCompute
    source: str  # the survey's file
    caveat: str = ""  # where the survey is not of the job's Triton or flash-linear-attention release

    def note(self) -> str:
        s = self.survey
        return (f"cold Triton cache: {self.bytes / GiB:.2f} GiB of CUDA local memory per process, from compiling "
                f"the step's {s.specializations} Triton kernel candidates for sm_{s.sm} with Triton {s.triton}: the "
                f"most a candidate needs is {s.max_bytes_per_thread:,} B a thread ({s.kernel}, {s.config}), kept on "
                f"{self.card.resident_threads:,} resident threads ({self.card.sms} SMs x {self.card.threads_per_sm}) "
                f"above the default stack ({self.source}){self.caveat}")


@dataclass(frozen=True)
class Unavailable:
    """Why no survey could be had, in words a user can act on."""

    reason: str


def job_triton(platform: str | None) -> tuple[str | None, str]:
    """The Triton release the platform's jobs run, and where that was read."""
    record, where = record_for(platform, DEVICE_DIR) if platform else (None, "")
    if record is not None and record.versions.get("triton"):
        return record.versions["triton"], f"the device record {Path(where).name}"
    installed = _version("triton")
    return installed, "the Triton installed here" if installed else "no Triton installed here"


def read_survey(path: Path) -> tuple[SurveyKey, Survey] | None:
    """A survey file's key and survey; None for one that cannot be read (damaged, cut short, or another
    schema's): it is then as if missing, and a compiled one replaces it in the cache."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return SurveyKey(**data["key"]), Survey(**data["survey"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_survey(key: SurveyKey, folders: list[Path], any_fla: bool = False) -> tuple[Survey, Path] | None:
    """The survey of exactly `key`; with `any_fla`, of `key` but for flash-linear-attention's release (the
    newest kept)."""
    for folder in folders:
        paths = sorted(folder.glob(key.file_name("*")), reverse=True) if any_fla else [folder / key.file_name()]
        for path in paths:
            read = read_survey(path) if path.is_file() else None
            if read is None:
                continue
            found_key, survey = read
            if found_key == key or (any_fla and dataclasses.replace(found_key, fla=key.fla) == key):
                return survey, path
    return None


def write_survey(path: Path, key: SurveyKey, survey: Survey, recorded: str | None = None) -> None:
    """Keep a survey whole or not at all (WriteError where it cannot be written)."""
    data = {"what": "per-thread local memory of every Triton kernel candidate one training step launches, "
                    "compiled for the card (harness.predict.triton_kernels); compiled, not run",
            "recorded": recorded or datetime.date.today().isoformat(), "key": asdict(key), "survey": asdict(survey)}
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def compile_survey(case: Case, card: CardCompute, key: SurveyKey, announce=None) -> Survey:
    """Compile the step's kernels in a child process (it changes Triton's driver for its whole life)."""
    if announce is not None:
        announce(f"compiling the Triton kernels of {case.model}'s step for sm_{card.sm} with Triton {key.triton}, "
                 f"once (minutes on a cold Triton cache; cached in {compile_cache.cache_dir()})")
    env = {**os.environ, "TRITON_CACHE_DIR": str(compile_cache.cache_dir() / "triton-survey")}
    command = [sys.executable, "-m", "harness.predict.triton_kernels", "--batch", str(SURVEY_BATCH),
               "--sm", str(card.sm), "--sms", str(card.sms), "--shared", str(card.shared_per_block),
               "--name", f"NVIDIA {card.name}", "--quiet"]
    with tempfile.TemporaryDirectory() as folder:
        case_json = Path(folder) / "case.json"
        case_json.write_text(case.model_dump_json(), encoding="utf-8")
        try:
            done = subprocess.run([*command, str(case_json)], capture_output=True, text=True, env=env,
                                  timeout=SURVEY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"compiling the step's Triton kernels did not finish in {SURVEY_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"compiling the step's Triton kernels failed (exit {done.returncode}):\n{tail}")
    try:
        return Survey(**json.loads(done.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError, TypeError) as exc:
        raise RuntimeError(f"the survey's process printed no survey ({type(exc).__name__}: {exc})") from None


def can_compile(triton: str | None) -> str | None:
    """None where the installed Triton is `triton` and has its NVIDIA compiler; else why not."""
    installed = _version("triton")
    if installed is None:
        return "no Triton is installed here to compile them"
    if installed != triton:
        return f"the Triton installed here is {installed}, not the job's {triton}"
    try:
        if not Path(cuobjdump()).is_file():
            return f"this Triton {installed} has no NVIDIA backend tools ({cuobjdump()})"
    except Exception as exc:  # an unusual Triton build: say so instead of failing the prediction
        return f"Triton {installed} cannot be used to compile ({type(exc).__name__}: {exc})"
    return None


def cold_local_memory(case: Case, config: dict, platform: str | None, announce=None) -> ColdLocalMemory | Unavailable:
    """The cold cache's local memory for the case's step on the platform's card, or why it is not known."""
    if platform is None:
        return Unavailable("no card named to size them on (`check --platform`, such as nvidia-h200-x1)")
    card = card_compute(platform)
    if card is None:
        return Unavailable(f"the card of {platform} is not in harness/measure/cards.json's compute table (its "
                           "compute capability, multiprocessors, threads and shared memory)")
    triton, where = job_triton(platform)
    if triton is None:
        return Unavailable(f"the job's Triton release is not known ({where}); record the platform with "
                           "`python -m harness.runtime.device_probe`")
    found = _kept_or_compiled(case, card, survey_key(case, config, card, triton), announce)
    if isinstance(found, Unavailable):
        installed = _version("triton")
        lacking = (f"no survey of {case.model}'s kernels at {case.train.seq_len} tokens for sm_{card.sm} with Triton "
                   f"{triton} (the job's, from {where}) and {found.reason}; compile one where Triton {triton} is "
                   f"installed: `python benchmarks/triton_autotune_stack.py --case CASE --platform {platform} --save`")
        if installed is None or installed == triton or can_compile(installed) is not None:
            return Unavailable(lacking)
        # another release's stacks are nearer the job's than any figure fitted on another model's runs
        found = _kept_or_compiled(case, card, survey_key(case, config, card, installed), announce)
        if isinstance(found, Unavailable):
            return Unavailable(f"{lacking}; with Triton {installed}, installed here: {found.reason}")
        found = (*found[:2], found[2] + f"; compiled with Triton {installed}, the one installed here, not the job's "
                 f"{triton} (from {where}): another release allocates registers and spills differently "
                 "(docs/predictor.md)")
    survey, path, caveat = found
    try:
        source = str(path.relative_to(ROOT))
    except ValueError:
        source = str(path)
    return ColdLocalMemory(growth_bytes(survey.max_bytes_per_thread, card.resident_threads), survey, card, source,
                           caveat)


def _kept_or_compiled(case: Case, card: CardCompute, key: SurveyKey,
                      announce) -> tuple[Survey, Path, str] | Unavailable:
    """The survey of `key` from results/triton-kernels/ or the cache, else compiled now and cached, else one
    kept for another release of flash-linear-attention (with a caveat to say so)."""
    cached = compile_cache.cache_dir() / "triton-kernels"
    found = find_survey(key, [SURVEY_DIR, cached])
    if found is not None:
        return *found, ""
    why_not = can_compile(key.triton)
    if why_not is None:
        try:
            survey = compile_survey(case, card, key, announce)
        except RuntimeError as exc:
            why_not = str(exc)
        else:
            path = cached / key.file_name()
            try:
                write_survey(path, key, survey)
            except WriteError as exc:  # the figure stands; the next prediction compiles it again
                return survey, path, f"; not kept in the cache: {exc}"
            return survey, path, ""
    other = find_survey(key, [SURVEY_DIR, cached], any_fla=True)
    if other is not None:
        survey, path = other
        return survey, path, (f"; surveyed with flash-linear-attention {survey.fla}, not the {key.fla} installed "
                              "here: its kernels and candidates may differ")
    return Unavailable(why_not)
