"""mxc: a declarative compiler from model specs to sharded XLA programs."""

from importlib.metadata import version

# One version number, pyproject.toml's, read from the installed distribution's metadata.
__version__ = version("mxc")
