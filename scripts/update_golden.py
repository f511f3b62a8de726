"""Regenerate tests/golden/ (the zoo's resolved IR and the seeded recipes' plans) from the code as
it is now, removing golden files nothing produces any more. Review the diff before committing.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python scripts/update_golden.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from golden_files import GOLDEN, golden_files, stored_files  # noqa: E402


def main() -> int:
    files = golden_files()
    for name in sorted(stored_files() - set(files)):
        (GOLDEN / name).unlink()
        print(f"removed {name}")
    changed = 0
    for name, produce in sorted(files.items()):
        path = GOLDEN / name
        text = produce()
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed += 1
            print(f"wrote {name}")
    print(f"{len(files)} golden files, {changed} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
