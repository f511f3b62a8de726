"""The runtime: load a compiled artifact and run it. Needs only the artifact, jax and this package:
it imports neither mxc.spec nor mxc.compiler (a production host has no compiler).

    program = mxc.runtime.load("build/llama3.1-8b-v5p-1024")
    state = program.init(0)
    state, metrics = program.train_step(state, batch, {"learning_rate": 3e-4})  # mxc.runtime.schedule
"""

_PROGRAM_NAMES = ("load", "Program", "RecompiledWarning")


def __getattr__(name: str):
    # Imported on first use: jax, so that reading a manifest (mxc inspect) stays quick, and the
    # manifest's pydantic schema, so that building the CLI's parser (mxc --help) imports neither.
    if name == "ArtifactError":
        from mxc.runtime.artifact import ArtifactError

        return ArtifactError
    if name in _PROGRAM_NAMES:
        from mxc.runtime import program

        return getattr(program, name)
    raise AttributeError(f"module 'mxc.runtime' has no attribute {name!r}")


__all__ = ["ArtifactError", *_PROGRAM_NAMES]
