"""Run a process on jemalloc where the host has it: restart the command once with it preloaded.

An allocator cannot be swapped inside a running process, so a command that wants jemalloc
executes itself again, before anything heavy is imported, with jemalloc in LD_PRELOAD and a
MALLOC_CONF of its own (a MALLOC_CONF the user set wins). Nothing changes where jemalloc is not
installed (scripts/setup.sh installs Debian's libjemalloc2 where it can), where it is loaded
already, where the process was restarted once, or with MXC_ALLOCATOR=system.

Two users: compiling (mxc.compiler.allocator: XLA's TPU code generator makes and frees millions
of small objects) and training (`train_on_jemalloc`). A CPU train step's buffers are large and
come back at the same sizes every step; glibc's malloc serves each from a fresh mmap and unmaps it
on free, so the kernel faults in and zeroes every page again on every step. jemalloc told never to
hand freed pages back reuses them, and the pages stay as large as the step's peak, which the next
step needs anyway (measurements: docs/runtime.md, "Page faults").
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ENV_CHOICE = "MXC_ALLOCATOR"  # "jemalloc" (the default) or "system"
ENV_DONE = "MXC_ALLOCATOR_EXECUTED"  # set on the re-executed process, so it happens at most once


def arenas(cpus: int | None = None) -> str:
    """One arena per 8 CPUs (jemalloc's default is 4 per CPU; its per-thread caches take most of
    the traffic, and fewer arenas fragment less)."""
    cpus = cpus or os.cpu_count() or 1
    return f"narenas:{-(-cpus // 8)}"


def training_malloc_conf(cpus: int | None = None) -> str:
    """Freed pages are never purged: every step reuses the previous step's pages. They are
    transparent huge pages where the kernel allows them (its `madvise` setting): fewer TLB misses
    in the step's passes over its large buffers."""
    return f"{arenas(cpus)},dirty_decay_ms:-1,muzzy_decay_ms:-1,thp:always"


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


def reexec_environment(environ: dict, library: str, malloc_conf: str) -> dict:
    """The environment of the re-executed process: jemalloc first in LD_PRELOAD."""
    env = dict(environ)
    env["LD_PRELOAD"] = " ".join(p for p in (library, environ.get("LD_PRELOAD", "")) if p)
    env.setdefault("MALLOC_CONF", malloc_conf)
    env[ENV_DONE] = "1"
    return env


def restart_on_jemalloc(malloc_conf: str) -> None:
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
    # orig_argv keeps how Python was started (`mxc ...` as a script, `python -m ...`, `python -c ...`).
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              reexec_environment(os.environ, library, malloc_conf))


def train_on_jemalloc() -> None:
    """For a training process, before jax is imported: jemalloc keeping its freed pages."""
    restart_on_jemalloc(training_malloc_conf())
