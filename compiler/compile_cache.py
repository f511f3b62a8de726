"""A cache of whole artifacts, keyed by everything that determines their bytes: the resolved spec,
the plan, the topology, the shapes and optimizer, the library versions and mxc's own source.

Compiling an unchanged model again copies the cached artifact (after checking its hashes)
instead of recompiling: seconds instead of minutes. The source digest covers the lowering,
compilation and artifact-format modules, so editing them invalidates entries without a version
bump.
Entries live under $MXC_CACHE_DIR/artifacts (default ~/.cache/mxc); the least recently used are
removed beyond MAX_ENTRIES.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import lru_cache
from pathlib import Path

from mxc.runtime.artifact import FORMAT_VERSION, ArtifactError, Manifest, canonical_hash
from mxc.runtime.artifact_reader import installed_versions

MAX_ENTRIES = 8


def cache_root() -> Path:
    base = os.environ.get("MXC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mxc")
    return Path(base) / "artifacts"


# The modules whose code decides an artifact's bytes (relative to mxc.compiler's folder, and
# the artifact schema in the runtime's).
_COMPILER_SOURCES = ("lower", "aot.py", "default_plan.py", "topology.py", "gpu_target.py")
_RUNTIME_SOURCES = ("artifact.py",)


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the sources of lowering, compilation and the artifact format."""
    import mxc.compiler
    import mxc.runtime

    digest = hashlib.sha256()
    for package, names in ((mxc.compiler, _COMPILER_SOURCES), (mxc.runtime, _RUNTIME_SOURCES)):
        root = Path(package.__file__).parent
        for name in names:
            target = root / name
            for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
                if path.exists():
                    digest.update(path.relative_to(root).as_posix().encode())
                    digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(spec_json: dict, plan_json: dict, topology_json: dict, run_json: dict) -> str:
    versions = installed_versions().model_dump(mode="json")
    return canonical_hash({"format_version": FORMAT_VERSION, "spec": spec_json, "plan": plan_json,
                           "topology": topology_json, "run": run_json, "versions": versions,
                           "source": source_digest()})


def lookup(key: str) -> Path | None:
    """The cached artifact for `key`, if there is an intact one."""
    from mxc.runtime.artifact_reader import read_verified

    entry = cache_root() / key
    if not entry.is_dir():
        return None
    try:
        read_verified(entry, trusted_keys=())  # the cache's own entry: files checked, no signer asked
    except ArtifactError:
        shutil.rmtree(entry, ignore_errors=True)  # corrupt: recompile and store a fresh one
        return None
    os.utime(entry)  # recently used
    return entry


def store(key: str, manifest: Manifest, files: dict[str, bytes]) -> None:
    from mxc.compiler.artifact_writer import write_artifact

    root = cache_root()
    lookup(key)  # an entry that is no longer intact is removed: --force replaces only intact artifacts
    write_artifact(root / key, manifest, files, force=True)
    _evict(root)


def _evict(root: Path) -> None:
    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in entries[MAX_ENTRIES:]:
        shutil.rmtree(stale, ignore_errors=True)


def compile_to(output: str | Path, spec, topology, devices: list, plan, run, *, force: bool = False,
               use_cache: bool = True, stages=None) -> tuple[Manifest, bool]:
    """Write the artifact of `spec` on `topology` for `run` to `output`: a copy of the cached one
    where there is one, else compile_artifact's, stored in the cache too. Returns the manifest as
    written and whether it came from the cache."""
    from mxc.compiler.aot import Stages, compile_artifact, plan_json
    from mxc.compiler.artifact_writer import copy_artifact, write_artifact

    stages = stages or Stages()
    topology_json = {**topology.to_json(), "device_kind": devices[0].device_kind, "devices": len(devices)}
    key = cache_key(spec.model_dump(mode="json"), plan_json(plan), topology_json, run.to_json())
    hit = lookup(key) if use_cache else None
    if hit is not None:
        with stages.stage("copy from the compile cache"):
            return copy_artifact(hit, output, force=force), True
    artifact = compile_artifact(spec, topology, run, plan, devices=devices, stages=stages)
    with stages.stage("write artifact"):
        manifest = write_artifact(output, artifact.manifest, artifact.files, force=force)
        store(key, manifest, artifact.files)
    return manifest, False
