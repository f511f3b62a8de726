"""Syntax tree to IR: `let` constants, `extends` with overrides, the layer pattern, then pydantic.

A model resolves to a plain tree (dicts, lists, scalars) plus a map from each path in it to the
place in the source that set it, so that every later error can point at text.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from typing import Callable

from pydantic import ValidationError

from mxc.spec import ast
from mxc.spec.diagnostics import Diagnostic, Loc, SpecError
from mxc.spec.ir import LOGICAL_AXES, MESH_AXES, ModelSpec
from mxc.spec.schema_paths import allowed_fields

Path = tuple
ANONYMOUS_BLOCK = "block"


def did_you_mean(word: str, choices) -> str | None:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None


@dataclass
class Resolved:
    """A model as a plain tree, with where each part of it was written."""

    tree: dict
    locs: dict[Path, Loc]
    block_counts: dict[str, tuple[int, Loc]] = field(default_factory=dict)
    block_order: list[str] = field(default_factory=list)
    layers: ast.Layers | None = None


class _Collector:
    def __init__(self):
        self.diagnostics: list[Diagnostic] = []

    def error(self, loc: Loc, message: str, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(loc, message, hint))


class Resolver:
    """Resolves models by name across one user file and the zoo."""

    def __init__(self, files: list[ast.File], sources: dict[str, str]):
        self.sources = sources
        self.models: dict[str, tuple[ast.Model, ast.File]] = {}
        for f in files:
            for item in f.items:
                if isinstance(item, ast.Model) and item.name not in self.models:
                    self.models[item.name] = (item, f)
        self._cache: dict[str, Resolved] = {}
        # Bare names that are no `let` in scope, with the names that were: if the type wanted
        # is not an enum, the name was meant as a constant ("unknown name 'hdd'").
        self.bare_names: dict[Loc, tuple[str, tuple[str, ...]]] = {}

    # ------------------------------------------------------------ values

    def _value(self, value: ast.Value, scope: dict, out: _Collector, path: Path,
               locs: dict[Path, Loc]):
        locs[path] = value.loc
        if isinstance(value, ast.Number):
            return value.value
        if isinstance(value, ast.String):
            return value.value
        if isinstance(value, ast.Name):
            if value.name in ("true", "false"):
                return value.name == "true"
            if value.name == "none":
                return None
            if value.name in scope:
                return copy.deepcopy(scope[value.name])
            self.bare_names[value.loc] = (value.name, tuple(scope))
            return value.name  # an enum member; pydantic decides whether it is one
        if isinstance(value, ast.ListValue):
            return [self._value(v, scope, out, path + (i,), locs) for i, v in enumerate(value.items)]
        result = {"kind": value.kind}
        locs[path + ("kind",)] = value.loc
        for arg in value.args:
            if arg.name in result:
                out.error(arg.loc, f"duplicate key '{arg.name}' in {value.kind}(...)")
                continue
            result[arg.name] = self._value(arg.value, scope, out, path + (arg.name,), locs)
            locs[path + (arg.name,)] = arg.loc
        return result

    # ------------------------------------------------------------ statements

    def _assign(self, target: dict, base: Path, stmt: ast.Assign, scope: dict, out: _Collector,
                locs: dict[Path, Loc], seen: dict[Path, Loc]) -> None:
        full = base + stmt.path
        if full in seen:
            out.error(stmt.loc, f"duplicate key '{'.'.join(stmt.path)}'",
                      f"first set on line {seen[full].line}")
            return
        seen[full] = stmt.loc
        node = target
        for depth, key in enumerate(stmt.path[:-1]):
            child = node.get(key)
            if not isinstance(child, dict):
                where = ".".join(stmt.path[:depth + 1])
                allowed = allowed_fields(base + stmt.path[:depth])
                if allowed and key not in allowed:  # a misspelt field, not a value in the way
                    in_block = did_you_mean(key, allowed_fields(("blocks", ANONYMOUS_BLOCK))) if not base else None
                    out.error(stmt.loc, f"unknown field '{key}'",
                              did_you_mean(key, allowed)
                              or (f"{in_block} (a block's field: set it inside `block {{ }}`)" if in_block else None)
                              or "fields: " + ", ".join(allowed))
                    return
                out.error(stmt.loc, f"cannot set '{'.'.join(stmt.path)}': '{where}' is not set "
                                    "to a kind with fields here",
                          f"assign '{where}' whole, e.g. {where} = kind(...)")
                return
            node = child
        # Replacing a value drops the locations of whatever was below it.
        for old in [p for p in locs if p[:len(full)] == full]:
            del locs[old]
        node[stmt.path[-1]] = self._value(stmt.value, scope, out, full, locs)
        locs[full] = stmt.loc

    def resolve(self, name: str, chain: tuple[str, ...] = (), use_loc: Loc | None = None,
                out: _Collector | None = None) -> Resolved | None:
        out = out if out is not None else _Collector()
        if name in self._cache:
            return self._cache[name]
        if name not in self.models:
            return None
        model, file = self.models[name]
        if model.extends:
            if model.extends == name or model.extends in chain:
                cycle = " -> ".join(chain + (name, model.extends))
                out.error(model.extends_loc, f"'extends' cycle: {cycle}")
                return None
            if model.extends not in self.models:
                out.error(model.extends_loc, f"unknown model '{model.extends}'",
                          did_you_mean(model.extends, self.models))
                return None
            parent = self.resolve(model.extends, chain + (name,), model.extends_loc, out)
            if parent is None:
                return None
            resolved = copy.deepcopy(parent)
            # Names and placement that belong to the parent alone.
            resolved.locs[("name",)] = model.loc
        else:
            resolved = Resolved({}, {("name",): model.loc})
        resolved.tree["name"] = name
        self._apply(model, file, resolved, out)
        self._cache[name] = resolved
        return resolved

    def _apply(self, model: ast.Model, file: ast.File, res: Resolved, out: _Collector) -> None:
        scope: dict = {}
        for item in file.items:
            if isinstance(item, ast.Let):
                scope[item.name] = self._value(item.value, scope, out, ("let", item.name), {})
        seen: dict[Path, Loc] = {}
        tree, locs = res.tree, res.locs
        own_counts: dict[str, Loc] = {}
        for stmt in model.body:
            if isinstance(stmt, ast.Let):
                scope[stmt.name] = self._value(stmt.value, scope, out, ("let", stmt.name), {})
            elif isinstance(stmt, ast.Assign):
                if stmt.path[0] in ("blocks", "layers", "shard", "mesh", "name"):
                    out.error(stmt.loc, f"'{stmt.path[0]}' is not assigned with '='",
                              "use a `block`, `layers = ...`, `shard { }` or `mesh { }` statement"
                              if stmt.path[0] != "name" else "the name follows `model`")
                    continue
                self._assign(tree, (), stmt, scope, out, locs, seen)
            elif isinstance(stmt, ast.Block):
                name = stmt.name or ANONYMOUS_BLOCK
                key = ("blocks", name)
                if key in seen:
                    out.error(stmt.loc, f"duplicate block '{name}'", f"first defined on line {seen[key].line}")
                    continue
                seen[key] = stmt.loc
                blocks = tree.setdefault("blocks", {})
                if name not in blocks:
                    blocks[name] = {}
                    res.block_order.append(name)
                    locs[key] = stmt.loc
                for assign in stmt.body:
                    self._assign(blocks[name], key, assign, scope, out, locs, seen)
                if stmt.repeat is not None:
                    res.block_counts[name] = (stmt.repeat, stmt.repeat_loc)
                    own_counts[name] = stmt.repeat_loc
            elif isinstance(stmt, ast.Layers):
                if ("layers",) in seen:
                    out.error(stmt.loc, "duplicate 'layers'", f"first set on line {seen[('layers',)].line}")
                    continue
                seen[("layers",)] = stmt.loc
                res.layers = stmt
                # A pattern replaces the parent's per-block counts.
                res.block_counts = {k: v for k, v in res.block_counts.items() if k in own_counts}
            elif isinstance(stmt, ast.Shard):
                shard = tree.setdefault("shard", {})
                for rule in stmt.rules:
                    if ("shard", rule.logical) in seen:
                        out.error(rule.loc, f"duplicate sharding rule for '{rule.logical}'")
                        continue
                    seen[("shard", rule.logical)] = rule.loc
                    if rule.logical not in LOGICAL_AXES:
                        out.error(rule.loc, f"unknown logical axis '{rule.logical}'",
                                  did_you_mean(rule.logical, LOGICAL_AXES)
                                  or "logical axes: " + ", ".join(LOGICAL_AXES))
                        continue
                    bad = [(a, l) for a, l in zip(rule.mesh, rule.mesh_locs) if a not in MESH_AXES]
                    for axis, loc in bad:
                        out.error(loc, f"unknown mesh axis '{axis}'",
                                  did_you_mean(axis, MESH_AXES) or "mesh axes: " + ", ".join(MESH_AXES))
                    if len(set(rule.mesh)) != len(rule.mesh):
                        out.error(rule.loc, f"mesh axis repeated in the rule for '{rule.logical}'")
                    if not bad:
                        shard[rule.logical] = list(rule.mesh)
                        locs[("shard", rule.logical)] = rule.loc
            elif isinstance(stmt, ast.Mesh):
                mesh = tree.setdefault("mesh", {})
                for size in stmt.sizes:
                    axis = size.path[0]
                    if len(size.path) != 1 or axis not in MESH_AXES:
                        out.error(size.loc, f"unknown mesh axis '{'.'.join(size.path)}'",
                                  did_you_mean(axis, MESH_AXES) or "mesh axes: " + ", ".join(MESH_AXES))
                        continue
                    self._assign(mesh, ("mesh",), size, scope, out, locs, seen)
        if res.layers is not None:
            for name, loc in own_counts.items():
                if res.layers in [s for s in model.body if isinstance(s, ast.Layers)]:
                    out.error(loc, f"block '{name}' has a count, but `layers` sets the pattern",
                              "drop the `x N` here, or drop `layers`")
                elif name in res.block_counts:
                    out.error(loc, f"block '{name}' has a count, but the pattern comes from `layers` "
                                   f"(line {res.layers.loc.line} of {res.layers.loc.path})",
                              "restate `layers = ...` in this model instead")

    # ------------------------------------------------------------ layers

    def layer_pattern(self, res: Resolved, model_loc: Loc, out: _Collector) -> list[dict]:
        blocks = res.tree.get("blocks", {})
        if res.layers is None:
            segments = []
            for name in res.block_order:
                if name not in res.block_counts:
                    out.error(res.locs.get(("blocks", name), model_loc),
                              f"block '{name}' has no layer count",
                              f"write `block {name} x N {{ ... }}` or give `layers = ...`"
                              if name != ANONYMOUS_BLOCK else "write `block x N { ... }`")
                    continue
                segments.append({"period": [name], "repeat": res.block_counts[name][0]})
            if not blocks:
                out.error(model_loc, "model has no blocks", "add `block x N { attention = ... }`")
            return segments
        result = []
        for seg in res.layers.segments:
            # A top-level `kind x N` is one scan of N; a group's repeat scans its whole period.
            period = self._flatten(seg, blocks, out) if seg.kind is None else self._flatten(
                ast.Segment(seg.kind, (), None, seg.loc), blocks, out)
            result.append({"period": period, "repeat": seg.repeat or 1})
        return result

    def _flatten(self, seg: ast.Segment, blocks: dict, out: _Collector) -> list[str]:
        if seg.kind is not None:
            if seg.kind not in blocks:
                out.error(seg.loc, f"unknown block '{seg.kind}' in layers",
                          did_you_mean(seg.kind, blocks) or "blocks: " + ", ".join(blocks))
            return [seg.kind] * (seg.repeat or 1)
        period = []
        for child in seg.children:
            period.extend(self._flatten(child, blocks, out))
        return period


def locate(locs: dict[Path, Loc], tree: dict, path: tuple, fallback: Loc) -> Loc:
    """The source location of a pydantic error path; union tags and missing keys walk up."""
    node, best, walked = tree, fallback, ()
    for key in path:
        if isinstance(node, dict) and key in node:
            node = node[key]
            walked += (key,)
            best = locs.get(walked, best)
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
            walked += (key,)
            best = locs.get(walked, best)
        elif isinstance(node, dict) and node.get("kind") == key:
            continue
        else:
            continue
    return best


def build(resolver: Resolver, name: str, validate: Callable[[ModelSpec, Callable], None]) -> ModelSpec:
    """Resolve `name` and turn it into a ModelSpec, raising SpecError with every diagnostic."""
    out = _Collector()
    res = resolver.resolve(name, out=out)
    if res is None:
        raise SpecError(out.diagnostics, resolver.sources)
    model_loc = res.locs[("name",)]
    tree = copy.deepcopy(res.tree)
    # The pattern's segments are each one scan; a single-kind model is one segment.
    tree["layers"] = resolver.layer_pattern(res, model_loc, out)
    # The types are checked even after an error above, so that one run reports the errors of
    # every stage; one at a place already reported is a consequence of it and is left out.
    reported = {(d.loc.path, d.loc.line, d.loc.col) for d in out.diagnostics}
    try:
        # Strict: a typed language does not guess, so "512" is no integer and 1 or "false" no
        # boolean. Through JSON, as strict Python mode would also refuse lists for tuples and
        # JSON's strict mode still takes an integer where a float is wanted.
        spec = ModelSpec.model_validate_json(json.dumps(tree), strict=True)
    except ValidationError as err:
        for e in _without_misspelled(err.errors()):
            diagnostic = _pydantic_diagnostic(e, res, tree, model_loc, resolver.bare_names)
            if (diagnostic.loc.path, diagnostic.loc.line, diagnostic.loc.col) not in reported:
                out.diagnostics.append(diagnostic)
        raise SpecError(_dedupe(out.diagnostics), resolver.sources) from None
    if out.diagnostics:  # the semantic checks below would only echo these
        raise SpecError(_dedupe(out.diagnostics), resolver.sources)

    def error(path: tuple, message: str, hint: str | None = None) -> None:
        out.error(locate(res.locs, tree, path, model_loc), message, hint)

    validate(spec, error)
    if out.diagnostics:
        raise SpecError(_dedupe(out.diagnostics), resolver.sources)
    return spec


def _dedupe(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    seen, result = set(), []
    for d in diagnostics:
        key = (d.loc, d.message)
        if key not in seen:
            seen.add(key)
            result.append(d)
    return result


def _error_path(e: dict) -> tuple:
    return tuple(k for k in e["loc"] if not (isinstance(k, str) and "[" in k and "]" in k))


def _without_misspelled(errors: list[dict]) -> list[dict]:
    """Drops "missing field 'x'" where an unknown field next to it reads as a misspelt 'x':
    the "did you mean 'x'?" on that field already says everything."""
    suggested = set()
    for e in errors:
        if e["type"] == "extra_forbidden":
            path = _error_path(e)
            close = difflib.get_close_matches(str(path[-1]), allowed_fields(path[:-1]), n=1, cutoff=0.6)
            suggested.update((path[:-1], c) for c in close)
    return [e for e in errors
            if not (e["type"] == "missing" and (_error_path(e)[:-1], _error_path(e)[-1]) in suggested)]


# What a strict type error wanted, in the language's words.
_EXPECTED = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
             "bool_type": "true or false", "string_type": "a string"}


def _written(given) -> str:
    """A value as it was written in .mspec: true, 512, 2.5, "512"."""
    if isinstance(given, bool):
        return "true" if given else "false"
    if given is None:
        return "none"
    return f'the string "{given}"' if isinstance(given, str) else str(given)


def _bare_name(given: str, loc: Loc, bare_names: dict) -> tuple[str, ...] | None:
    """The `let` names in scope if `given` was written as a bare name inside the span `loc`."""
    last = loc.end_line or loc.line
    for where, (name, scope) in bare_names.items():
        if name == given and where.path == loc.path and loc.line <= where.line <= last:
            return scope
    return None


def _pydantic_diagnostic(e: dict, res: Resolved, tree: dict, model_loc: Loc,
                         bare_names: dict) -> Diagnostic:
    path = _error_path(e)
    loc = locate(res.locs, tree, path, model_loc)
    kind, ctx = e["type"], e.get("ctx", {})
    dotted = ".".join(str(k) for k in path if not _is_tag(tree, path, k))
    # The unnamed block is written `block x N { }` and overridden as --set block.F=V.
    dotted = dotted.replace(f"blocks.{ANONYMOUS_BLOCK}.", "block.", 1) if path[:2] == (
        "blocks", ANONYMOUS_BLOCK) else dotted
    if kind == "extra_forbidden":
        field_name = path[-1]
        parent_path = path[:-1]
        allowed = allowed_fields(parent_path)
        owner = _owner_name(tree, parent_path)
        return Diagnostic(loc, f"unknown field '{field_name}'" + (f" in {owner}" if owner else ""),
                          did_you_mean(str(field_name), allowed)
                          or (("fields: " + ", ".join(allowed)) if allowed else None))
    if kind == "missing":
        owner = _owner_name(tree, path[:-1])
        return Diagnostic(loc, f"missing field '{path[-1]}'" + (f" in {owner}" if owner else ""))
    if kind == "union_tag_invalid":
        tags = [t.strip(" '") for t in str(ctx.get("expected_tags", "")).split(",")]
        # Point at the kind's own name, `gqaa` in `attention = gqaa(...)`.
        call = locate(res.locs, tree, path + ("kind",), loc)
        if call is not loc:
            loc = Loc(call.path, call.line, call.col, call.col + len(str(ctx.get("tag"))))
        return Diagnostic(loc, f"unknown kind '{ctx.get('tag')}' for '{dotted}'",
                          did_you_mean(str(ctx.get("tag")), tags) or "kinds: " + ", ".join(tags))
    if kind == "union_tag_not_found":
        return Diagnostic(loc, f"'{dotted}' must be a kind such as name(...), not a plain value")
    if kind == "literal_error":
        expected = str(ctx.get("expected", ""))
        options = [o.strip(" '") for o in expected.replace(" or ", ",").split(",") if o.strip()]
        given = e.get("input")
        return Diagnostic(loc, f"'{dotted}' must be one of {expected}, not {given!r}",
                          did_you_mean(str(given), options) if isinstance(given, str) else None)
    given = e.get("input")
    if kind in _EXPECTED:
        if isinstance(given, str) and (scope := _bare_name(given, loc, bare_names)) is not None:
            return Diagnostic(loc, f"unknown name '{given}' (for '{dotted}', which wants "
                                   f"{_EXPECTED[kind]})",
                              did_you_mean(given, scope)
                              or ("booleans are written true or false" if kind == "bool_type" else None)
                              or (f"names in scope: {', '.join(scope)}" if scope else "define it: let NAME = ..."))
        return Diagnostic(loc, f"'{dotted}' must be {_EXPECTED[kind]}, not {_written(given)}",
                          "booleans are written true or false" if kind == "bool_type" else None)
    message = e["msg"][0].lower() + e["msg"][1:]
    if not isinstance(given, (dict, list)):
        message += f" (got {given!r})"
    return Diagnostic(loc, f"'{dotted}': {message}")


_NO_CHILD = object()


def _child(node, k):
    """node[k] where the tree holds it; else _NO_CHILD (pydantic's error paths also name a
    union member's kind, a step that stays on the same node)."""
    if isinstance(node, dict) and k in node:
        return node[k]
    if isinstance(node, list) and isinstance(k, int) and k < len(node):
        return node[k]
    return _NO_CHILD


def _is_tag(tree: dict, path: tuple, key) -> bool:
    node = tree
    for k in path:
        child = _child(node, k)
        if child is not _NO_CHILD:
            node = child
        elif k == key and isinstance(node, dict) and node.get("kind") == k:
            return True
    return False


def _owner_name(tree: dict, path: tuple) -> str | None:
    node = tree
    for k in path:
        child = _child(node, k)
        node = node if child is _NO_CHILD else child
    if isinstance(node, dict) and "kind" in node:
        return f"{node['kind']}(...)"
    return None
