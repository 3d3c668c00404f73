"""Fine-tune a small Hugging Face causal LM on packed documents with attn_implementation="maskc".

Each step packs synthetic documents of varied lengths into one row with Transformers'
DataCollatorWithFlattening: positions restart at 0 where a document begins, and the first
token of each document is no target, so no loss term crosses a document boundary. maskc reads
the documents from position_ids and keeps them apart in attention, without a dense mask.
Each document alternates two tokens of its own, so a token is the one two places before it
in its own document: the loss falls from ln(vocabulary) as the model learns to look there,
which it can only where attention keeps the documents apart.

The model is built from a config (no download); with a checkpoint, `from_pretrained(name,
attn_implementation="maskc")` is the only change. A GPU is used when there is one, in bf16
autocast; on a CPU, maskc runs its reference attention in float32 (the default run takes about
a minute).

    python examples/hf_packed_finetune.py
    python examples/hf_packed_finetune.py --tokens 8192                  # a GPU: about 5 s on an H200
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

import maskc.integrations.transformers  # noqa: F401  (registers attn_implementation="maskc")

VOCAB = 128


def documents(tokens: int, gen: torch.Generator) -> list[dict[str, list[int]]]:
    """Documents of 16 to 256 tokens, `tokens` in all; each alternates two tokens of its own."""
    out, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(16, 257, (), generator=gen)))
        pair = torch.randperm(VOCAB, generator=gen)[:2]
        out.append({"input_ids": pair[torch.arange(n) % 2].tolist()})
        left -= n
    return out


def train(steps: int, tokens: int, device: str, seed: int = 0, lr: float = 3e-3) -> list[float]:
    """The loss of every step of a fixed-seed run (bf16 autocast on a GPU, float32 on a CPU)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="maskc").to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    collate = DataCollatorWithFlattening()
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        batch = {name: t.to(device) for name, t in collate(documents(tokens, gen)).items()}
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(**batch, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens packed into the row of each step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    losses = train(args.steps, args.tokens, args.device, args.seed)
    for step in range(0, args.steps, max(1, args.steps // 10)):
        print(f"step {step:4d}  loss {losses[step]:.4f}")
    start, end = sum(losses[:5]) / min(5, len(losses)), sum(losses[-5:]) / min(5, len(losses))
    print(f"mean loss of the first 5 steps {start:.3f}, of the last 5 {end:.3f} (uniform: {math.log(VOCAB):.3f})")


if __name__ == "__main__":
    main()
