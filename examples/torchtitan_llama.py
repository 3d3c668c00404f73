"""Train torchtitan's small Llama 3 (its debugmodel) with maskc's attention, on packed documents,
with context parallelism through maskc.dist when asked for.

    python examples/torchtitan_llama.py                                        # one process
    torchrun --nproc-per-node 2 examples/torchtitan_llama.py \\
        --parallelism.context_parallel_degree 2                                # 2 cp ranks
    torchrun --nproc-per-node 4 examples/torchtitan_llama.py \\
        --parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 2

`maskc_llama3_debugmodel` is a torchtitan config function (like those of
`torchtitan/models/llama3/config_registry.py`): torchtitan's own `llama3_debugmodel` made
maskc's by `use_maskc`, with a data loader of synthetic documents so that it runs anywhere
(CPU and gloo too; on GPUs pass `--training.mixed_precision_param bfloat16`). Every row packs
documents of random lengths; each document repeats two tokens of its own, so the next token
is predictable only from the document's own tokens, which the mask must keep apart. With your
own data, keep torchtitan's data loader and tokenizer (`--dataloader.*`, `--hf_assets_path`):
only `use_maskc` matters. torchtitan's other command-line options apply as usual.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import ConfigManager
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from maskc.integrations.torchtitan import MaskcTrainer, use_maskc

VOCAB = 2048  # the debugmodel's


class CountingTokenizer(BaseTokenizer):
    """No text here: the trainer only asks for the vocabulary size and the eos id."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, tokenizer_path: str = "") -> None:
        super().__init__()
        self.eos_id = 0

    def encode(self, text: str, **kwargs) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int], **kwargs) -> str:
        return "".join(map(chr, ids))

    def get_vocab_size(self) -> int:
        return VOCAB


class SyntheticDocuments(BaseDataLoader):
    """Rows of `seq_len` tokens packing documents of 8 to seq_len // 2 tokens, in torchtitan's
    batch format: ({"input": [B, L], "positions": [B, L]}, labels [B, L]), positions restarting
    at 0 per document and labels the next token within the document. The same batches on the
    ranks of one data-parallel rank, other batches on other ones."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0

    def __init__(self, config: Config, *, dp_rank: int, dp_world_size: int, seq_len: int, local_batch_size: int,
                 **kwargs) -> None:  # fmt: skip
        self.seq_len, self.batch_size = seq_len, local_batch_size
        self.gen = torch.Generator().manual_seed(config.seed * 1000 + dp_rank)

    def _row(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, labels, positions, left = [], [], [], self.seq_len
        while left > 0:
            n = min(left, int(torch.randint(8, max(9, self.seq_len // 2), (), generator=self.gen)))
            pair = torch.randint(1, VOCAB, (2,), generator=self.gen)
            doc = pair[torch.arange(n + 1) % 2]
            tokens.append(doc[:-1])
            labels.append(doc[1:])
            positions.append(torch.arange(n))
            left -= n
        return torch.cat(tokens), torch.cat(labels), torch.cat(positions)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            tokens, labels, positions = (torch.stack(x) for x in zip(*(self._row() for _ in range(self.batch_size))))
            yield {"input": tokens, "positions": positions}, labels

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["generator"])


def maskc_llama3_debugmodel() -> MaskcTrainer.Config:
    """torchtitan's llama3_debugmodel with maskc's attention: 6 layers of 16 heads, 256 wide,
    rows of 512 tokens, 4 per rank; no checkpoints, no validation, no activation checkpointing."""
    config = use_maskc(llama3_debugmodel())
    config.tokenizer = CountingTokenizer.Config()
    config.dataloader = SyntheticDocuments.Config()
    config.training.seq_len, config.training.local_batch_size, config.training.steps = 512, 4, 50
    config.parallelism.pipeline_parallel_schedule = "1F1B"
    config.checkpoint.enable = False
    config.validator.enable = False
    config.activation_checkpoint = None
    return config


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    config = ConfigManager().parse_args(["--module", Path(__file__).stem, "--config", "maskc_llama3_debugmodel", *sys.argv[1:]])
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
