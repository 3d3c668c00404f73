"""Loading and running compiled artifacts; needs torch only (no lark, jinja2 or DSL compiler)."""

from maskc.runtime.artifact import Artifact, load_artifact
from maskc.runtime.attention import attention, register_artifact
from maskc.runtime.manifest import FORMAT_VERSION, MANIFEST_NAME, read_manifest

__all__ = ["Artifact", "attention", "register_artifact", "FORMAT_VERSION", "MANIFEST_NAME", "load_artifact", "read_manifest"]
