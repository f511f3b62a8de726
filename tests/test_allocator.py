"""The compiling commands run on jemalloc where the host has it, and only they."""

import json
import subprocess
from pathlib import Path

from artifact_builds import MXC, clean_env
from mxc.compiler import allocator
from mxc.runtime import allocator as runtime_allocator


def compile_tiny(tmp_path: Path, topology="cpu-8", function="init", **env: str) -> dict:
    inherited = ("LD_PRELOAD", "MALLOC_CONF", allocator.ENV_CHOICE, allocator.ENV_DONE)
    environ = {k: v for k, v in clean_env(tmp_path).items() if k not in inherited} | env
    output = tmp_path / f"{topology}-{function}-{env.get('MXC_ALLOCATOR', 'default')}"
    done = subprocess.run([str(MXC), "compile", "llama3-tiny", "--topology", topology, "--functions", function,
                           "--seq", "32", "--batch", "8", "--no-cache", "-o", str(output), "--json"],
                          capture_output=True, text=True, env=environ, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout), "files": json.loads((output / "manifest.json").read_text())["files"]}


def test_compile_runs_on_jemalloc_when_installed_and_on_the_system_allocator_when_asked(tmp_path):
    expected = "jemalloc" if allocator.find_jemalloc() else "system"
    assert compile_tiny(tmp_path)["allocator"] == expected
    assert compile_tiny(tmp_path, MXC_ALLOCATOR="system")["allocator"] == "system"


def test_the_allocator_does_not_change_the_program(tmp_path):
    # A TPU executable is byte-for-byte the same program whichever allocator compiled it.
    system = compile_tiny(tmp_path, "v5e-8", "train_step", MXC_ALLOCATOR="system")
    default = compile_tiny(tmp_path, "v5e-8", "train_step")
    assert system["files"]["train_step.executable"] == default["files"]["train_step.executable"]


def test_the_reexecuted_environment_preloads_jemalloc_once_and_keeps_the_users_settings():
    env = allocator.reexec_environment({"LD_PRELOAD": "libfoo.so", "PATH": "/bin"}, "libjemalloc.so.2")
    assert env["LD_PRELOAD"] == "libjemalloc.so.2 libfoo.so"
    assert env["MALLOC_CONF"] == allocator.malloc_conf()
    assert env[allocator.ENV_DONE] == "1" and env["PATH"] == "/bin"
    mine = allocator.reexec_environment({"MALLOC_CONF": "narenas:4"}, "libjemalloc.so.2")
    assert mine["MALLOC_CONF"] == "narenas:4" and mine["LD_PRELOAD"] == "libjemalloc.so.2"
    assert allocator.malloc_conf(2).startswith("narenas:1,") and allocator.malloc_conf(64).startswith("narenas:8,")


def test_in_process_callers_are_never_reexecuted(capsys, monkeypatch):
    # main(argv) is how tests and embedding programs call the CLI: it must not replace the process.
    from mxc.compiler import cli

    monkeypatch.setattr(runtime_allocator.os, "execve", lambda *a: (_ for _ in ()).throw(AssertionError("exec")))
    assert cli.main(["compile", "no-such-model", "--topology", "cpu-8"]) == 1
    assert "no-such-model" in capsys.readouterr().err
