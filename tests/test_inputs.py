"""harness.models.inputs: the limits refuse what they should, name the key, and let ordinary files
through (anchors and merge keys included)."""

from __future__ import annotations

import os
import time

import pytest

from harness.models import inputs
from harness.models.inputs import InputError, load_json, load_yaml, parse_json, parse_yaml


def test_ordinary_anchors_and_merge_keys_still_read():
    data = parse_yaml("base: &b {lr: 1.0e-4, steps: 3}\nrun:\n  <<: *b\n  steps: 5\nagain: *b\n", "c.yaml")
    assert data == {"base": {"lr": 1e-4, "steps": 3}, "run": {"lr": 1e-4, "steps": 5},
                    "again": {"lr": 1e-4, "steps": 3}}


def test_the_expansion_limit_counts_each_use_of_an_alias(monkeypatch):
    monkeypatch.setattr(inputs, "MAX_YAML_NODES", 30)
    ten = "a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9]\n"
    assert parse_yaml(ten + "b: *a\n", "c.yaml")["b"] == list(range(1, 10))  # 1 + 2 x 10 + keys, under 30
    with pytest.raises(InputError, match="expands to more than 30 values"):
        parse_yaml(ten + "b: *a\nc: *a\n", "c.yaml")  # three uses of ten values


def test_nesting_at_the_limit_reads_and_one_deeper_is_refused():
    at_limit = "[" * inputs.MAX_DEPTH + "1" + "]" * inputs.MAX_DEPTH  # 64 lists, the innermost holding 1
    assert parse_json(at_limit, "x.json") is not None
    assert parse_yaml(at_limit, "x.yaml") is not None
    deeper = "[" + at_limit + "]"
    for parse, name in ((parse_json, "x.json"), (parse_yaml, "x.yaml")):
        with pytest.raises(InputError, match="nests deeper than 64 levels"):
            parse(deeper, name)


@pytest.mark.parametrize("text, key", [
    ('{"zero_optimization": {"stage": NaN}}', "zero_optimization.stage"),
    ('{"claims": [{"low": 1}, {"low": -Infinity}]}', "claims[1].low"),
    ('{"a": [[1e999]]}', "a[0][0]"),
    ('{"n": 9223372036854775808}', "n"),
    # long columns of one kind (a timeline's) are checked whole; a bad item is still named
    ('{"size": [' + "1," * 70_000 + '9223372036854775808]}', "size[70000]"),
    ('{"size": [-9223372036854775809, 1]}', "size[0]"),
    ('{"t_us": [0.5, 1.5, NaN, 2.5]}', "t_us[2]"),
    ('{"t_us": [0.5, 1e999]}', "t_us[1]"),
    ('{"x": [1, 2.0, "a", null, Infinity]}', "x[4]"),
])
def test_a_number_that_is_not_finite_or_beyond_64_bits_is_named_by_its_key(text, key):
    with pytest.raises(InputError) as caught:
        parse_json(text, "x.json")
    assert caught.value.key == key and str(caught.value).startswith(f"x.json: {key}: ")


def test_columns_of_plain_numbers_at_the_64_bit_limits_read():
    text = '{"size": [-9223372036854775808, 0, 9223372036854775807], "t_us": [0.0, 1.5], "s": ["a", true, null]}'
    assert parse_json(text, "x.json")["size"] == [-2**63, 0, 2**63 - 1]


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(InputError, match="not a regular file"):
        load_yaml(fifo)
    assert time.monotonic() - started < 1


def test_a_file_over_the_limit_is_refused_by_its_size_not_read(tmp_path):
    big = tmp_path / "runs.json"
    with open(big, "wb") as f:
        f.truncate(inputs.MAX_JSON_BYTES + 1)
    with pytest.raises(InputError, match="above the limit of 8 MiB"):
        load_json(big)
    with pytest.raises(InputError, match="binary"):  # read under a higher limit: its zero bytes are not text
        load_json(big, max_bytes=inputs.MAX_JSON_BYTES + 1)


def test_a_byte_order_mark_is_not_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xef\xbb\xbfa: 1\n")
    assert load_yaml(path) == {"a": 1}
