"""An artifact directory as the runtime sees it: a verified manifest and the masks' IR."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maskc.errors import ArtifactError, MaskError
from maskc.ir import Mask
from maskc.runtime.manifest import read_manifest


@dataclass(frozen=True)
class Artifact:
    directory: Path
    manifest: dict[str, Any]
    masks: dict[str, Mask]


def load_artifact(directory: str | Path) -> Artifact:
    """Verify an artifact directory and load the IR of every mask it holds."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    masks = {}
    for name, entry in manifest.get("masks", {}).items():
        ir_file = entry.get("ir") if isinstance(entry, dict) else None
        if ir_file not in manifest["files"]:
            raise ArtifactError(f"mask {name!r} in {directory} has no hashed IR file")
        try:
            masks[name] = Mask.from_json((directory / ir_file).read_text())
        except MaskError as exc:
            raise ArtifactError(f"IR of mask {name!r} in {directory} is invalid: {exc}") from None
    return Artifact(directory, manifest, masks)
