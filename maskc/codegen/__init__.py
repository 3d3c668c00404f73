"""From IR to artifacts: variant selection, rendering, compiling and writing artifact directories."""

from maskc.codegen.write import LoweredMask, write_artifact

__all__ = ["LoweredMask", "write_artifact"]
