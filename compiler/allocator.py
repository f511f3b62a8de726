"""Compile on jemalloc where the host has it.

XLA's TPU code generator makes and frees millions of small objects per kernel: with glibc's
malloc a large share of a compile's time is in the allocator, and freed memory stays fragmented;
jemalloc compiles in less CPU time and a smaller peak (docs/compile.md has the measurements). An
allocator cannot be swapped inside a running process, so the commands that compile (`mxc compile`, `mxc plan`)
execute themselves again, once, with jemalloc preloaded, before anything heavy is imported.

Nothing changes where jemalloc is not installed (scripts/setup.sh installs Debian's libjemalloc2
where it can), where it is loaded already, or with MXC_ALLOCATOR=system. MALLOC_CONF, if set, is
the user's; otherwise `malloc_conf()`: one arena per 8 CPUs (jemalloc's default is 4 per CPU;
its per-thread caches take most of the traffic, and fewer arenas fragment less) and freed pages
handed back after 200 ms instead of 10 s (a lower peak for little CPU time).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ENV_CHOICE = "MXC_ALLOCATOR"  # "jemalloc" (the default) or "system"
ENV_DONE = "MXC_ALLOCATOR_EXECUTED"  # set on the re-executed process, so it happens at most once


def malloc_conf(cpus: int | None = None) -> str:
    cpus = cpus or os.cpu_count() or 1
    return f"narenas:{-(-cpus // 8)},dirty_decay_ms:200"


def find_jemalloc() -> str | None:
    """The jemalloc soname the dynamic linker can find, or None."""
    return ctypes.util.find_library("jemalloc")


def jemalloc_loaded() -> bool:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "jemalloc" in os.environ.get("LD_PRELOAD", "")
    return "libjemalloc" in maps


def current() -> str:
    """The allocator this process runs on: "jemalloc" or "system"."""
    return "jemalloc" if jemalloc_loaded() else "system"


def reexec_environment(environ: dict, library: str) -> dict:
    """The environment of the re-executed process: jemalloc first in LD_PRELOAD."""
    env = dict(environ)
    env["LD_PRELOAD"] = " ".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    env.setdefault("MALLOC_CONF", malloc_conf())
    env[ENV_DONE] = "1"
    return env


def compile_on_jemalloc() -> None:
    """Replace this process by the same command on jemalloc when that applies; otherwise return."""
    if os.environ.get(ENV_CHOICE, "jemalloc") != "jemalloc" or os.environ.get(ENV_DONE):
        return
    if not sys.platform.startswith("linux") or jemalloc_loaded():
        return
    library = find_jemalloc()
    if library is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # orig_argv keeps how Python was started (`mxc ...` as a script, or `python -m ...`).
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], reexec_environment(os.environ, library))
