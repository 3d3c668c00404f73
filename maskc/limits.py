"""What maskc supports, in one place.

The limits follow from the kernels (they index tokens with 32-bit integers) and from the
sizes a user could mean (a mask of tens of millions of slices is a mistake, not a workload).
Input beyond them is refused with a message naming the limit *before* anything is
allocated, and within them every integer computation stays exact in int64: an area is below
MAX_TOKENS ** 2 < 2 ** 62, and the sum of two integers of a mask program below 2 ** 63.
"""

from __future__ import annotations

from maskc.errors import MaskError

#: Tokens of a sequence (queries or keys): the kernels' token offsets are 32-bit.
MAX_TOKENS = 2**31 - 1
#: Slices of one mask, loop iterations of one lowering, chunks of one plan.
MAX_ROWS = 2**24
#: Magnitude of any integer in a mask program or parameter.
MAX_INT = 2**62 - 1
#: Ranks of one context-parallel plan (its communication tables are cp x cp).
MAX_CP = 4096
#: Nesting depth of a mask program (blocks and expressions), within Python's recursion limit.
MAX_NESTING = 100
#: Bytes of one file an artifact directory lists, its manifest included. The largest maskc
#: writes is the CuTe-DSL runtime library (43 MB; 13 MB as shipped, xz-compressed); a kernel
#: object is under 1 MB and a mask's IR about 52 bytes a slice (5 million slices in the limit).
MAX_ARTIFACT_FILE_BYTES = 256 * 2**20
#: Bytes of all the files of one artifact directory: verifying it keeps them in memory, and a
#: kernel's files (object, header, source, PTX) are under 1 MB, so this holds a thousand kernels.
MAX_ARTIFACT_BYTES = 2**30


def check_count(count: int, limit: int, what: str, error: type[Exception] = MaskError) -> None:
    """Refuse `count` `what` beyond `limit`, naming both."""
    if count > limit:
        raise error(f"{what}: {count:,} is more than maskc supports (at most {limit:,})")
