"""Every golden file equals what the code produces now; a difference prints the diff and the
command that regenerates them (scripts/update_golden.py)."""

import difflib

import pytest

from golden_files import GOLDEN, UPDATE_COMMAND, golden_files, stored_files

FILES = golden_files()


@pytest.mark.parametrize("name", sorted(FILES))
def test_golden_file_is_current(name):
    path = GOLDEN / name
    assert path.exists(), f"no golden file tests/golden/{name}; create it with: {UPDATE_COMMAND}"
    stored, now = path.read_text(), FILES[name]()
    if stored != now:
        diff = "".join(difflib.unified_diff(stored.splitlines(True), now.splitlines(True),
                                            f"tests/golden/{name} (stored)", f"{name} (the code now)"))
        pytest.fail(f"{diff}\nIf the change is intended, regenerate with: {UPDATE_COMMAND}", pytrace=False)


def test_no_stale_golden_files():
    stale = sorted(stored_files() - set(FILES))
    assert not stale, f"golden files nothing produces any more: {stale}; remove with: {UPDATE_COMMAND}"
