"""Finding and loading specs: from text, from a file, or by zoo name."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

from mxc.spec import ast
from mxc.spec.diagnostics import Diagnostic, Loc, SpecError
from mxc.spec.ir import ModelSpec
from mxc.spec.overrides import with_overrides
from mxc.spec.parser import parse
from mxc.spec.resolve import Resolver, build, did_you_mean
from mxc.spec.validate import validate


@lru_cache(maxsize=1)
def _zoo() -> tuple[tuple[ast.File, ...], dict[str, str]]:
    files, sources = [], {}
    for entry in sorted(resources.files("mxc.models").iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".mspec"):
            text = entry.read_text()
            path = f"<zoo>/{entry.name}"
            sources[path] = text
            files.append(parse(text, path))
    return tuple(files), sources


def zoo_names() -> list[str]:
    """Every model in the zoo, in file order."""
    return [item.name for f in _zoo()[0] for item in f.items if isinstance(item, ast.Model)]


def zoo_file(name: str) -> str | None:
    for f in _zoo()[0]:
        if any(isinstance(i, ast.Model) and i.name == name for i in f.items):
            return f.path
    return None


def model_names(file: ast.File) -> list[str]:
    return [i.name for i in file.items if isinstance(i, ast.Model)]


def load_text(text: str, path: str = "<text>", name: str | None = None,
              overrides: list[str] = ()) -> dict[str, ModelSpec]:
    """Every model declared in `text` (or just `name`), resolved against the text and the zoo;
    `overrides` (`d_model=2048`, see spec/overrides.py) change model `name`.

    All diagnostics of all models are gathered before raising, so one run reports them all."""
    file = parse(text, path)
    files = [file]
    if overrides:
        declared = model_names(file)
        name = declared[0] if name is None and len(declared) == 1 else name
        if name not in declared:
            raise ValueError("overrides apply to one model of the file: name it")
        files = with_overrides(file, name, list(overrides))
    own = {n for f in files for n in model_names(f)}
    # The zoo is parsed only when this file builds on a model it does not declare.
    if any(isinstance(i, ast.Model) and i.extends and i.extends not in own for f in files for i in f.items):
        zoo_files, zoo_sources = _zoo()
    else:
        zoo_files, zoo_sources = (), {}
    resolver = Resolver([*files, *zoo_files], {**zoo_sources, path: text})
    names = model_names(file) if name is None else [name]
    if not names:
        raise SpecError([Diagnostic(Loc(path, 1, 1), "no model in this file",
                                    "declare one: model NAME { ... }")], {path: text})
    models, diagnostics = {}, []
    for n in names:
        try:
            models[n] = build(resolver, n, validate)
        except SpecError as err:
            diagnostics.extend(d for d in err.diagnostics if d not in diagnostics)
    if diagnostics:
        raise SpecError(diagnostics, resolver.sources)
    return models


def load_model(ref: str) -> ModelSpec:
    """A single model from a zoo name, a file with one model, or `file.mspec:name`."""
    return next(iter(load_models(ref).values())) if ":" in ref or _is_zoo(ref) else _single(ref)


def _is_zoo(ref: str) -> bool:
    return not Path(ref).exists() and ref in zoo_names()


def _single(ref: str) -> ModelSpec:
    models = load_models(ref)
    if len(models) > 1:
        raise SpecError([Diagnostic(Loc(ref, 1, 1), f"{ref} declares {len(models)} models: "
                                    + ", ".join(models), f"pick one: {ref}:NAME")])
    return next(iter(models.values()))


def load_models(ref: str, overrides: list[str] = ()) -> dict[str, ModelSpec]:
    """Models named by a CLI argument: a zoo name, a file (all its models) or `file:name`."""
    path, _, name = ref.rpartition(":") if ref.endswith(".mspec") is False and ":" in ref else (ref, "", "")
    path = path or ref
    if Path(path).is_file():
        text = Path(path).read_text()
        return load_text(text, path, name or None, overrides)
    if ref in zoo_names():
        file = zoo_file(ref)
        files, sources = _zoo()
        return load_text(sources[file], file, ref, overrides)
    hint = did_you_mean(ref, zoo_names()) or "zoo models: mxc check --list"
    raise SpecError([Diagnostic(Loc(ref, 1, 1), f"no such file or zoo model '{ref}'", hint)])
