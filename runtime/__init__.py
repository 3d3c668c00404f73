"""Loading and running compiled artifacts; needs torch only (no lark, jinja2 or DSL compiler).

`registry` holds the kernels (registered from artifact directories, or compiled on first use
through the kernel source `import maskc` registers), `call_plan` decides one call's kernels and
schedules on one GPU, `prepared` does that ahead of time (`maskc.prepare`), `masks` finds a
call's mask from the tensors the ops get, `ops` runs the attention as torch custom ops, `api`
is `maskc.attention`; `launch` runs exported objects through the DSL's runtime library, `load`
reads an artifact's masks.
"""

from maskc.artifact.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, open_manifest, read_manifest
from maskc.runtime.api import attention
from maskc.runtime.load import Artifact, load_artifact
from maskc.runtime.masks import PositionMask
from maskc.runtime.prepared import PreparedMask, prepare, target_for
from maskc.runtime.registry import register_artifact

__all__ = [
    "Artifact",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "Manifest",
    "PositionMask",
    "PreparedMask",
    "attention",
    "load_artifact",
    "open_manifest",
    "prepare",
    "read_manifest",
    "register_artifact",
    "target_for",
]
