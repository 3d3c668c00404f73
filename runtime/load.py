"""An artifact directory as the runtime sees it: a verified manifest and the masks' IR."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maskc.artifact.manifest import open_manifest
from maskc.errors import ArtifactError, MaskError
from maskc.ir import Mask


@dataclass(frozen=True)
class Artifact:
    directory: Path
    manifest: dict[str, Any]
    masks: dict[str, Mask]


def load_artifact(directory: str | Path, sha256: str | None = None) -> Artifact:
    """Verify an artifact directory (`sha256` pins its manifest) and load the IR of every mask it holds."""
    manifest = open_manifest(directory, sha256)
    masks = {}
    for name, entry in manifest.body.get("masks", {}).items():
        try:
            masks[name] = Mask.from_json(manifest.files[entry["ir"]].decode())
        except (MaskError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"IR of mask {name!r} in {directory} is invalid: {exc}") from None
    return Artifact(Path(directory), manifest.body, masks)
