"""Training checkpoints with orbax: asynchronous, atomic, kept to the last few, restorable onto another mesh.

A checkpoint directory holds one sub-directory per saved step (orbax's CheckpointManager
layout), each with three items:

    params     the parameters (orbax StandardSave: tensorstore arrays, no pickle)
    optimizer  {"step": the update counter, "opt_state": the optimizer's state}
    meta       JSON: step, the data position, the seed, the artifact it was trained with, and
               a checksum of every array of params and optimizer (mxc.runtime.checksums),
               checked when the step is restored: a corrupt array is refused, never trained on

and a lock file (.mxc-run.lock), flocked by the run that writes the folder, so a second run on
the same folder is refused rather than interleaving its saves with the first's.

Saving is asynchronous: `save` returns once the arrays are copied off the devices, and the
files are written in the background while training goes on. orbax writes a step into a
temporary directory and renames it into place only when every file (from every process) is
written, so a crash mid-save leaves the previous step as the newest complete checkpoint.

Restoring takes the arrays' target shapes, dtypes and shardings from the program that will
use them, so a checkpoint written under one plan (mesh, shardings, device count) is resharded
onto another as it is read.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import jax

from mxc.runtime.checksums import checksums, mismatches

PARAMS, OPTIMIZER, META = "params", "optimizer", "meta"
CHECKSUMS = "checksums"
LOCK_FILE = ".mxc-run.lock"
COMMIT_MARKER, COMMIT_TEXT = "commit_success.txt", "Checkpoint commit was successful"


class CheckpointError(ValueError):
    """A checkpoint that cannot be found or read into this program."""


def abstract_like(tree):
    """ShapeDtypeStructs (with shardings) for a tree of arrays or of ShapeDtypeStructs."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


class Checkpoints:
    """The checkpoints of one run, in `directory`; `keep` most recent are kept (None: all)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3, async_save: bool = True):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self._ocp = ocp
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            # Leftovers of a save that crashed are removed on start, never mistaken for a checkpoint.
            cleanup_tmp_directories=True)
        # The first process writes for all, so it alone holds the folder's lock.
        self._lock = _lock_folder(self.directory) if jax.process_index() == 0 else None
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, *, params, optimizer, meta: dict) -> None:
        """Starts saving; returns when the arrays are on the host (they may be donated after)."""
        args = self._ocp.args
        meta = {**meta, CHECKSUMS: {PARAMS: checksums(params), OPTIMIZER: checksums(optimizer)}}
        self._manager.save(step, args=args.Composite(**{
            PARAMS: args.StandardSave(params), OPTIMIZER: args.StandardSave(optimizer),
            META: args.JsonSave(meta)}), force=True)
        # orbax finishes one save before it starts the next, so every other step is final now.
        self._scrub_commit_markers(skip=step)

    def restore(self, step: int, *, params_target, optimizer_target) -> tuple[object, object, dict]:
        """(params, optimizer, meta) of `step`, laid out as the targets say; CheckpointError, naming
        the step, when an item is missing or unreadable or an array differs from its checksum."""
        args = self._ocp.args
        where = self.directory / str(step)
        try:
            restored = self._manager.restore(step, args=args.Composite(**{
                PARAMS: args.StandardRestore(abstract_like(params_target)),
                OPTIMIZER: args.StandardRestore(abstract_like(optimizer_target)),
                META: args.JsonRestore()}))
        except Exception as err:  # orbax and TensorStore raise many kinds, with pages of detail
            raise CheckpointError(f"{where}: step {step} cannot be read: {_first_line(err)}") from None
        meta = dict(restored[META])
        recorded = meta.pop(CHECKSUMS, {})
        for item in (PARAMS, OPTIMIZER):
            _check_item(where, step, item, recorded, restored[item])
        return restored[PARAMS], restored[OPTIMIZER], meta

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self._manager.wait_until_finished()
        self._scrub_commit_markers()

    def close(self) -> None:
        try:
            self._manager.wait_until_finished()
            self._manager.close()
            self._scrub_commit_markers()
        finally:
            if self._lock is not None:
                self._lock.close()  # closing the file releases the flock
                self._lock = None


    def _scrub_commit_markers(self, skip: int | None = None) -> None:
        """orbax's commit_success.txt names the checkpoint's absolute path; a checkpoint copied
        elsewhere should not carry the writer's folders, so the text becomes path-free (orbax
        only checks that the file exists)."""
        if self._lock is None:
            return  # process 0 rewrites for everyone
        for marker in self.directory.glob("*/**/" + COMMIT_MARKER):
            step = marker.relative_to(self.directory).parts[0]
            if step.isdigit() and int(step) != skip and marker.read_text() != COMMIT_TEXT:
                marker.write_text(COMMIT_TEXT)


def _check_item(where: Path, step: int, item: str, recorded: dict, tree) -> None:
    """Refuse `tree` when it differs from the checksums recorded for `item` (steps saved before
    checksums were recorded have none to compare)."""
    if item not in recorded:
        return
    bad = mismatches(recorded[item], tree)
    if bad:
        raise CheckpointError(f"{where}: step {step} is corrupt: {item} {', '.join(bad[:3])}"
                              f"{' and more' if len(bad) > 3 else ''} differ from the checksums "
                              "recorded when it was saved")


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def _lock_folder(directory: Path):
    """An exclusive flock on a file in `directory`, so two runs never write one checkpoint folder."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / LOCK_FILE, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise CheckpointError(f"{directory}: another mxc run is using this checkpoint folder "
                              f"(its lock {LOCK_FILE} is held); wait for it or use another --ckpt-dir") from None
    return handle


def _is_step_directory(path: Path) -> bool:
    return path.name.isdigit() and (path / PARAMS).is_dir()


def find_checkpoint(path: str | os.PathLike) -> tuple[Path, int]:
    """(run directory, step) for a run directory (its newest step) or one step's directory."""
    path = Path(path).absolute()
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if _is_step_directory(path):
        return path.parent, int(path.name)
    steps = sorted(int(p.name) for p in path.iterdir() if _is_step_directory(p))
    if not steps:
        raise CheckpointError(f"{path} holds no complete checkpoint (expected step directories "
                              f"with a {PARAMS}/ item, as `mxc run --ckpt-dir` writes)")
    return path, steps[-1]


def restore_params(path: str | os.PathLike, target):
    """Parameters only, laid out like `target`: from a training checkpoint (a run directory or
    one step of it) or from a bare parameter tree saved with orbax's StandardCheckpointer (as
    the HF importer writes)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.is_dir() and not _is_step_directory(path) and (path / "_CHECKPOINT_METADATA").exists() \
            and not any(_is_step_directory(p) for p in path.iterdir()):
        from mxc.runtime.params_io import load_params

        return load_params(path, abstract_like(target))
    root, step = find_checkpoint(path)
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=False))
    try:
        restored = manager.restore(step, args=ocp.args.Composite(**{
            PARAMS: ocp.args.StandardRestore(abstract_like(target)), META: ocp.args.JsonRestore()}))
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"{root / str(step)}: its parameters do not fit this model: {err}") from None
    finally:
        manager.close()
    _check_item(root / str(step), step, PARAMS, restored[META].get(CHECKSUMS, {}), restored[PARAMS])
    return restored[PARAMS]
