"""runtime/program.py's guards against calls that crash jaxlib (issue 22): a donated argument passed
again. Each call runs in a child process, so a segfault fails the test instead of killing pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from runtime_support import PYTHON, compile_tiny, cpu_env  # noqa: E402

CHILDREN = Path(__file__).parent / "children"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return compile_tiny(tmp_path_factory.mktemp("program") / "tiny")


def test_a_donated_state_passed_again_is_an_error_not_a_crash(artifact):
    done = subprocess.run([PYTHON, str(CHILDREN / "train_twice.py"), str(artifact)], env=cpu_env(8),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "argument state.step was donated to a previous call" in done.stdout


def test_an_executable_that_does_not_match_its_manifest_is_refused_at_load(artifact, tmp_path):
    import json
    import shutil

    from mxc.runtime.artifact import manifest_digest

    swapped = tmp_path / "swapped"
    shutil.copytree(artifact, swapped)
    manifest = json.loads((swapped / "manifest.json").read_text())
    # eval_step now names prefill's executable: every file's hash still holds, the parameters do not.
    manifest["functions"]["eval_step"]["executable"] = "prefill.executable"
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (swapped / "manifest.json").write_text(json.dumps(manifest))
    done = subprocess.run([PYTHON, str(CHILDREN / "load_and_eval.py"), str(swapped)], env=cpu_env(8),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    # prefill takes one array per layer on a CPU (runtime/layer_layout.py): 23 for the 2-layer tiny model.
    assert "prefill.executable takes 23 parameters, but the manifest lists 17 inputs of eval_step" in done.stdout
