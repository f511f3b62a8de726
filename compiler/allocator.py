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

# The mechanism (find jemalloc, restart once with it preloaded) is the runtime's, which trains on
# it too; compiling differs only in its MALLOC_CONF.
from mxc.runtime.allocator import (ENV_CHOICE, ENV_DONE, arenas, current, find_jemalloc,  # noqa: F401
                                   jemalloc_loaded, restart_on_jemalloc)
from mxc.runtime.allocator import reexec_environment as _reexec_environment


def malloc_conf(cpus: int | None = None) -> str:
    return f"{arenas(cpus)},dirty_decay_ms:200"


def reexec_environment(environ: dict, library: str) -> dict:
    """The environment of the re-executed compiling process: jemalloc first in LD_PRELOAD."""
    return _reexec_environment(environ, library, malloc_conf())


def compile_on_jemalloc() -> None:
    """Replace this process by the same command on jemalloc when that applies; otherwise return."""
    restart_on_jemalloc(malloc_conf())
