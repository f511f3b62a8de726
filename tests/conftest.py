"""Settings for the whole test session."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def own_compile_cache(tmp_path_factory):
    """A compile cache of this test session's own (each xdist worker has one): the tests never
    read or fill the user's ~/.cache/mxc, nor race another worker's writes. Children inherit it
    through the environment; a test of the cache sets MXC_CACHE_DIR itself."""
    previous = os.environ.get("MXC_CACHE_DIR")
    os.environ["MXC_CACHE_DIR"] = str(tmp_path_factory.mktemp("mxc-cache"))
    yield
    if previous is None:
        os.environ.pop("MXC_CACHE_DIR", None)
    else:
        os.environ["MXC_CACHE_DIR"] = previous
