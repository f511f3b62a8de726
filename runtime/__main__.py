"""`python -m mxc.runtime run | generate | tokenize`: the runtime's own entry point, which imports
neither the compiler nor the spec language (`mxc run` and friends hand over to it)."""

import sys

if sys.argv[1:2] == ["run"]:
    # Training reuses its freed pages instead of faulting them in again every step (allocator.py);
    # restarts this command once on jemalloc, before jax is imported.
    from mxc.runtime.allocator import train_on_jemalloc

    train_on_jemalloc()

from mxc.runtime.cli import main  # noqa: E402

sys.exit(main())
