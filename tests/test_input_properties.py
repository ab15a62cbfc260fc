"""Property tests: the example configs and the bundled case files, mutated at random (values, types,
keys, nesting), and random command-line values, never make a command crash (exit 3 or a traceback),
hang, or write outside its output folder. Deterministic (derandomized, no example database) and
small enough for a two-core CI job; the predictor is replaced by a fixed figure, so each example
costs milliseconds (the prediction itself is tested in test_predict)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from fixed_prediction import fixed_prediction
from hostile import CASES, EXAMPLES, invoke
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.premerge import check
from harness.spec.units import GIB

# examples per test: the profile's (tests/conftest.py: 30 in the default tier, `--hypothesis-profile deep` for more)
PROPERTY = settings(deadline=timedelta(seconds=5), derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TRAINING_CONFIGS = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".yaml", ".json")
                          and not p.name.startswith("ds_") and p.name != "premerge.yaml")
DEEPSPEED_CONFIGS = sorted(EXAMPLES.glob("ds_*.json"))
CASE_FILES = sorted(CASES.glob("*.yaml"))


def _fixed_predictor():
    return lambda case, arch=None, **kw: fixed_prediction(20 * GIB, 22 * GIB, 24 * GIB, 40 * GIB)


@pytest.fixture(autouse=True)
def _predicted(monkeypatch):
    monkeypatch.setattr(check, "_predictor", _fixed_predictor)


@pytest.fixture(scope="module", autouse=True)
def _check_loaded():
    """`check` imports the training stack (torch, transformers, DeepSpeed) on its first call: seconds,
    more on a loaded machine, that the deadline would count against whichever example came first."""
    from harness.cli.main import main

    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        mp.setattr(check, "_predictor", _fixed_predictor)
        main(["check", str(TRAINING_CONFIGS[0]), "--gpu-memory", "24GiB", "--gpus", "1"])


# --- Strategies ---------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["auto", "64", "64GiB", "1e999", "nan", "-inf", "../../x", "/dev/zero", "true", "none",
                     "q_proj,v_proj", "all", "cpu", "bf16", "0", "-1", "3", "deepspeed", "lora", "qlora", ""]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)


def _paths(data, prefix=()):
    """Every key path in a nested mapping/list, for a mutation to aim at."""
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, (*prefix, i))


def _set(data, path, value):
    if not path:
        return value
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = value
    return data


def _delete(data, path):
    if not path:
        return data
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    del parent[path[-1]]
    return data


@st.composite
def mutated(draw, data):
    """`data` with one to three mutations: a value replaced (any type), a key removed, a key added,
    a value buried in nesting."""
    data = json.loads(json.dumps(data, default=str))
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(data))
        path = draw(st.sampled_from(paths))
        kind = draw(st.sampled_from(["replace", "delete", "add", "nest"]))
        if kind == "replace":
            data = _set(data, path, draw(VALUES))
        elif kind == "delete":
            data = _delete(data, path)
        elif kind == "add":
            target = data
            for part in path:
                target = target[part]
            if isinstance(target, dict):
                target[draw(st.text(min_size=1, max_size=10))] = draw(VALUES)
        else:
            target = data
            for part in path:
                target = target[part]
            data = _set(data, path, draw(st.sampled_from([[target], {"value": target}, [[target]]])))
    return data


def _write(data, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(data))
    else:
        path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


def _load(path: Path):
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


def _work() -> Path:
    work = Path(tempfile.mkdtemp(prefix="oom-harness-prop-"))
    (work / "in").mkdir()
    for ds in DEEPSPEED_CONFIGS:
        shutil.copy(ds, work / "in" / ds.name)
    return work


def _only_inside(work: Path) -> None:
    """Nothing written in the scratch folder outside its input and output folders."""
    stray = [p for p in work.rglob("*") if p.is_file() and p.relative_to(work).parts[0] not in ("in", "out")]
    assert not stray, stray


# --- Properties ---------------------------------------------------------------------------------


@PROPERTY
@given(st.sampled_from(TRAINING_CONFIGS).flatmap(lambda p: st.tuples(st.just(p), mutated(_load(p)))))
def test_check_answers_any_mutated_training_config(capsys, example):
    source, data = example
    work = _work()
    try:
        path = _write(data, work / "in" / source.name)
        outcome = invoke(["check", path, "--gpu-memory", "64GiB", "--gpus", "8"], capsys, work, limit_s=10)
        if outcome.code == 2:
            assert len(outcome.err_lines) == 1
        else:
            assert "verdict:" in outcome.out
        _only_inside(work)
    finally:
        shutil.rmtree(work)


@PROPERTY
@given(st.sampled_from(DEEPSPEED_CONFIGS).flatmap(lambda p: st.tuples(st.just(p), mutated(_load(p)))))
def test_check_answers_any_mutated_deepspeed_config(capsys, example):
    source, data = example
    work = _work()
    try:
        ds = _write(data, work / "in" / f"mutated-{source.name}")
        config = shutil.copy(EXAMPLES / "000-ds32b-optimized.yaml", work / "in")
        outcome = invoke(["check", config, "--gpu-memory", "64GiB", "--gpus", "8", "--deepspeed", ds], capsys, work,
                         limit_s=10)
        assert outcome.code != 2 or len(outcome.err_lines) == 1
        _only_inside(work)
    finally:
        shutil.rmtree(work)


@PROPERTY
@given(st.sampled_from(CASE_FILES).flatmap(lambda p: st.tuples(st.just(p), mutated(_load(p)))))
def test_validate_and_check_answer_any_mutated_case_file(capsys, example):
    source, data = example
    work = _work()
    try:
        for other in CASE_FILES:  # the cases its claims name
            shutil.copy(other, work / "in" / other.name)
        path = _write(data, work / "in" / source.name)
        validated = invoke(["validate", path], capsys, work, limit_s=10)
        assert validated.code in (0, 2)
        checked = invoke(["check", path], capsys, work, limit_s=10)
        if validated.code == 2:  # what validate refuses, check refuses too (the same reader and schema)
            assert checked.code == 2
        _only_inside(work)
    finally:
        shutil.rmtree(work)


ARGUMENT_TEXT = st.one_of(
    st.text(max_size=12),
    st.from_regex(r"-?[0-9]{0,12}(\.[0-9]{0,4})?(e-?[0-9]{1,4})? ?(GiB|GB|MiB|B|TiB|gib|xB)?", fullmatch=True),
    st.sampled_from(["nan", "inf", "-inf", "NaN GiB", "1e999", "0", "-0", "64", "0x40", "1_000", "६४GiB"]),
)


@PROPERTY
@given(flag=st.sampled_from(["--gpu-memory", "--host-ram", "--gpus", "--procs-per-gpu", "--headroom"]),
       value=ARGUMENT_TEXT)
def test_check_answers_any_job_argument(capsys, flag, value):
    work = _work()
    try:
        argv = ["check", EXAMPLES / "000-ds32b-optimized.yaml", "--gpu-memory", "64GiB", "--gpus", "8"]
        outcome = invoke([*argv, f"{flag}={value}"], capsys, work, limit_s=10)
        if outcome.code == 2:
            assert flag in outcome.err
        _only_inside(work)
    finally:
        shutil.rmtree(work)


@PROPERTY
@given(flag=st.sampled_from(["--timeout", "--steps", "--repeat", "--jobs", "--grad-accum-cap", "--shard", "--variant",
                             "--select", "--fidelity", "--json", "--benchmark-json", "--case-dir"]),
       value=ARGUMENT_TEXT)
def test_run_refuses_or_matches_nothing_for_any_argument(capsys, flag, value):
    """No argument makes `run` start a case when none matches: exit 2 (refused) or 2 (no case matches)."""
    work = _work()
    try:
        outcome = invoke(["run", "-k", "no-such-case-id", "--out", work / "out", f"{flag}={value}"], capsys, work,
                         limit_s=10)
        assert outcome.code == 2
        assert not any((work / "out").rglob("run.json")) if (work / "out").exists() else True
        _only_inside(work)
    finally:
        shutil.rmtree(work)


@PROPERTY
@given(case_id=st.text(max_size=20), source=st.sampled_from(TRAINING_CONFIGS))
def test_case_from_writes_only_inside_its_out_folder(capsys, case_id, source):
    work = _work()
    try:
        config = shutil.copy(source, work / "in")
        outcome = invoke(["case-from", config, "--gpu-memory", "64GiB", "--gpus", "8", "--out", work / "out",
                          f"--id={case_id}"], capsys, work, limit_s=10)
        written = [p for p in (work / "out").rglob("*")] if (work / "out").exists() else []
        if outcome.code == 0:  # one case file, in --out, named by --id (by the config's name without one)
            assert len(written) == 1 and written[0].parent == work / "out"
            assert written[0].name == f"{case_id or written[0].stem}.yaml"
        else:
            assert outcome.code == 2 and not written
        _only_inside(work)
    finally:
        shutil.rmtree(work)
