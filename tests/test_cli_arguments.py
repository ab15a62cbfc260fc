"""Impossible numbers on the command line are usage errors (exit 2) naming the option, before any work:
a card of one byte divided by zero further on (exit 3), a search of 0, -5 or nan seconds and a host of
0 bytes were taken as given."""

from __future__ import annotations

import pytest

from harness.cli.main import main
from harness.spec.suite import EXAMPLE_CONFIGS_DIR

CONFIG = str(EXAMPLE_CONFIGS_DIR / "003-qwen7b-qlora-fix1.json")


@pytest.mark.parametrize("size", ["1B", "0GiB", "24MB"])
def test_a_card_or_host_of_a_few_bytes_is_refused_naming_the_option(size, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["case-from", CONFIG, "--gpu-memory", size, "--gpus", "1", "--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert f"argument --gpu-memory: '{size}' is less than 64 MiB" in said and "Traceback" not in said
    assert not out.exists()
    assert main(["check", CONFIG, "--gpu-memory", "24GiB", "--gpus", "1", "--host-ram", size]) == 2
    assert f"argument --host-ram: '{size}' is less than 64 MiB" in capsys.readouterr().err


def test_a_size_without_its_unit_is_refused_as_the_units_say():
    from harness.cli.arguments import memory_size

    assert memory_size("24GiB") == "24GiB"
    with pytest.raises(Exception, match="no unit"):
        memory_size("24")


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_search_of_no_time_is_refused(value, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["fit", CONFIG, "--gpu-memory", "24GiB", "--gpus", "1", "--out", str(out),
                 "--search-seconds", value]) == 2
    assert "argument --search-seconds:" in capsys.readouterr().err
    assert not out.exists()
