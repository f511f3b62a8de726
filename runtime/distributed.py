"""Multi-host start-up: `jax.distributed`, JAX's own multi-controller runtime.

Every process runs the same program on its own devices; together they form one global mesh.
The coordinator address, process count and process id come from flags, else from the usual
environment (JAX_COORDINATOR_ADDRESS, and jax's cluster detection on TPU pods, SLURM, Open MPI
and Kubernetes), else the run is a single process and nothing is initialised.

On a CPU host the processes' devices exchange data through gloo. When the coordinator is on
the loopback address, everything stays there: the coordinator binds 127.0.0.1 only (jax binds
all interfaces by default) and gloo is given 127.0.0.1 as its host name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class ProcessSetup:
    coordinator: str | None
    num_processes: int
    process_id: int

    @property
    def distributed(self) -> bool:
        return self.coordinator is not None


def setup_from(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, environ=os.environ) -> ProcessSetup:
    """The flags, filled in from the environment; a single process when neither names a coordinator."""
    coordinator = coordinator or environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(environ["JAX_NUM_PROCESSES"])
    if process_id is None and environ.get("JAX_PROCESS_ID"):
        process_id = int(environ["JAX_PROCESS_ID"])
    if coordinator is None:
        if num_processes not in (None, 1):
            raise ValueError(f"--num-processes {num_processes} needs --coordinator HOST:PORT "
                             f"(or JAX_COORDINATOR_ADDRESS)")
        return ProcessSetup(None, 1, 0)
    if (num_processes is None) != (process_id is None):
        raise ValueError("give both --num-processes and --process-id, or neither (cluster detection)")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in [0, {num_processes}), not {process_id}")
    return ProcessSetup(coordinator, num_processes if num_processes is not None else -1,
                        process_id if process_id is not None else -1)


def initialize(setup: ProcessSetup, *, timeout_s: int = 300, heartbeat_timeout_s: int = 100) -> None:
    """Joins the job described by `setup` (nothing to do for a single process). Must run before
    anything touches a jax device."""
    if not setup.distributed:
        return
    import jax

    host = setup.coordinator.rsplit(":", 1)[0]
    loopback = host in LOOPBACK_HOSTS
    known = setup.num_processes >= 0
    jax.distributed.initialize(
        coordinator_address=setup.coordinator,
        num_processes=setup.num_processes if known else None,
        process_id=setup.process_id if known else None,
        coordinator_bind_address=setup.coordinator if loopback else None,
        initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)
    if loopback:
        _gloo_on_loopback()


def _gloo_on_loopback() -> None:
    """Registers a CPU client whose gloo collectives listen on 127.0.0.1 only. jax has no
    public switch for gloo's host name, so this replaces jax's own CPU backend factory (the
    same registration call jax makes for it) before the first device is created."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    def make_loopback_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname="127.0.0.1")
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_loopback_cpu_client, priority=0, fail_quietly=False)


def is_primary() -> bool:
    """Process 0 writes the metrics and prints the progress; every process computes."""
    import jax

    return jax.process_index() == 0
