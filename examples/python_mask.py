"""The varlen block-causal mask of varlen_block_causal.mask, written with the Python front.

`@maskc.mask` lowers each family once at import with its defaults, so a mistake fails here
rather than at the first training step. Run this file to compare both versions with the DSL.
"""

from __future__ import annotations

from pathlib import Path

import maskc


@maskc.mask
def varlen_block_causal(b: maskc.Builder, docs: maskc.SeqLens = (3000, 1500, 4000), block: int = 1024) -> None:
    """Vectorised: one call emits the slices of every block of every document."""
    b.seqlen(docs.end)
    blocks = b.chunks((docs.starts, docs.ends), block)
    b.full(q=blocks, k=(docs.starts[blocks.owner], blocks.ends))


@maskc.mask(example={"docs": [5, 3], "block": 2})
def varlen_block_causal_loops(b: maskc.Builder, docs: maskc.SeqLens = (3000, 1500, 4000), block: int = 1024) -> None:
    """The same mask read naturally, one document and one block at a time (slow for 1000s of documents)."""
    b.seqlen(docs.end)
    for d in docs:
        for blk in b.chunks(d, block):
            b.full(q=blk, k=(d.start, blk.end))


if __name__ == "__main__":
    from maskc.frontend import load

    dsl = load(Path(__file__).with_name("varlen_block_causal.mask"))["varlen_block_causal"]
    params = {"docs": [700, 2500, 90, 1300], "block": 512}
    fast = varlen_block_causal.lower(**params)
    slow = varlen_block_causal_loops.lower(**params)
    reference = dsl.lower(**params)
    print(fast)
    print("vectorised == loops == DSL:", fast.equivalent(slow) and fast.equivalent(reference))
