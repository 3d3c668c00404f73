"""A compiled training step with a new mask every step, against the same step with one fixed mask.

The step: torch.compile(fullgraph=True) of LAYERS attention calls (each layer's q from the last
layer's output) over 16k tokens of packed documents (real lengths), forward and backward, bf16,
32:8 heads, d=128. Every way runs the same sequence of masks (the GPU's work is the same);
what differs is what a mask costs the step:
- `masks planned before`: the masks' plans are already made (as with one fixed mask: the floor);
- `new mask, planned in the step`: each mask is new, planned inside the first op that sees it;
- `new mask, prepared`: each mask is new, planned ahead by `maskc.prepare` (as a DataLoader
  worker would) and passed through pickle, so the step only decodes its plan.
Steps run back to back without synchronising (a training loop's steady state: the host prepares
step i + 1 while the GPU runs step i); the time per step is the wall time over STEPS steps.

Run on a GPU: `python bench/step.py [--steps 50]`; appends host rows (ms per step) to
bench/results (or --out; see bench/README.md) and prints them.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import draw_doc_lengths  # noqa: E402
from record import RESULTS, Run  # noqa: E402

import maskc  # noqa: E402
from maskc.ir import Mask  # noqa: E402

TOKENS, LAYERS, HQ, HKV, D = 16384, 4, 32, 8, 128


def packed_mask(rng: np.random.Generator) -> Mask:
    """TOKENS tokens of whole documents with real lengths, the last one cut to fit."""
    lengths = np.minimum(draw_doc_lengths(64, rng), TOKENS)
    ends = np.cumsum(lengths)
    cu = np.r_[0, ends[ends < TOKENS], TOKENS]
    return Mask.from_cu_seqlens(cu, causal=True)


def step(q, k, v, mask):
    x = q
    for _ in range(LAYERS):
        x, _ = maskc.attention(x, k, v, mask)
    return x.float().square().mean()


def time_steps(compiled, leaves: list[torch.Tensor], masks: list, steps: int) -> float:
    """Milliseconds per step over `steps` steps run back to back, after two warm-up steps."""
    for mask in masks[:2]:
        compiled(*leaves, mask).backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        compiled(*leaves, masks[2 + i]).backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results files (default: bench/results)")
    args = parser.parse_args()
    run = Run.start("step", torch.cuda.get_device_name(), args.out)
    rng = np.random.default_rng(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(TOKENS, h, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_() for h in (HQ, HKV, HKV)]
    target = maskc.target_for("cuda", num_heads_q=HQ, num_heads_kv=HKV, head_dim=D)
    tables = [packed_mask(rng).table for _ in range(args.steps + 2)]
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    planned = [Mask.from_table(t.clone()) for t in tables]
    time_steps(compiled, leaves, planned, args.steps)  # plans them
    ways = {
        "masks planned before": planned,
        "new mask, planned in the step": [Mask.from_table(t.clone()) for t in tables],
        # Through pickle, as from a DataLoader worker: the step sees only the tensors.
        "new mask, prepared": [pickle.loads(pickle.dumps(maskc.prepare(Mask.from_table(t.clone()), target))) for t in tables],
    }
    case = f"compiled {TOKENS // 1024}k-token step ({LAYERS} attention layers, fwd + bwd, {HQ}:{HKV} heads, d={D}, bf16)"
    times = {}
    for way, masks in ways.items():
        times[way] = time_steps(compiled, leaves, masks, args.steps)
        row = run.write("host", step=f"{case}, {way}", ms=times[way])
        floor = times["masks planned before"]
        print(f"{row['step']}: {times[way]:.2f} ms/step ({(times[way] / floor - 1) * 100:+.1f}%)", flush=True)


if __name__ == "__main__":
    main()
