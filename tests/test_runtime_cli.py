"""The runtime's commands as a user meets them: `mxc run | generate | tokenize` hand over to
`python -m mxc.runtime`, flags and help come from the runtime, errors print once; and the
multi-process set-up read from flags or the environment."""

import subprocess

import numpy as np
import pytest

from mxc.runtime.distributed import ProcessSetup, setup_from
from runtime_support import MXC, PYTHON, cpu_env


def _mxc(*arguments, timeout=120):
    return subprocess.run([MXC, *arguments], env=cpu_env(), capture_output=True, text=True, timeout=timeout)


def test_run_help_is_the_runtimes():
    done = _mxc("run", "--help")
    assert done.returncode == 0
    assert "usage: mxc run" in done.stdout and "--ckpt-dir" in done.stdout and "--coordinator" in done.stdout


def test_missing_flags_are_usage_errors():
    done = _mxc("run", "some-artifact")
    assert done.returncode == 2 and "--data" in done.stderr


def test_a_missing_artifact_is_one_clear_error(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(100))
    done = _mxc("run", str(tmp_path / "nowhere"), "--data", str(tmp_path / "t.npy"), "--steps", "1",
                "--ckpt-dir", str(tmp_path / "ckpt"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("mxc: error: ")
    assert "Traceback" not in done.stderr


def test_tokenize_errors_name_the_file(tmp_path):
    done = _mxc("tokenize", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "t.bin"))
    assert done.returncode == 1 and "missing.txt" in done.stderr and "Traceback" not in done.stderr


def test_generate_with_an_artifact_needs_params(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    np.save(tmp_path / "p.npy", np.zeros((1, 4), np.int32))
    done = _mxc("generate", str(tmp_path), "--prompt-tokens", str(tmp_path / "p.npy"), "--max-new", "2",
                "-o", str(tmp_path / "o.npy"))
    assert done.returncode == 1 and "--params" in done.stderr


def test_python_m_mxc_runtime_is_the_same_command_line():
    done = subprocess.run([PYTHON, "-m", "mxc.runtime", "--help"], env=cpu_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and all(word in done.stdout for word in ("run", "generate", "tokenize"))


# ------------------------------------------------------------------ several processes

def test_single_process_when_no_coordinator_is_named():
    assert setup_from(environ={}) == ProcessSetup(None, 1, 0)
    assert not setup_from(environ={}).distributed


def test_flags_win_over_the_environment():
    environ = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert setup_from(environ=environ) == ProcessSetup("10.0.0.1:1234", 4, 3)
    assert setup_from("127.0.0.1:99", 2, 1, environ=environ) == ProcessSetup("127.0.0.1:99", 2, 1)


def test_cluster_detection_fills_in_count_and_id():
    # A coordinator alone: jax's cluster detection (TPU pods, SLURM, ...) supplies the rest.
    assert setup_from(environ={"JAX_COORDINATOR_ADDRESS": "host:1"}) == ProcessSetup("host:1", -1, -1)


@pytest.mark.parametrize("arguments, message", [
    ((None, 2, 0), "needs --coordinator"),
    (("h:1", 2, None), "both --num-processes and --process-id"),
    (("h:1", 2, 2), r"--process-id must be in \[0, 2\)"),
])
def test_inconsistent_flags_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        setup_from(*arguments, environ={})


def test_the_runtime_exits_only_after_its_background_imports(tmp_path, monkeypatch):
    """An interpreter that shuts down while a thread is inside a C++ extension's import aborts
    ("terminate called", exit -6, seen under load after a one-line error): main joins them first."""
    from mxc.runtime import cli

    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(1.0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "_BACKGROUND_IMPORTS", [])
    cli._import_in_background("slow_to_import")
    assert cli.main(["no-such-command"]) != 0
    assert not any(thread.is_alive() for thread in cli._BACKGROUND_IMPORTS)
