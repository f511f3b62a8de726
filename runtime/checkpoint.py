"""Training checkpoints with orbax: asynchronous, atomic, kept to the last few, restorable onto another mesh.

A checkpoint directory holds one sub-directory per saved step (orbax's CheckpointManager
layout), each with three items:

    params     the parameters (orbax StandardSave: tensorstore arrays, no pickle)
    optimizer  {"step": the update counter, "opt_state": the optimizer's state}
    meta       JSON: step, the data position, the seed, the learning-rate schedule
               (mxc.runtime.schedule), the artifact it was trained with, and
               a checksum of every array of params and optimizer (mxc.runtime.checksums),
               checked when the step is restored: a corrupt array is refused, never trained on

and a lock file (.mxc-run.lock), flocked by the run that writes the folder, so a second run on
the same folder is refused rather than interleaving its saves with the first's. A folder this
object created is removed again when it is closed holding no checkpoint (a run that failed
before its first save leaves nothing behind); a folder that existed before is never removed.

A step is restored only into a program of the spec it was trained with: its meta is read
first and compared with the program's identity, so a checkpoint of another model never reaches
orbax's array restore.

Saving is asynchronous: `save` returns once the arrays are copied off the devices, and the
files are written in the background while training goes on. `check_saves` (called by the loop
at every step boundary) raises the error of a background save that failed, as a SaveError. orbax writes a step into a
temporary directory and renames it into place only when every file (from every process) is
written, so a crash mid-save leaves the previous step as the newest complete checkpoint.

Restoring takes the arrays' target shapes, dtypes and shardings from the program that will
use them, so a checkpoint written under one plan (mesh, shardings, device count) is resharded
onto another as it is read.
"""

from __future__ import annotations

import contextlib
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


class SpecMismatchError(CheckpointError):
    """A checkpoint trained with another model spec than the program that would use it."""


class SaveError(CheckpointError):
    """A step could not be written (disk full, file too large, permissions...)."""


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
        self._saving_step: int | None = None  # the newest step whose save was started
        self._save_failed = False
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
            # Leftovers of a save that crashed are removed on start, never mistaken for a checkpoint.
            cleanup_tmp_directories=True)
        # The first process writes for all, so it alone holds the folder's lock.
        self._created = _missing_folders(self.directory) if jax.process_index() == 0 else []
        self._lock = _lock_folder(self.directory) if jax.process_index() == 0 else None
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        # A run killed with -9 after a save left that step's marker naming its absolute path.
        self._scrub_commit_markers()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, *, params, optimizer, meta: dict) -> None:
        """Starts saving; returns when the arrays are on the host (they may be donated after).
        SaveError when this save, or the previous one still in the background, fails."""
        args = self._ocp.args
        meta = {**meta, CHECKSUMS: {PARAMS: checksums(params), OPTIMIZER: checksums(optimizer)}}
        with self._save_errors():  # orbax waits for the previous save first, raising its error
            self._manager.save(step, args=args.Composite(**{
                PARAMS: args.StandardSave(params), OPTIMIZER: args.StandardSave(optimizer),
                META: args.JsonSave(meta)}), force=True)
        self._saving_step = step
        with self._save_errors():
            self._manager.check_for_errors()  # a synchronous save fails here
        # orbax finishes one save before it starts the next, so every other step is final now.
        self._scrub_commit_markers(skip=step)

    def check_saves(self) -> None:
        """SaveError when a save that ran in the background has failed; cheap, returns at once."""
        with self._save_errors():
            self._manager.check_for_errors()

    def read_meta(self, step: int) -> dict:
        """The meta item of `step` alone (no arrays are read)."""
        try:
            restored = self._manager.restore(step, args=self._ocp.args.Composite(**{META: self._ocp.args.JsonRestore()}))
        except Exception as err:  # orbax raises many kinds, with pages of detail
            raise CheckpointError(f"{self.directory / str(step)}: step {step} cannot be read: {_first_line(err)}") from None
        return dict(restored[META])

    def restore(self, step: int, *, params_target, optimizer_target,
                identity: dict | None = None) -> tuple[object, object, dict]:
        """(params, optimizer, meta) of `step`, laid out as the targets say; CheckpointError, naming
        the step, when an item is missing or unreadable or an array differs from its checksum;
        SpecMismatchError, before any array is read, when `identity` (the program's model and
        spec_hash) is not the spec the step was trained with."""
        args = self._ocp.args
        where = self.directory / str(step)
        if identity is not None:
            check_same_spec(f"checkpoint {self.directory} step {step}", self.read_meta(step).get("artifact"), identity)
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
        """Blocks until every started save is complete on disk; SaveError when one failed."""
        with self._save_errors():
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        self._scrub_commit_markers()

    def close(self) -> None:
        try:
            try:
                self.wait()
            except SaveError:
                if not self._save_failed:
                    raise
                # already reported (and raised) at the step boundary that saw it
            self._manager.close()
            self._scrub_commit_markers()  # closing may finish the newest step's commit
        finally:
            if self._lock is not None:
                self._remove_if_unused()  # while the lock is held: no other run is starting in it
                self._lock.close()  # closing the file releases the flock
                self._lock = None

    @contextlib.contextmanager
    def _save_errors(self):
        """Turns orbax's error of a failed save into one SaveError naming the step and folder."""
        try:
            yield
        except Exception as err:
            if self._save_failed:
                raise SaveError(f"saving to {self.directory} failed earlier") from None
            self._save_failed = True
            step = "" if self._saving_step is None else f"step {self._saving_step} "
            raise SaveError(f"saving {step}to {self.directory} failed: {_reason(err)}") from None

    def _remove_if_unused(self) -> None:
        """Removes the folders this object created when they hold no checkpoint (only its lock
        file and orbax's empty leftovers), so a run that failed before saving leaves nothing."""
        if not self._created or not self.directory.is_dir():
            return
        if any(entry.name != LOCK_FILE and not (entry.is_dir() and not any(entry.iterdir()))
               for entry in self.directory.iterdir()):
            return
        (self.directory / LOCK_FILE).unlink(missing_ok=True)
        for entry in self.directory.iterdir():
            entry.rmdir()
        for folder in self._created:  # deepest first; stops at one that is not empty
            try:
                folder.rmdir()
            except OSError:
                return

    def _scrub_commit_markers(self, skip: int | None = None) -> None:
        """orbax's commit_success.txt names the checkpoint's absolute path; a checkpoint copied
        elsewhere should not carry the writer's folders, so the text becomes path-free (orbax
        only checks that the file exists)."""
        if self._lock is None:
            return  # process 0 rewrites for everyone
        # Only committed steps: orbax may be removing a crashed save's temporary folder meanwhile.
        for step in self.directory.iterdir():
            if not step.name.isdigit() or int(step.name) == skip:
                continue
            for marker in step.glob("**/" + COMMIT_MARKER):
                if marker.read_text() != COMMIT_TEXT:
                    marker.write_text(COMMIT_TEXT)


def check_same_spec(what: str, recorded: dict | None, expected: dict) -> None:
    """SpecMismatchError when `recorded` (the artifact identity saved with a checkpoint) names
    another spec than `expected`. Checkpoints that recorded no spec hash are accepted."""
    if not recorded or not recorded.get("spec_hash") or not expected.get("spec_hash"):
        return
    if recorded["spec_hash"] != expected["spec_hash"]:
        raise SpecMismatchError(
            f"{what} was trained with {_model_name(recorded)}, this artifact is {_model_name(expected)}: "
            "the model specs differ")


def _model_name(identity: dict) -> str:
    name = identity.get("model", "an unnamed model")
    return f"{name} (spec {identity['spec_hash'][:12]}…)" if identity.get("spec_hash") else name


def _reason(err: BaseException) -> str:
    """The root cause of a failed save in one line (orbax wraps TensorStore's errors)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return _first_line(err)


def _missing_folders(directory: Path) -> list[Path]:
    """`directory` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for folder in (directory, *directory.parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


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


def restore_params(path: str | os.PathLike, target, *, identity: dict | None = None, same_spec: bool = True):
    """Parameters only, laid out like `target`: from a training checkpoint (a run directory or
    one step of it) or from a bare parameter tree saved with orbax's StandardCheckpointer (as
    the HF importer writes).

    `identity` is the program's {"model", "spec_hash"} (Trainable.identity, i.e.
    trainable.artifact_identity(manifest)). With `same_spec` a checkpoint trained with another spec
    is refused (SpecMismatchError); without it (fine-tuning from another run) only parameters of
    other shapes are, naming both models and the first parameter that differs. Both checks use
    the checkpoint's metadata, before any array is read."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.is_dir() and not _is_step_directory(path) and (path / "_CHECKPOINT_METADATA").exists() \
            and not any(_is_step_directory(p) for p in path.iterdir()):
        from mxc.runtime.params_io import load_params

        return load_params(path, abstract_like(target))  # names a parameter of another shape itself
    root, step = find_checkpoint(path)
    where = root / str(step)
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=False))
    try:
        if identity is not None:
            meta = manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
            recorded = meta.get("artifact")
            if same_spec:
                check_same_spec(f"checkpoint {root} step {step}", recorded, identity)
            _check_shapes(f"checkpoint {root} step {step}", where / PARAMS, recorded, identity, target)
        restored = manager.restore(step, args=ocp.args.Composite(**{
            PARAMS: ocp.args.StandardRestore(abstract_like(target)), META: ocp.args.JsonRestore()}))
    except (ValueError, KeyError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{where}: its parameters do not fit this model: {_first_line(err)}") from None
    finally:
        manager.close()
    _check_item(where, step, PARAMS, restored[META].get(CHECKSUMS, {}), restored[PARAMS])
    return restored[PARAMS]


def _check_shapes(what: str, params_dir: Path, recorded: dict | None, identity: dict | None, target) -> None:
    """SpecMismatchError naming both models and the first parameter whose shape (or presence)
    differs between the saved tree in `params_dir` and `target`; read from orbax's metadata."""
    import orbax.checkpoint as ocp

    try:
        saved = ocp.StandardCheckpointer().metadata(params_dir).item_metadata.tree
    except Exception:  # no readable metadata: the restore itself reports what is wrong
        return
    saved_shapes = {name: tuple(leaf.shape) for name, leaf in leaf_names(saved)}
    wanted_shapes = {name: tuple(leaf.shape) for name, leaf in leaf_names(target)}
    for name in sorted(saved_shapes.keys() | wanted_shapes.keys()):
        have, want = saved_shapes.get(name), wanted_shapes.get(name)
        if have != want:
            models = (f" was trained with {_model_name(recorded)}, this artifact is {_model_name(identity)};"
                      if recorded and identity else " does not fit this model:")
            raise SpecMismatchError(
                f"{what}{models} parameter {name} is {_shape_text(have)} there and {_shape_text(want)} here")


def leaf_names(tree) -> list[tuple[str, object]]:
    """(key path as text, leaf) of every array-like leaf, the names checksums are recorded under."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def _shape_text(shape) -> str:
    return "absent" if shape is None else f"of shape {list(shape)}"
