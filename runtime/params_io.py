"""Saving and loading parameter pytrees as orbax checkpoints (no pickle).

Generic over any pytree of arrays; restoring against a target of jax.ShapeDtypeStruct (with
shardings, if any) checks shapes and dtypes and places the arrays, also onto another device count.
"""

from __future__ import annotations

from pathlib import Path


def save_params(path: str | Path, params) -> Path:
    """Write `params` to the directory `path` (replaced if it exists); returns its absolute path."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, params, force=True)
    checkpointer.wait_until_finished()
    return path


def load_params(path: str | Path, target=None):
    """Read parameters saved by save_params. With `target` (a pytree of jax.ShapeDtypeStruct) the
    result has exactly that structure, shapes, dtypes and shardings; a float checkpoint read for
    a quantized target is quantized as it loads (runtime/quantize_at_load.py)."""
    import jax
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"no parameter checkpoint at {path}")
    checkpointer = ocp.StandardCheckpointer()
    if target is None:
        return checkpointer.restore(path)
    saved = checkpointer.metadata(path)
    saved = getattr(saved, "item_metadata", saved)
    saved = getattr(saved, "tree", saved)
    from mxc.runtime import quantize_at_load

    if quantize_at_load.needs_quantizing(saved, target):
        floats = quantize_at_load.float_target(saved, target)
        _check_matches(saved, floats, path)
        return quantize_at_load.quantized_like(_restore(checkpointer, path, saved, floats), target)
    _check_matches(saved, target, path)
    return _restore(checkpointer, path, saved, target)


def _restore(checkpointer, path, saved, target):
    """Restore `target`'s leaves. Orbax wants the saved tree's structure, groups without leaves
    included (a weightless norm's `{}` in imported params), which a model's target leaves out: they
    are asked for as saved and dropped again."""
    import jax

    restored = checkpointer.restore(path, _with_leafless_groups(saved, jax.tree.map(_abstract, target)))
    return _without_leafless_groups(restored, target)


def _with_leafless_groups(saved, target):
    if isinstance(target, (list, tuple)) and isinstance(saved, (list, tuple)) and len(saved) == len(target):
        return type(target)(_with_leafless_groups(s, t) for s, t in zip(saved, target))
    if not (isinstance(saved, dict) and isinstance(target, dict)):
        return target
    out = {key: _with_leafless_groups(saved.get(key), value) for key, value in target.items()}
    out.update({key: value for key, value in saved.items() if key not in target and _leafless(value)})
    return out


def _without_leafless_groups(restored, target):
    if isinstance(target, (list, tuple)) and isinstance(restored, (list, tuple)):
        return type(target)(_without_leafless_groups(r, t) for r, t in zip(restored, target))
    if not (isinstance(restored, dict) and isinstance(target, dict)):
        return restored
    return {key: _without_leafless_groups(restored[key], value) for key, value in target.items()}


def _leafless(tree) -> bool:
    import jax

    return not jax.tree_util.tree_leaves(tree)


def _abstract(x):
    import jax

    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _check_matches(saved, target, path) -> None:
    """Name the first parameter whose path, shape or dtype differs (orbax's own error is terse):
    a CheckpointError (a ValueError), which the command lines report as the user's error."""
    import jax

    from mxc.runtime.checkpoint import CheckpointError

    saved_leaves = dict(jax.tree_util.tree_flatten_with_path(saved)[0])
    target_leaves = dict(jax.tree_util.tree_flatten_with_path(target)[0])
    name = jax.tree_util.keystr
    missing = [name(p) for p in target_leaves if p not in saved_leaves]
    extra = [name(p) for p in saved_leaves if p not in target_leaves]
    if missing or extra:
        problems = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {extra[:3]}"] if extra else [])
        raise CheckpointError(f"{path}: checkpoint and model disagree on parameters: " + ", ".join(problems))
    for p, want in target_leaves.items():
        have = saved_leaves[p]
        if tuple(have.shape) != tuple(want.shape) or str(have.dtype) != str(want.dtype):
            raise CheckpointError(f"{path}: parameter {name(p)}: checkpoint has {have.dtype}{list(have.shape)}, "
                                  f"model wants {want.dtype}{list(want.shape)}")
