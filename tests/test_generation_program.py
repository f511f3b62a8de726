"""runtime/program.py's guards against calls that crash jaxlib (issue 22): a donated argument passed
again. Each call runs in a child process, so a segfault fails the test instead of killing pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from runtime_support import PYTHON, compile_tiny, cpu_env  # noqa: E402

_TRAIN_TWICE = textwrap.dedent("""
    import sys
    import numpy as np
    from mxc.runtime.program import load

    program = load(sys.argv[1])
    batch = {leaf.path[1]: np.zeros(leaf.shape, leaf.dtype)
             for leaf in program.manifest.functions["train_step"].inputs if leaf.path[0] == 1}
    state = program.init(0)
    program.train_step(state, batch)
    try:
        program.train_step(state, batch)  # the same state again: its buffers went to the first call
    except ValueError as err:
        print(err)
        sys.exit(0)
    sys.exit(5)
""")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return compile_tiny(tmp_path_factory.mktemp("program") / "tiny")


def test_a_donated_state_passed_again_is_an_error_not_a_crash(artifact):
    done = subprocess.run([PYTHON, "-c", _TRAIN_TWICE, str(artifact)], env=cpu_env(8), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "argument state.step was donated to a previous call" in done.stdout
