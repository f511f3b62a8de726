"""Pytrees as (path, leaf) lists: how arguments reach a flat executable and how results come back.

A path is a list of mapping keys / attribute names (str) and sequence indices (int), as in the
manifest's leaves. Looking a path up accepts dicts, lists, tuples and objects with attributes
(a NamedTuple train state built elsewhere works as well as the dicts `build_tree` returns).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mxc.runtime.artifact import PathEntry, path_name


class TreePathError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def lookup(tree, path: Sequence[PathEntry], *, root: str = "arguments"):
    node = tree
    for depth, entry in enumerate(path):
        try:
            kind = type(node)
            # Plain dicts and lists first: the ABC checks below cost more than the lookup itself, and
            # a CPU serving call looks up one path per layer's array (335 for a SmolLM2-135M decode).
            if kind is dict or ((kind is list or kind is tuple) and type(entry) is int):
                node = node[entry]
            elif isinstance(node, Mapping):
                node = node[entry]
            elif isinstance(entry, int) and isinstance(node, Sequence):
                node = node[entry]
            elif isinstance(entry, str):
                node = getattr(node, entry)
            else:
                raise LookupError
        except (LookupError, AttributeError):
            where = path_name(list(path[:depth])) or root
            raise TreePathError(f"{where} has no entry {entry!r} (needed for {path_name(list(path))})") from None
    return node


def build_tree(paths: Sequence[Sequence[PathEntry]], leaves: Sequence):
    """Nested dicts and lists holding `leaves` at `paths`. A node whose keys are exactly 0..n-1
    becomes a list; other integer keys (a sequence whose empty entries held no arrays) stay a dict."""
    if len(paths) == 1 and not paths[0]:
        return leaves[0]
    root: dict = {}
    for path, leaf in zip(paths, leaves):
        node = root
        for entry in path[:-1]:
            node = node.setdefault(entry, {})
        node[path[-1]] = leaf
    return _listify(root)


def _listify(node):
    if not isinstance(node, dict):
        return node
    children = {key: _listify(value) for key, value in node.items()}
    if children and all(isinstance(k, int) for k in children) and sorted(children) == list(range(len(children))):
        return [children[i] for i in range(len(children))]
    return children
