"""Run by test_packaging with the installed wheel's python: imports each module named on the
command line and prints, as JSON, the file each came from and what the zoo's llama3.1-8b loads as.
Run as a script (its folder, tests/, is on sys.path, the repository is not), so mxc can only come
from the wheel."""

import importlib
import json
import sys


def main(modules: list[str]) -> None:
    files = {name: importlib.import_module(name).__file__ for name in modules}
    from mxc.spec import load_model

    spec = load_model("llama3.1-8b")
    print(json.dumps({"files": files, "name": spec.name, "layers": spec.num_layers}))


if __name__ == "__main__":
    main(sys.argv[1:])
