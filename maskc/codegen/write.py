"""Write an artifact directory: the source, each mask's lowered IR, the kernels and the manifest.

A directory holds one artifact. Writing into one that holds another (a manifest other than the
one this write makes) is refused unless asked to replace it; a replacement removes the files of
the old manifest that the new one does not list, so nothing stale stays behind. Writers of one
directory take turns through a lock file, so two never interleave their files, and the second
finds the first's artifact.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

from maskc.artifact.manifest import MANIFEST_NAME, listed_names, manifest_bytes, manifest_text, open_manifest
from maskc.artifact.toolchain import toolchain
from maskc.errors import ArtifactError
from maskc.files import locked, write_atomic
from maskc.ir import Mask
from maskc.version import __version__

#: The lock file of the writers of an artifact directory, removed when released.
LOCK_NAME = ".maskc.lock"


@dataclass(frozen=True)
class LoweredMask:
    """A mask family lowered with concrete parameters."""

    name: str
    params: dict[str, Any]
    mask: Mask


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    return value


def _gather_kernels(kernels: Sequence[Path]) -> tuple[list[dict], dict[str, bytes]]:
    """The variant records of verified cache entries and their hashed files, as verified, by
    their names under `kernels/<entry>/`."""
    variants, files = [], {}
    for entry in kernels:
        manifest = open_manifest(entry)
        prefix = f"kernels/{entry.name}/"
        files.update({prefix + name: data for name, data in manifest.files.items()})
        variants += [{**v, "object": prefix + v["object"]} for v in manifest.body["variants"]]
    return variants, files


def write_artifact(
    out_dir: str | Path,
    lowered: list[LoweredMask],
    source: Path | None = None,
    kernels: Sequence[Path] = (),
    runtime_library: Path | None = None,
    plans: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `out_dir/manifest.json`, `<name>.ir.json` per mask, a copy of the source, the
    kernels of the given cache entries, optionally the runtime library and, per mask name in
    `plans`, its context-parallel plan (`Plan.to_json()`) as `<name>.plan.json`; return the
    manifest path. A directory holding another artifact is replaced only with `overwrite`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"cannot write an artifact directory at {out}: a file of that name exists")
    variants, files = _gather_kernels(kernels)
    if runtime_library is not None:
        files[runtime_library.name] = runtime_library.read_bytes()
    if source is not None:
        files[f"source{source.suffix}"] = source.read_bytes()
    masks = {}
    for item in lowered:
        ir_name = f"{item.name}.ir.json"
        files[ir_name] = item.mask.to_json().encode()
        masks[item.name] = {
            "ir": ir_name,
            "params": {k: _jsonable(v) for k, v in item.params.items()},
            "seqlen_q": item.mask.seqlen_q,
            "seqlen_k": item.mask.seqlen_k,
            "num_slices": len(item.mask),
            "area": item.mask.area(),
        }
        if plans and item.name in plans:
            plan_name = f"{item.name}.plan.json"
            files[plan_name] = plans[item.name].encode()
            masks[item.name]["plan"] = plan_name
    body = {
        "maskc_version": __version__,
        "toolchain": {"torch": torch.__version__, **toolchain()},
        "source": f"source{source.suffix}" if source is not None else None,
        "masks": masks,
        "archs": sorted({v["fields"]["arch"] for v in variants}),
        "variants": variants,
    }
    manifest = manifest_text(body, {name: hashlib.sha256(data).hexdigest() for name, data in files.items()})
    out.mkdir(parents=True, exist_ok=True)
    with locked(out / LOCK_NAME, remove=True):
        replaced = _replaced(out, manifest.encode(), overwrite)
        for name, data in files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(out / name, data)
        path = write_atomic(out / MANIFEST_NAME, manifest)
        _remove(out, replaced, files)
    return path


def _replaced(out: Path, manifest: bytes, overwrite: bool) -> list[str]:
    """The files of the artifact in `out` that writing `manifest` replaces: none where `out`
    holds no artifact or this very one; where it holds another, its files with `overwrite`, else
    an error (the other artifact's kernels and masks would be lost without a word)."""
    previous = manifest_bytes(out)
    if previous is None or previous == manifest:
        return []
    if not overwrite:
        raise ArtifactError(
            f"{out} already holds another artifact (its {MANIFEST_NAME} is not the one this compile writes): replace it "
            "with `maskc compile --overwrite` (write_artifact(..., overwrite=True)), or write to another directory"
        )
    return listed_names(out, previous)


def _remove(out: Path, names: Iterable[str], kept: Iterable[str]) -> None:
    """Remove the files `names` of a replaced artifact from `out`, but those the new one
    `kept`, and the folders they leave empty. Only regular files and links inside `out` go:
    a name whose folder leads out of `out` (through a symbolic link) is left alone."""
    root = out.resolve()
    keep = {_entry(root, name) for name in (*kept, MANIFEST_NAME, LOCK_NAME)}
    for name in sorted(names):
        target = _entry(root, name)
        if target in keep or not target.parent.is_relative_to(root) or not (target.is_symlink() or target.is_file()):
            continue
        target.unlink()
        folder = target.parent
        while folder != root and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


def _entry(root: Path, name: str) -> Path:
    """The directory entry `name` of `root`, with the symbolic links of its folders resolved."""
    rel = PurePosixPath(name)
    return Path(os.path.realpath(root / rel.parent)) / rel.name
