"""Write an artifact directory: the source, each mask's lowered IR, and the manifest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from maskc.artifact.manifest import open_manifest, write_manifest
from maskc.artifact.toolchain import toolchain
from maskc.errors import ArtifactError
from maskc.files import copy_atomic, write_atomic
from maskc.ir import Mask
from maskc.version import __version__


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


def _gather_kernels(out: Path, kernels: Sequence[Path]) -> tuple[list[dict], list[str]]:
    """Write the hashed files of verified cache entries, as verified, under `out/kernels/<entry>/`;
    their variant records and files."""
    variants, files = [], []
    for entry in kernels:
        manifest = open_manifest(entry)
        prefix = f"kernels/{entry.name}/"
        for name, data in manifest.files.items():
            target = out / prefix / name
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(target, data)
        files += [prefix + name for name in manifest.files]
        variants += [{**v, "object": prefix + v["object"]} for v in manifest.body["variants"]]
    return variants, files


def write_artifact(
    out_dir: str | Path,
    lowered: list[LoweredMask],
    source: Path | None = None,
    kernels: Sequence[Path] = (),
    runtime_library: Path | None = None,
    plans: Mapping[str, str] | None = None,
) -> Path:
    """Write `out_dir/manifest.json`, `<name>.ir.json` per mask, a copy of the source, the
    kernels of the given cache entries, optionally the runtime library and, per mask name in
    `plans`, its context-parallel plan (`Plan.to_json()`) as `<name>.plan.json`; return the
    manifest path."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"cannot write an artifact directory at {out}: a file of that name exists")
    out.mkdir(parents=True, exist_ok=True)
    variants, files = _gather_kernels(out, kernels)
    if runtime_library is not None:
        copy_atomic(runtime_library, out / runtime_library.name)
        files.append(runtime_library.name)
    if source is not None:
        copy_atomic(source, out / f"source{source.suffix}")
        files.append(f"source{source.suffix}")
    masks = {}
    for item in lowered:
        ir_name = f"{item.name}.ir.json"
        write_atomic(out / ir_name, item.mask.to_json())
        files.append(ir_name)
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
            write_atomic(out / plan_name, plans[item.name])
            files.append(plan_name)
            masks[item.name]["plan"] = plan_name
    body = {
        "maskc_version": __version__,
        "toolchain": {"torch": torch.__version__, **toolchain()},
        "source": f"source{source.suffix}" if source is not None else None,
        "masks": masks,
        "archs": sorted({v["fields"]["arch"] for v in variants}),
        "variants": variants,
        "files": files,
    }
    return write_manifest(out, body)
