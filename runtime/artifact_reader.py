"""Reading an artifact and deciding whether it may run here, before any executable is touched.

Order matters: the format version is read first (a newer format may mean anything), then the
schema, then every file's size (before it is read) and sha256 (the bytes that are checked are
the bytes later deserialised), then the live devices. XLA checks none of this itself: a flipped byte can deserialise and then
crash the process, and an executable for 8 devices loads silently on 16.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from mxc.runtime.artifact import (FORMAT_VERSION, MANIFEST_NAME, ArtifactError, ArtifactFormatField, Manifest,
                                  Topology, Versions, manifest_digest, sha256_hex)
from mxc.runtime.signing import SIGNATURE_NAME, check_signature, trusted_keys_from_env
from mxc.runtime.strict_json import JsonFileError, parse_json, read_bounded


@dataclass(frozen=True)
class VerifiedArtifact:
    directory: Path
    manifest: Manifest
    contents: dict[str, bytes]  # relative path -> the bytes whose hash was checked


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_versions() -> Versions:
    import jax
    import jaxlib

    from mxc import __version__

    return Versions(jax=jax.__version__, jaxlib=jaxlib.__version__, libtpu=_package_version("libtpu"),
                    cuda_plugin=_package_version("jax-cuda12-pjrt"), mxc=__version__)


def _manifest_bytes(directory: Path) -> bytes:
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise ArtifactError(f"{directory} is not an artifact: no such directory")
    if not path.is_file():
        raise ArtifactError(f"{directory} is not an mxc artifact: it has no {MANIFEST_NAME}")
    try:
        return read_bounded(path)
    except JsonFileError as err:
        raise ArtifactError(str(err)) from None


def _manifest_data(directory: Path, raw: bytes | None = None) -> tuple[Path, dict, int]:
    """(manifest path, its JSON object, its format version), read with bounds, before any schema."""
    path = directory / MANIFEST_NAME
    raw = _manifest_bytes(directory) if raw is None else raw
    try:
        data = parse_json(raw, path)
    except JsonFileError as err:
        raise ArtifactError(str(err)) from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} is not a JSON object: expected an artifact manifest")
    try:
        found = ArtifactFormatField.model_validate(data).format_version
    except ValidationError:
        raise ArtifactError(f"{path} has no integer format_version: expected {FORMAT_VERSION}") from None
    return path, data, found


def read_manifest(directory: str | Path, raw: bytes | None = None) -> Manifest:
    """The manifest (from `raw`, its bytes already read, if given), its format version checked
    first and then its schema."""
    directory = Path(directory)
    path, data, found = _manifest_data(directory, raw)
    if found > FORMAT_VERSION:
        raise ArtifactError(f"{directory} has artifact format {found}, newer than this mxc reads: expected "
                            f"format {FORMAT_VERSION}, found {found}; upgrade mxc to run it")
    if found < FORMAT_VERSION:
        raise ArtifactError(f"{directory} has artifact format {found}, which this mxc no longer reads: "
                            f"expected format {FORMAT_VERSION}, found {found}; compile the model again "
                            f"(recompile it: mxc compile MODEL ... -o {directory} --force)")
    expected = data.get("manifest_sha256")
    found = manifest_digest(data)
    if expected != found:
        raise ArtifactError(f"{path} is corrupt or was modified: expected manifest_sha256 {expected}, "
                            f"found {found}")
    try:
        return Manifest.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()[:5])
        raise ArtifactError(f"{path} does not follow artifact format {FORMAT_VERSION}: {problems}") from None


def replaceable_files(directory: str | Path) -> set[str]:
    """The files listed by the manifest of an mxc artifact of this format or an older one (its
    manifest_sha256 checked): what `mxc compile --force` may replace. An artifact too old to run
    is still ours to replace with a new build."""
    directory = Path(directory)
    path, data, found = _manifest_data(directory)
    if found >= FORMAT_VERSION:
        return set(read_manifest(directory).files)
    if data.get("manifest_sha256") != manifest_digest(data) or not isinstance(data.get("files"), dict):
        raise ArtifactError(f"{path} is corrupt or was modified (artifact format {found})")
    return set(data["files"])


def _listed_files(directory: Path) -> set[str]:
    found = set()
    for path in directory.rglob("*"):
        relative = path.relative_to(directory).as_posix()
        if path.is_symlink():
            raise ArtifactError(f"{directory} holds a symbolic link, {relative}: an artifact holds plain "
                                "files only")
        if path.is_file() and relative not in (MANIFEST_NAME, SIGNATURE_NAME):
            found.add(relative)
    return found


def read_listed_file(path: Path, size: int) -> bytes:
    """The bytes of a listed file, refused before it is read when its size is not the recorded
    one, and never read beyond that size (a file that grows meanwhile is refused too)."""
    with open(path, "rb") as f:
        found = os.fstat(f.fileno()).st_size
        if found != size:
            raise ArtifactError(f"{path} is corrupt or was modified: expected {size:,} bytes (as its manifest "
                                f"records), found {found:,}")
        data = f.read(size + 1)
    if len(data) != size:
        raise ArtifactError(f"{path} changed while it was read: expected {size:,} bytes, read {len(data):,}")
    return data


def verify_files(directory: str | Path, manifest: Manifest) -> dict[str, bytes]:
    """Every listed file present with its size and sha256, and nothing unlisted; returns their bytes."""
    directory = Path(directory)
    present = _listed_files(directory)
    missing = sorted(set(manifest.files) - present)
    if missing:
        raise ArtifactError(f"{directory} is incomplete: expected {', '.join(missing)}, found no such file")
    extra = sorted(present - set(manifest.files))
    if extra:
        raise ArtifactError(f"{directory} holds files its manifest does not list ({', '.join(extra)}): "
                            "expected only the listed files")
    unsized = sorted(set(manifest.files) - set(manifest.file_sizes))
    if unsized:
        raise ArtifactError(f"{directory / MANIFEST_NAME} records no size for {', '.join(unsized)}: expected "
                            f"a size for every listed file (format {FORMAT_VERSION}); compile the model again")
    contents = {}
    for relative, expected in sorted(manifest.files.items()):
        data = read_listed_file(directory / relative, manifest.file_sizes[relative])
        found = sha256_hex(data)
        if found != expected:
            raise ArtifactError(f"{directory / relative} is corrupt or was modified: expected sha256 "
                                f"{expected}, found {found}")
        contents[relative] = data
    for function in manifest.functions.values():
        for relative in (function.executable, function.export):
            if relative not in manifest.files:
                raise ArtifactError(f"function {function.name} names {relative}, which the manifest's "
                                    "files do not list")
    return contents


def check_signer(directory: str | Path, trusted_keys: list) -> bytes:
    """The manifest's bytes, once its signature by one of `trusted_keys` is checked (and nothing
    else of the artifact read); an ArtifactError names a key file that cannot be used."""
    raw = _manifest_bytes(Path(directory))
    check_signature(directory, raw, list(trusted_keys))
    return raw


def read_verified(directory: str | Path, trusted_keys: list | None = None) -> VerifiedArtifact:
    """The artifact with every file checked. With trusted keys (`trusted_keys`, else those named by
    $MXC_TRUSTED_KEYS) the manifest's signature is checked first, on the very bytes then parsed."""
    keys = trusted_keys_from_env() if trusted_keys is None else list(trusted_keys)
    raw = check_signer(directory, keys) if keys else _manifest_bytes(Path(directory))
    manifest = read_manifest(directory, raw)
    return VerifiedArtifact(Path(directory), manifest, verify_files(directory, manifest))


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def device_mismatches(topology: Topology, devices: list) -> list[str]:
    """What differs between the topology compiled for and the live devices (empty: they match)."""
    if not devices:
        return [f"expected {_count(topology.devices, topology.device_kind + ' device')}, found none"]
    platform = devices[0].platform
    kinds = sorted({d.device_kind for d in devices})
    problems = []
    if platform != topology.platform or kinds != [topology.device_kind]:
        problems.append(f"expected {topology.platform} devices of kind {topology.device_kind!r}, "
                        f"found {platform} devices of kind {', '.join(repr(k) for k in kinds)}")
    if len(devices) != topology.devices:
        problems.append(f"expected {topology.devices} devices, found {len(devices)}")
    if problems:
        return problems
    by_id = devices_by_topology_id(topology, devices)
    absent = [i for i in topology.device_ids if i not in by_id]
    if absent:
        return [f"expected device ids {topology.device_ids[:8]}..., found ids "
                f"{sorted(by_id)[:8]}... ({len(absent)} expected ids absent)"]
    if topology.device_coords is not None:
        for device_id, coords in zip(topology.device_ids, topology.device_coords):
            live = getattr(by_id[device_id], "coords", None)
            if live is not None and list(live) != coords:
                problems.append(f"expected device {device_id} at coordinates {coords} of a "
                                f"{'x'.join(map(str, topology.shape))} slice, found it at {list(live)}")
                break
    return problems


def devices_by_topology_id(topology: Topology, devices: list) -> dict:
    """The live device standing for each device id of the topology. Virtual CPU devices are
    numbered by process (two processes of 4: ids 0-3 and 2048-2051), so they are matched by
    position, processes in order; every other platform's ids are global and matched as they are."""
    if topology.platform == "cpu" and len(devices) == len(topology.device_ids):
        live = sorted(devices, key=lambda d: (d.process_index, d.id))
        return dict(zip(sorted(topology.device_ids), live))
    return {d.id: d for d in devices}


def check_devices(topology: Topology, devices: list) -> None:
    problems = device_mismatches(topology, devices)
    if problems:
        raise ArtifactError(f"this artifact was compiled for {topology.name} ({topology.devices} "
                            f"{topology.device_kind} devices, mesh "
                            f"{' x '.join(f'{k}={v}' for k, v in topology.mesh.items())}) and cannot run on "
                            f"these devices: " + "; ".join(problems))


def version_differences(built: Versions, platform: str, live: Versions | None = None) -> list[str]:
    """The libraries whose version differs and matters for this platform's executables."""
    live = live or installed_versions()
    names = ["jax", "jaxlib"] + {"tpu": ["libtpu"], "gpu": ["cuda_plugin"]}.get(platform, [])
    return [f"{name} {getattr(built, name)} -> {getattr(live, name)}" for name in names
            if getattr(built, name) != getattr(live, name)]
