"""Train a tiny GQA transformer on packed documents with a varlen block-causal mask.

Every step packs fresh documents of different lengths into one sequence, lowers
examples/varlen_block_causal.mask for them (the mask changes every step) and runs
attention through `maskc.attention` (GPU kernels) or `maskc.reference_attention` (any
device). A block-causal mask lets a token see later tokens of its own block, so the model
learns masked-token prediction, as block-causal (video) models do, not next-token
prediction: 15% of the tokens are replaced by a mask token and predicted from context.
Each document alternates two tokens of its own, so a masked token is the one two positions
away: predictable only from its own document, which the mask must therefore get right.

    python examples/train_tiny.py --attention reference --device cpu --steps 30 --seqlen 256
    maskc compile examples/varlen_block_causal.mask -o tiny_kernels --head-dim 64 --heads 2:1 --bundle-runtime
    python examples/train_tiny.py --attention maskc --device cuda --steps 200 --compare --artifacts tiny_kernels
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import maskc
from maskc.frontend import load

ROOT = Path(__file__).resolve().parent
VOCAB = 64
MASK_TOKEN = VOCAB  # one extra embedding row


class Attention(nn.Module):
    """GQA self-attention over a packed sequence; the mask decides who sees whom."""

    def __init__(self, dim: int, heads_q: int, heads_kv: int, attend: Callable):
        super().__init__()
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, dim // heads_q
        self.qkv = nn.Linear(dim, (heads_q + 2 * heads_kv) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.attend = attend

    def forward(self, x: torch.Tensor, mask: maskc.Mask) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split(
            [self.heads_q * self.head_dim, self.heads_kv * self.head_dim, self.heads_kv * self.head_dim], dim=-1
        )
        q = q.reshape(t, self.heads_q, self.head_dim).contiguous()
        k = k.reshape(t, self.heads_kv, self.head_dim).contiguous()
        v = v.reshape(t, self.heads_kv, self.head_dim).contiguous()
        out, _ = self.attend(q, k, v, mask)
        return self.proj(out.reshape(t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads_q: int, heads_kv: int, attend: Callable):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads_q, heads_kv, attend)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: maskc.Mask) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class TinyModel(nn.Module):
    def __init__(self, dim: int, layers: int, heads_q: int, heads_kv: int, max_len: int, attend: Callable):
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, dim)
        self.position = nn.Embedding(max_len, dim)  # position inside the document
        self.blocks = nn.ModuleList(Block(dim, heads_q, heads_kv, attend) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: maskc.Mask) -> torch.Tensor:
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def batch(seqlen: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Documents of random lengths packed into `seqlen` tokens: (lengths, tokens, positions)."""
    lengths, left = [], seqlen
    while left > 0:
        n = min(left, int(torch.randint(8, max(9, seqlen // 3), (), generator=gen)))
        lengths.append(n)
        left -= n
    tokens, positions = [], []
    for n in lengths:
        pair = torch.randint(0, VOCAB, (2,), generator=gen)
        tokens.append(pair[torch.arange(n) % 2])
        positions.append(torch.arange(n))
    return lengths, torch.cat(tokens), torch.cat(positions)


def train(attention: str, device: str, steps: int, seqlen: int, seed: int, dtype: torch.dtype) -> list[float]:
    """Masked-token loss at every step of a fixed-seed run."""
    torch.manual_seed(seed)
    attend = maskc.attention if attention == "maskc" else maskc.reference_attention
    model = TinyModel(dim=128, layers=2, heads_q=2, heads_kv=1, max_len=seqlen, attend=attend).to(device)  # GQA, d=64
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    family = load(ROOT / "varlen_block_causal.mask")["varlen_block_causal"]
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        lengths, tokens, positions = batch(seqlen, gen)
        mask = family.lower(docs=lengths, block=32)
        hidden = torch.rand(seqlen, generator=gen) < 0.15
        inputs = torch.where(hidden, MASK_TOKEN, tokens)
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs.to(device), positions.to(device), mask)
        loss = F.cross_entropy(logits.float()[hidden.to(device)], tokens.to(device)[hidden.to(device)])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", choices=("maskc", "reference"), default="maskc")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="store_true", help="also train with the reference attention and compare")
    parser.add_argument("--json", type=Path, help="write the loss curves here")
    parser.add_argument("--artifacts", type=Path, action="append", default=[],
                        help="a `maskc compile` directory with the kernels (else they compile on first use)")
    args = parser.parse_args()
    for directory in args.artifacts:
        maskc.runtime.register_artifact(directory)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    curves = {args.attention: train(args.attention, args.device, args.steps, args.seqlen, args.seed, dtype)}
    if args.compare and args.attention != "reference":
        curves["reference"] = train("reference", args.device, args.steps, args.seqlen, args.seed, dtype)
    for step in range(0, args.steps, max(1, args.steps // 10)):
        print(f"step {step:4d}  " + "  ".join(f"{name} {c[step]:.4f}" for name, c in curves.items()))
    if len(curves) == 2:
        a, b = curves.values()
        gap = max(abs(x - y) for x, y in zip(a, b))
        print(f"largest loss difference between maskc and the reference: {gap:.4f} (final {a[-1]:.4f} vs {b[-1]:.4f})")
    if args.json:
        args.json.write_text(json.dumps(curves))
    start = sum(curves[args.attention][:5]) / min(5, args.steps)
    end = sum(curves[args.attention][-5:]) / min(5, args.steps)
    print(f"{args.attention}: mean loss of the first 5 steps {start:.3f}, of the last 5 {end:.3f} (uniform: {math.log(VOCAB):.3f})")


if __name__ == "__main__":
    main()
