"""Virtual CPU devices for `cpu-N` programs: how many, and room in XLA:CPU's thread pool for their
collectives. Both are read once, when jax makes its CPU client, so they are set before that; values
the user set are left alone."""

from __future__ import annotations

import os

# XLA:CPU runs every virtual device's program on one pool of max(cores, devices) threads (NPROC, when
# set, stands for the cores), and a collective holds its thread until every device has joined it.
# Collectives that do not depend on each other may run at once, so one device can hold several
# threads; with one thread a device, the last device found none left to join the collective the
# others waited in, and XLA aborted (docs/multimodal.md). Idle threads only cost their stacks.
CPU_THREADS_PER_DEVICE = 4


def request_cpu_devices(count: int, environ=os.environ) -> None:
    """`count` virtual CPU devices, unless XLA_FLAGS already names a count, and their threads."""
    flags = environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    request_cpu_threads(count, environ)


def request_cpu_threads(devices: int, environ=os.environ) -> None:
    """Give XLA:CPU's thread pool room for `devices` virtual devices' collectives at once."""
    if devices > 1:
        environ.setdefault("NPROC", str(max(os.cpu_count() or 1, CPU_THREADS_PER_DEVICE * devices)))
