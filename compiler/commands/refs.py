"""What a REF on the command line names: a zoo model, a .mspec file (all its models) or
`file.mspec:name`; and reading a spec file so that every failure is a message, not a traceback."""

from __future__ import annotations

from pathlib import Path

from mxc.compiler.commands import UserError


def split_ref(ref: str) -> tuple[str, str | None]:
    """(path or zoo name, model name or None), split as `mxc.spec.load.load_models` splits it."""
    if ":" in ref and not ref.endswith(".mspec"):
        path, _, name = ref.rpartition(":")
        return (path, name) if path else (ref, None)
    return ref, None


def read_source(path: str) -> str:
    """A spec file's text; bytes that are not UTF-8 are a located diagnostic."""
    from mxc.spec.diagnostics import Diagnostic, Loc, SpecError

    file = Path(path)
    if not file.exists():
        raise UserError(f"no such file: {path}")
    if not file.is_file():
        raise UserError(f"not a file: {path}")
    try:
        data = file.read_bytes()
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = data[:err.start]
        line_start = before.rfind(b"\n") + 1
        line = before.count(b"\n") + 1
        col = len(before[line_start:].decode("utf-8", errors="replace")) + 1
        shown = data.decode("utf-8", errors="replace")
        raise SpecError([Diagnostic(Loc(path, line, col, col + 1),
                                    f"not UTF-8 text: byte 0x{data[err.start]:02x}",
                                    "a .mspec file is UTF-8 text")], {path: shown}) from None


def add_set_option(parser) -> None:
    """`--set PATH=VALUE`, repeatable: the one way commands take overrides of spec fields."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="override a spec field, as .mspec text (d_model=2048, "
                             "block.attention.heads=16, blocks.NAME.mlp.hidden=512); repeatable")


def load_ref(ref: str, overrides: list[str] = ()) -> dict:
    """The models a REF names, by name; a SpecError carries every diagnostic of all of them.
    An error in an override (`--set`) is a UserError that names it."""
    from mxc.spec.diagnostics import SpecError
    from mxc.spec.overrides import is_override

    try:
        return _load_ref(ref, list(overrides))
    except SpecError as err:
        mine = [d for d in err.diagnostics if is_override(d.loc.path)]
        if not mine:
            raise
        raise UserError("\n".join(f"{d.loc.path}: {d.message}" + (f"; {d.hint}" if d.hint else "")
                                   for d in mine)) from None


def _load_ref(ref: str, overrides: list[str]) -> dict:
    from mxc.spec.load import load_models, load_text, model_names, zoo_names
    from mxc.spec.parser import parse
    from mxc.spec.resolve import did_you_mean

    path, name = split_ref(ref)
    if Path(path).exists():
        text = read_source(path)
        declared = model_names(parse(text, path))
        if name is not None and name not in declared:
            raise UserError(f"{path} has no model '{name}'; "
                            + (did_you_mean(name, declared) or "it declares: " + ", ".join(declared)))
        if overrides and name is None:
            if len(declared) != 1:
                raise UserError(f"--set changes one model, and {path} declares {len(declared)}; "
                                f"pick one as {path}:NAME")
            name = declared[0]
        # Read here already, so that a file that is not UTF-8 is a diagnostic, not a crash.
        return load_text(text, path, name, overrides)
    if ref in zoo_names():
        return load_models(ref, overrides)
    if name is not None or path.endswith(".mspec") or "/" in path:
        raise UserError(f"no such file: {path}")
    hint = did_you_mean(ref, zoo_names()) or "`mxc check --list` lists the zoo"
    raise UserError(f"no such file or zoo model '{ref}'; {hint}")


def load_one(ref: str, overrides: list[str] = ()):
    """The single model a REF names, with `--set` overrides; a file with several needs
    `file.mspec:name`."""
    models = load_ref(ref, overrides)
    if len(models) > 1:
        raise UserError(f"{ref} declares {len(models)} models ({', '.join(models)}); "
                        f"pick one as {ref}:NAME")
    return next(iter(models.values()))
