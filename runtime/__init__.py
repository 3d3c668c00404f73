"""Loading and running compiled artifacts; needs torch only (no lark, jinja2 or DSL compiler)."""

from maskc.runtime.artifact import Artifact, load_artifact
from maskc.runtime.attention import attention, register_artifact
from maskc.runtime.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, open_manifest, read_manifest

__all__ = [
    "Artifact",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "attention",
    "load_artifact",
    "open_manifest",
    "read_manifest",
    "register_artifact",
]
