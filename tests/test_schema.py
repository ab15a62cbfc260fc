"""The case schema accepts what the guides need and rejects typos and impossible values with a
message naming the file, the field and what is allowed."""

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.spec.cases import CASES_DIR, CaseError, case_files, load_case, load_cases, parse_case
from harness.spec.schema import Case

BASE_FILE = CASES_DIR / "003-qlora-fix-r32-seq1024-gc.yaml"
BASE = yaml.safe_load(BASE_FILE.read_text())
ZERO_FILE = CASES_DIR / "000-lora-z3-offload-aggressive-cutoff512-ga32.yaml"
ZERO_BASE = yaml.safe_load(ZERO_FILE.read_text())
WHERE = Path("cases/some-case.yaml")

# Blocks of the base case and the keys the schema knows in each.
BLOCKS = {
    (): set(Case.model_fields),
    ("train",): set(BASE["train"]) | {"prefetch_factor", "logits_to_keep", "attn_implementation"},
    ("method",): {"kind", "lora", "quantization"},
    ("method", "lora"): {"r", "alpha", "dropout", "targets"},
    ("target",): {"card", "headroom", "host_ram"},
    ("target", "card"): {"vendor", "name", "memory", "count"},
}


def _at(data, path):
    for key in path:
        data = data[key]
    return data


def _error(data) -> CaseError:
    with pytest.raises(CaseError) as info:
        parse_case(data, WHERE)
    return info.value


@pytest.mark.parametrize("path", sorted(case_files()), ids=lambda p: p.stem)
def test_every_case_file_in_the_repo_is_valid(path):
    case = load_case(path)
    assert case.id == path.stem


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    micro_batch=st.integers(1, 64),
    grad_accum=st.integers(1, 256),
    seq_len=st.integers(16, 32768),
    r=st.integers(1, 256),
    headroom=st.floats(0.05, 1.0),
    memory=st.sampled_from(["16 GB", "23.52 GiB", "64GB", "80 GiB", "17179869184 B"]),
)
def test_valid_variations_are_accepted(micro_batch, grad_accum, seq_len, r, headroom, memory):
    data = copy.deepcopy(BASE)
    data["train"].update(micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len)
    data["method"]["lora"]["r"] = r
    data["target"]["headroom"] = headroom
    data["target"]["card"]["memory"] = memory
    case = parse_case(data, WHERE)
    assert case.train.seq_len == seq_len and case.method.lora.r == r
    assert case.budget_bytes == int(case.target.card.memory * headroom)


@settings(max_examples=60)
@given(
    block=st.sampled_from(sorted(BLOCKS)),
    key=st.text("abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=20),
)
def test_unknown_keys_are_rejected_with_file_field_and_allowed_keys(block, key):
    if key in BLOCKS[block]:
        return
    data = copy.deepcopy(BASE)
    _at(data, block)[key] = 1
    err = _error(data)
    text = str(err)
    assert str(WHERE) in text
    assert f"unknown key '{key}'" in text
    assert ".".join([*block, key]) in text
    some_allowed = sorted(BLOCKS[block])[0]
    assert "allowed keys here" in text and some_allowed in text


@settings(max_examples=40)
@given(
    field=st.sampled_from([("train", "micro_batch"), ("train", "seq_len"), ("train", "grad_accum"),
                           ("method", "lora", "r"), ("target", "headroom")]),
    value=st.one_of(st.text("xyz", min_size=1, max_size=5), st.lists(st.integers(), max_size=2)),
)
def test_wrong_types_are_rejected_naming_the_field(field, value):
    data = copy.deepcopy(BASE)
    _at(data, field[:-1])[field[-1]] = value
    text = str(_error(data))
    assert ".".join(field) in text


@pytest.mark.parametrize(
    "path, value, expect",
    [
        (("layers",), 0, ["layers", "greater than 0"]),
        (("train", "seq_len"), 0, ["train.seq_len", "greater than 0"]),
        (("train", "micro_batch"), -2, ["train.micro_batch"]),
        (("target", "headroom"), 1.5, ["target.headroom", "less than or equal to 1"]),
        (("target", "card", "memory"), "64 GX", ["target.card.memory", "unknown unit"]),
        (("target", "card", "vendor"), "intel", ["target.card.vendor", "'nvidia'", "'hygon'"]),
        (("method", "kind"), "prefix", ["method.kind", "'lora'", "'qlora'", "'full'"]),
        (("model",), "qwen-9000", ["model", "unknown model", "qwen1.5-7b-chat"]),
        (("layers",), 33, ["exceeds", "32 layers"]),
        (("train", "attn_implementation"), "flash", ["train.attn_implementation", "'eager'", "'sdpa'",
                                                     "'flash_attention_2'"]),
    ],
)
def test_impossible_values_are_rejected_with_the_allowed_ones(path, value, expect):
    data = copy.deepcopy(BASE)
    _at(data, path[:-1])[path[-1]] = value
    text = str(_error(data))
    for part in expect:
        assert part in text, text


def test_zero_stage_5_names_the_allowed_stages():
    data = copy.deepcopy(ZERO_BASE)
    data["deepspeed"]["stage"] = 5
    text = str(_error(data))
    assert "deepspeed.stage" in text and "0, 1, 2 or 3" in text


def test_contradictions_between_blocks_are_explained():
    data = copy.deepcopy(ZERO_BASE)
    data["deepspeed"]["stage"] = 2  # keeps stage-3-only thresholds and param offload
    text = str(_error(data))
    assert "offload_param needs stage 3" in text


def test_a_bad_file_does_not_stop_the_others(tmp_path):
    good = tmp_path / BASE_FILE.name
    good.write_text(BASE_FILE.read_text())
    bad = tmp_path / "003-broken.yaml"
    bad.write_text(BASE_FILE.read_text().replace("seq_len: 1024", "seq_lenn: 1024"))
    unparsable = tmp_path / "003-unparsable.yaml"
    unparsable.write_text("id: [unclosed\n")
    cases, errors = load_cases(tmp_path)
    assert [c.id for c in cases] == [BASE["id"]]
    messages = {e.path.name: str(e) for e in errors}
    assert "unknown key 'seq_lenn'" in messages["003-broken.yaml"]
    assert "train.seq_len: Field required" in messages["003-broken.yaml"]
    assert "not valid YAML at line" in messages["003-unparsable.yaml"]


def test_the_file_name_must_match_the_id(tmp_path):
    wrong = tmp_path / "003-another-name.yaml"
    wrong.write_text(BASE_FILE.read_text())
    with pytest.raises(CaseError, match="must equal the file name"):
        load_case(wrong)


def test_a_claim_naming_a_missing_case_is_reported(tmp_path):
    data = copy.deepcopy(BASE)
    data["claims"].append({"kind": "lower_peak_than", "case": "003-nowhere", "quote": "x"})
    (tmp_path / BASE_FILE.name).write_text(yaml.safe_dump(data, allow_unicode=True))
    _, errors = load_cases(tmp_path)
    assert any("003-nowhere" in str(e) for e in errors)


def _own_case(**edits) -> dict:
    """The base case as a team writes it: no guide, a `source` saying where it comes from."""
    data = copy.deepcopy(BASE)
    data.pop("guide")
    data.update(id="nightly-sft_qwen7b.r32", source={"title": "the team's nightly SFT config",
                                                     "url": "https://example.org/wiki/nightly-sft"})
    data.update(edits)
    return data


def test_a_case_needs_no_guide_and_may_name_its_source():
    case = parse_case(_own_case(), WHERE)
    assert case.guide is None and case.source.title == "the team's nightly SFT config"
    for claim in case.claims:
        assert claim.quote  # the base case's claims keep their words
    # a claim without a quote: a team's case checks behaviour, not someone's sentence
    bare = parse_case(_own_case(claims=[{"kind": "trains"}]), WHERE)
    assert bare.claims[0].quote is None


def test_a_source_and_a_prediction_are_strict_and_sized():
    text = str(_error(_own_case(source={"title": "x", "link": "https://example.org"})))
    assert "source.link: unknown key 'link'" in text and "url" in text
    predicted = {"per_card_peak": "17.5 GiB", "allocated": "15 GiB", "calibration": "pooled",
                 "predictor_version": "0.1.0", "date": "2026-11-26"}
    case = parse_case(_own_case(predicted=predicted), WHERE)
    assert case.predicted.per_card_peak == int(17.5 * 2**30)
    assert "predicted.date" in str(_error(_own_case(predicted=dict(predicted, date="26.11.2026"))))


def test_a_guide_number_still_binds_the_id_prefix():
    text = str(_error(_own_case(guide="003")))
    assert "must start with its guide number '003-'" in text


@pytest.mark.parametrize("bad_id", ["../escape", "a/b", "a\\b", "a..b", ".hidden", "-rf", "with space", "",
                                    "x" * 201, "naïve"])
def test_case_ids_must_be_safe_file_names(bad_id):
    text = str(_error(_own_case(id=bad_id)))
    assert str(WHERE) in text and "id:" in text


@pytest.mark.parametrize("good_id", ["nightly-sft", "Llama3.1_8B-lora-r16", "7b", "003-qlora-fix-r32-seq1024-gc"])
def test_case_ids_are_free_names(good_id):
    assert parse_case(_own_case(id=good_id), WHERE).id == good_id


@pytest.mark.parametrize("attn", ["eager", "sdpa", "flash_attention_2"])
def test_a_case_may_name_its_attention_kernel(attn):
    data = copy.deepcopy(BASE)
    data["train"]["attn_implementation"] = attn
    assert parse_case(data, WHERE).train.attn_implementation == attn


def test_the_attention_kernel_is_part_of_what_a_run_measured_only_where_named():
    """A case that names no kernel keeps the digest of a case written before the field (its runs
    bless as before); naming one changes it (a run of another kernel is another config's figure)."""
    from harness.spec.identity import case_digest

    base = parse_case(copy.deepcopy(BASE), WHERE)
    assert base.train.attn_implementation is None
    legacy = base.model_dump(mode="json", include={"layers", "stack", "precision", "method", "train", "deepspeed",
                                                   "launch"})
    from harness.spec.identity import ADDED_LATER

    for block, key in ADDED_LATER:  # every field added after runs were recorded, here at its default
        del legacy[block][key]
    import hashlib
    import json

    from harness.spec.identity import model_name

    legacy.update(card=base.target.card.model_dump(mode="json"), model=model_name(base))
    assert case_digest(base) == hashlib.sha256(json.dumps(legacy, sort_keys=True).encode()).hexdigest()[:16]
    data = copy.deepcopy(BASE)
    data["train"]["attn_implementation"] = "eager"
    assert case_digest(parse_case(data, WHERE)) != case_digest(base)
