"""units.py picks the unit of every size, time and rate mxc prints; plan and topologies use it."""

import re

import pytest

from mxc.compiler import cli
from mxc.compiler.commands import units


@pytest.mark.parametrize("seconds, text", [
    (2.17e-06, "2.17 us"), (0.0183, "18.3 ms"), (0.5, "500 ms"), (59.9, "59.9 s"), (90, "1.5 min"),
    (5400, "1.5 h"), (3e-10, "0.3 ns"), (0, "0 s"), (0.0009996, "1 ms"),
])
def test_duration_picks_the_unit(seconds, text):
    assert units.duration(seconds) == text


def test_rates_and_sizes():
    assert units.rate(2.21e8, "tokens/s") == "221M tokens/s"
    assert units.rate(12.5, "tokens/s") == "12.5 tokens/s"
    assert units.size_bytes(6521856) == "6.22 MiB"
    assert units.size_bytes(0) == "0 B" and units.size_bytes(512.0) == "512 B"
    assert units.size_in(95 * 2**30) == "95.00" and units.size_in(int(95.73 * 2**30)) == "95.73"


# A number printed as 0.0 of a large unit, or in exponent notation, says nothing.
UNREADABLE = re.compile(r"\b0\.0+ (GiB|MiB|s|ms)\b|\d\.?\d*e-\d+")


def test_plan_explain_prints_each_number_in_its_own_unit(capsys):
    code = cli.main(["plan", "llama3-tiny", "--topology", "v5p-8", "--seq", "64", "--batch", "16",
                     "--no-verify", "--explain"])
    out = capsys.readouterr().out
    assert code == 0 and "MiB" in out and " us" in out, out
    assert not UNREADABLE.search(out), UNREADABLE.search(out)


def test_topologies_show_hbm_and_usable_in_the_same_unit_and_precision(capsys):
    assert cli.main(["topologies"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if " v5p " in line)
    cells = [c.strip() for c in re.split(r"[│|]", row) if c.strip()]
    assert cells[2:4] == ["95.00", "95.73"]


def test_compile_progress_picks_the_unit_of_each_time():
    from rich.console import Console

    from mxc.compiler.commands.compile import ProgressView

    console = Console(record=True, width=120)
    view = ProgressView(console)
    view.end("train_step: compile", 0.0183, 42.0)
    line = console.export_text()
    assert "18.3 ms" in line and "(cpu 42 s)" in line, line
