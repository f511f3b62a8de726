"""Writing an artifact directory atomically.

Everything is written into a fresh temporary directory beside the destination and renamed into
place, so a reader sees either no artifact or a whole one, and an interrupted compile leaves at
most a `.tmp-*` directory behind. An existing destination is replaced only with `force`, and
only if it is an mxc artifact whose manifest checks (or an empty folder) and that holds no file
its manifest does not list: `--force` never deletes someone's other files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mxc.runtime.artifact import MANIFEST_NAME, ArtifactError, Manifest, sha256_hex
from mxc.runtime.artifact_reader import read_verified, replaceable_files
from mxc.runtime.file_modes import current_umask
from mxc.runtime.signing import SIGNATURE_NAME


class ArtifactExistsError(FileExistsError):
    def __str__(self) -> str:
        return str(self.args[0])


def check_destination(destination: str | Path, force: bool) -> None:
    """Refuse early (before a long compile) what `install` would refuse at the end."""
    destination = Path(destination)
    if not destination.exists() and not destination.is_symlink():
        return
    if not force:
        raise ArtifactExistsError(f"{destination} already exists; pass --force to replace it")
    if destination.is_symlink() or not destination.is_dir():
        raise ArtifactExistsError(f"{destination} exists and is not a directory; refusing to replace it")
    if any(destination.iterdir()):
        _check_replaceable_artifact(destination)


def _check_replaceable_artifact(destination: Path) -> None:
    """--force replaces an mxc artifact and nothing else: its manifest must read as one (format,
    schema, manifest_sha256) and the folder must hold no file the manifest does not list, since
    replacing the folder would delete that file."""
    refusal = "refusing to replace it, even with --force"
    try:
        listed = replaceable_files(destination)
    except ArtifactError as err:
        raise ArtifactExistsError(f"{destination} exists and is not an mxc artifact ({err}); {refusal}") from None
    present = {path.relative_to(destination).as_posix() for path in destination.rglob("*")
               if path.is_file() or path.is_symlink()}
    unlisted = sorted(present - listed - {MANIFEST_NAME, SIGNATURE_NAME})
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
        raise ArtifactExistsError(f"{destination} is an mxc artifact but also holds files its manifest does "
                                  f"not list ({shown}); {refusal}")


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(staging: Path, destination: Path, force: bool) -> None:
    """Move a complete staging directory to `destination`."""
    check_destination(destination, force)
    if not destination.exists():
        os.rename(staging, destination)
    else:
        # Two renames: the old artifact moves aside whole, the new one moves in whole.
        retired = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
        os.rename(destination, retired / "artifact")
        os.rename(staging, destination)
        shutil.rmtree(retired, ignore_errors=True)
    _fsync_directory(destination.parent)


def _staging_dir(destination: Path) -> Path:
    """A fresh directory beside `destination`. mkdtemp makes it 0700; it becomes the artifact, so
    it gets the mode any folder the user makes would have (0755 under umask 022)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    staging.chmod(0o777 & ~current_umask())
    return staging


def write_artifact(destination: str | Path, manifest: Manifest, files: dict[str, bytes], *,
                   force: bool = False) -> Manifest:
    """Write `files` and the manifest (with every file's sha256 and size) to `destination`;
    returns the manifest as written."""
    destination = Path(destination)
    manifest = manifest.model_copy(
        update={"files": {name: sha256_hex(data) for name, data in sorted(files.items())},
                "file_sizes": {name: len(data) for name, data in sorted(files.items())}}).sealed()
    staging = _staging_dir(destination)
    try:
        for name, data in files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
        # The manifest last: a staging directory with a manifest is complete.
        with open(staging / MANIFEST_NAME, "w") as out:
            out.write(manifest.to_json_text())
            out.flush()
            os.fsync(out.fileno())
        _install(staging, destination, force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def copy_artifact(source: str | Path, destination: str | Path, *, force: bool = False) -> Manifest:
    """Copy a verified artifact (a compile-cache entry) to `destination`, atomically."""
    verified = read_verified(source, trusted_keys=())  # our own cache entry: its files are checked, not its signer
    files = {name: data for name, data in verified.contents.items()}
    return write_artifact(destination, verified.manifest, files, force=force)
