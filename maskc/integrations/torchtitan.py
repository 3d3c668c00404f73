"""maskc as torchtitan's attention backend, with context parallelism through `maskc.dist`
(torchtitan 0.3.0, the `torchtitan` extra).

    from maskc.integrations.torchtitan import use_maskc
    config = use_maskc(llama3_debugmodel())       # a Trainer.Config -> MaskcTrainer.Config
    trainer = config.build()                      # every layer attends with maskc

torchtitan picks a model's attention by its inner-attention config
(`torchtitan/models/common/config_utils.py:get_attention_config`: flex or varlen) and its
trainer builds the masks of those two types only (`Trainer.post_dataloading_process`,
`Decoder.get_attention_masks`), from the `positions` its data loader emits (they restart at
0 where a document begins: `torchtitan/hf_datasets/text_datasets.py`). `use_maskc` swaps every
inner attention for `MaskcAttention`, whose `forward(q, k, v, *, attention_masks, scale,
enable_gqa, out_transform)` keeps the contract of torchtitan's `FlexAttention` and
`VarlenAttention` ([B, L, N, H] in and out), and `MaskcTrainer.post_dataloading_process` builds
maskc's mask instead: the documents of `positions` (or of a `document_ids` entry a data loader
of yours adds), causal within each document, as torchtitan's block-causal masks are.

Context parallelism: with `parallelism.context_parallel_degree` > 1, torchtitan's own sharding
(`torchtitan/distributed/context_parallel/api.py`: a head-tail split of every row and K/V
all-gathered in every layer) is not used. The trainer plans the step's mask over the cp ranks
(`maskc.dist.make_plan`, the rows of the batch laid end to end), or takes the plan a data
loader's worker made of it (a CP_PLAN entry, `plan_batch`), dispatches the tokens, labels
and positions (`dispatch_batch`), and every layer runs `maskc.dist.attention` on the rank's
tokens. The model's output and the loss stay on each rank's tokens: torchtitan sums the loss
over ranks and divides by the batch's token count, and FSDP2 (over the dp-shard and cp ranks,
as torchtitan lays it out) sums the gradients. `ContextParallelMask.undispatch` gives back a
whole batch's tensor (e.g. the logits) where one is needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

import maskc
import maskc.dist
from maskc.errors import MaskcError
from maskc.lazy import optional_imports

with optional_imports("maskc.integrations.torchtitan"):
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention
    from torchtitan.protocols.module import Module
    from torchtitan.trainer import Trainer

DOCUMENT_IDS = "document_ids"
"""The data loader's optional input entry with one document id per token ([B, L]; < 0 marks
padding), used instead of `positions` for the mask; the model never sees it."""

CP_PLAN = "cp_plan"
"""The data loader's optional input entry under context parallelism: the batch's plan for this
cp rank, made in the loader's worker (`plan_batch`), so that the step plans nothing; the model
never sees it."""


class TorchtitanAttentionError(MaskcError, ValueError):
    """torchtitan asks maskc's backend for something it does not do, or passes inputs that do
    not fit it."""


@dataclass(frozen=True, eq=False)
class ContextParallelMask:
    """What every layer's attention needs under context parallelism: the step's plan over the
    batch's rows laid end to end, the cp process group, and the batch shape (for `undispatch`)."""

    plan: maskc.dist.Plan | maskc.dist.PreparedPlan
    group: Any
    batch: int
    seqlen: int

    def undispatch(self, x_local: torch.Tensor) -> torch.Tensor:
        """The whole batch [B, L, ...] on every rank from each rank's [1, T_local, ...] part
        (differentiable: the gradient goes back to each rank's part)."""
        if x_local.ndim < 2 or x_local.shape[0] != 1:
            raise TorchtitanAttentionError(f"expected this rank's [1, tokens, ...] tensor, got shape {tuple(x_local.shape)}")
        full = maskc.dist.undispatch(x_local[0], self.plan, self.group)
        return full.reshape(self.batch, self.seqlen, *full.shape[1:])


Masks = maskc.Mask | maskc.PositionMask | maskc.PreparedMask | ContextParallelMask


class MaskcAttention(Module):
    """torchtitan's inner attention with maskc: q [B, L, Nq, H], k and v [B, L, Nkv, H] (GQA
    when Nkv divides Nq; `enable_gqa` is implied) -> out [B, L, Nq, H]. maskc's kernels on CUDA
    tensors, its reference attention on CPU ones. `attention_masks` is what
    `MaskcTrainer.post_dataloading_process` builds: a mask over one row or the whole batch
    (`document_mask`), or a `ContextParallelMask`, with which q, k and v are this rank's
    dispatched tokens [1, T_local, N, H]. `out_transform(out, lse)` gets lse as [B, L, Nq], as
    torchtitan's FlexAttention gives it."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: Masks | None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if kwargs.get("score_mod") is not None:
            raise TorchtitanAttentionError("a FlexAttention score_mod: maskc cannot run a Python score function")
        # Mixed dtypes reach here when RoPE promotes q and k; maskc takes one, q's.
        k_BLNH, v_BLNH = (x.to(q_BLNH.dtype) for x in (k_BLNH, v_BLNH))
        if isinstance(attention_masks, ContextParallelMask):
            if q_BLNH.shape[0] != 1:
                raise TorchtitanAttentionError(
                    f"under context parallelism q must be this rank's [1, tokens, heads, dim], got {tuple(q_BLNH.shape)}"
                )
            out, meta = maskc.dist.attention(q_BLNH[0], k_BLNH[0], v_BLNH[0], attention_masks.plan, softmax_scale=scale,
                                             group=attention_masks.group)  # fmt: skip
            out, lse = out.unsqueeze(0), meta.lse.unsqueeze(0)
        elif isinstance(attention_masks, (maskc.Mask, maskc.PositionMask, maskc.PreparedMask)):
            out, meta = maskc.attention(q_BLNH, k_BLNH, v_BLNH, attention_masks, softmax_scale=scale)
            lse = meta.lse
        else:
            raise TorchtitanAttentionError(
                f"MaskcAttention needs a maskc mask as attention_masks, got {type(attention_masks).__name__}: train with "
                "MaskcTrainer (use_maskc) or pass document_mask(positions)"
            )
        return out if out_transform is None else out_transform(out, lse)


def _document_starts(positions: torch.Tensor | None, document_ids: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """[B, L] bools, true where a document begins: where `positions` is 0 (torchtitan's
    convention, `get_document_mask_mod`) or `document_ids` changes, and at every row's start."""
    if document_ids is not None:
        starts = torch.ones(shape, dtype=torch.bool, device=document_ids.device)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    else:
        starts = positions == 0
        starts[:, 0] = True
    return starts


def _check_rows(name: str, x: torch.Tensor | None, shape: torch.Size) -> None:
    if x is not None and (not isinstance(x, torch.Tensor) or x.shape != shape or x.is_floating_point()):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise TorchtitanAttentionError(f"{name} must be an integer tensor shaped like the tokens {tuple(shape)}, got {got}")


def document_mask(
    inputs: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
) -> maskc.PositionMask | maskc.Mask:
    """The causal document mask of one process's batch `inputs` [B, L]: from `positions` a
    `maskc.PositionMask` (read inside the op: new documents every step compile nothing under
    torch.compile), from `document_ids` (< 0: padding) a mask over the whole batch, built on
    the host; without either each row is one document."""
    shape = inputs.shape
    _check_rows("positions", positions, shape)
    _check_rows(DOCUMENT_IDS, document_ids, shape)
    if document_ids is None:
        if positions is None:
            positions = torch.arange(shape[1], device=inputs.device).expand(shape)
        return maskc.PositionMask(positions, causal=True)
    return maskc.Mask.stack([maskc.Mask.from_document_ids(row.cpu(), causal=True) for row in document_ids])


def packed_document_mask(
    inputs: torch.Tensor, positions: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
) -> maskc.Mask:
    """The same documents as `document_mask`, as one mask over the batch's rows laid end to end
    (B * L tokens), which context parallelism plans and dispatches as one sequence."""
    shape = inputs.shape
    _check_rows("positions", positions, shape)
    _check_rows(DOCUMENT_IDS, document_ids, shape)
    if positions is None and document_ids is None:
        positions = torch.arange(shape[1]).expand(shape)
    ids = torch.cumsum(_document_starts(positions, document_ids, shape).flatten().cpu(), 0) - 1
    if document_ids is not None:
        ids = torch.where(document_ids.flatten().cpu() < 0, -1, ids)
    return maskc.Mask.from_document_ids(ids, causal=True)


def plan_batch(
    inputs: torch.Tensor,
    cp_size: int,
    rank: int,
    target: Any,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> maskc.dist.PreparedPlan:
    """The plan of a batch's documents (`packed_document_mask`) for cp rank `rank` of `cp_size`,
    with its kernels' schedules for `target` (`maskc.target_for`; None on CPUs): what a data
    loader's worker adds to the batch's input dict as CP_PLAN, so that `MaskcTrainer` neither
    builds the mask nor plans it in the step."""
    return maskc.dist.prepare_plan(packed_document_mask(inputs, positions, document_ids), cp_size, rank, target)


def dispatch_batch(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    extra: dict[str, Any],
    group: Any,
    document_ids: torch.Tensor | None = None,
    prepared: maskc.dist.PreparedPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """This rank's part of a batch that every rank of the cp `group` holds whole: the inputs,
    labels and `extra["positions"]` of its dispatched tokens, [1, T_local], and
    `extra["attention_masks"]`, the `ContextParallelMask` of the step's plan: `prepared`, this
    rank's plan of the batch made ahead (`plan_batch`, from these very inputs), else planned
    now. The plan's padding tokens (it pads the B * L tokens to whole chunks per rank) get the
    label IGNORE_INDEX."""
    if inputs.ndim != 2 or labels.shape != inputs.shape:
        raise TorchtitanAttentionError(
            f"expected inputs and labels [batch, seq_len], got {tuple(inputs.shape)} and {tuple(labels.shape)}"
        )
    positions = extra.get("positions")
    cp_size = torch.distributed.get_world_size(group)
    if prepared is None:
        plan = maskc.dist.make_plan(packed_document_mask(inputs, positions, document_ids), cp_size)
    elif not isinstance(prepared, maskc.dist.PreparedPlan):
        raise TorchtitanAttentionError(f"{CP_PLAN} must be a maskc.dist.PreparedPlan (plan_batch), got {type(prepared).__name__}")
    elif (prepared.plan.seqlen, prepared.plan.cp_size) != (inputs.numel(), cp_size):
        raise TorchtitanAttentionError(
            f"{CP_PLAN} plans {prepared.plan.seqlen} tokens over {prepared.plan.cp_size} ranks, but the batch has "
            f"{inputs.numel()} tokens and the cp group {cp_size} ranks: make it with plan_batch from this batch"
        )
    else:
        plan = prepared

    def local(x: torch.Tensor) -> torch.Tensor:
        return maskc.dist.dispatch(x.reshape(-1), plan, group).unsqueeze(0)

    real = local(torch.ones_like(inputs, dtype=torch.bool))
    extra = dict(extra)
    if positions is not None:
        extra["positions"] = local(positions)
    extra["attention_masks"] = ContextParallelMask(plan, group, *inputs.shape)
    return local(inputs), torch.where(real, local(labels), IGNORE_INDEX), extra


class MaskcTrainer(Trainer):
    """torchtitan's Trainer with maskc's masks and, under context parallelism, maskc.dist's
    dispatch of each batch (see the module docstring). Built by `use_maskc(config).build()`."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """(inputs, labels, model kwargs) of one batch: the mask of its documents, and on cp ranks
        their dispatched part, with the batch's CP_PLAN where the data loader made one
        (replaces torchtitan's mask building and CP sharding)."""
        inputs = input_dict["input"]
        document_ids, prepared = input_dict.get(DOCUMENT_IDS), input_dict.get(CP_PLAN)
        extra = {k: v for k, v in input_dict.items() if k not in ("input", DOCUMENT_IDS, CP_PLAN)}
        if self.parallel_dims.cp_enabled:
            group = self.parallel_dims.get_mesh("cp").get_group()
            inputs, labels, extra = dispatch_batch(inputs, labels, extra, group, document_ids, prepared)
        elif prepared is not None:
            raise TorchtitanAttentionError(f"the batch has a {CP_PLAN} entry, but context parallelism is off")
        else:
            extra["attention_masks"] = document_mask(inputs, extra.get("positions"), document_ids)
        self.ntokens_seen += labels.numel()
        return inputs, labels, extra


def parallelize(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
) -> nn.Module:
    """The model spec's parallelize_fn under `use_maskc`: activation checkpointing, per-block
    torch.compile and FSDP2, as torchtitan's `parallelize_llama` applies them, without its CP
    wrapping of the attention (maskc.dist replaces it). FSDP2 shards over the dp-shard and cp
    ranks together (torchtitan's "fsdp" mesh), so the cp ranks' gradients are summed."""
    for what, enabled in (("tensor", parallel_dims.tp_enabled), ("pipeline", parallel_dims.pp_enabled),
                          ("expert", parallel_dims.ep_enabled)):  # fmt: skip
        if enabled:
            raise TorchtitanAttentionError(f"{what} parallelism is not supported with maskc's torchtitan backend; set its degree to 1")
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"])
    apply_fsdp_to_decoder(
        model,
        mesh,
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=False,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
    )
    if torch.distributed.get_backend(mesh.get_group()) == "gloo":
        sum_reductions(model)
    return model


def sum_reductions(model: nn.Module) -> None:
    """Make FSDP2 reduce gradients with plain sums: its default PREMUL_SUM (the reduce-scatter
    scaled by the divide factor, 1 under torchtitan) is NCCL's, and gloo refuses it."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def use_maskc_attention(model_config: Any) -> Any:
    """`model_config` (a torchtitan model config) with every FlexAttention / VarlenAttention
    inner attention replaced by MaskcAttention, in place; returned for chaining."""
    found = list(model_config.traverse((FlexAttention.Config, VarlenAttention.Config)))
    if not found:
        raise TorchtitanAttentionError(f"{type(model_config).__name__} has no flex or varlen attention for maskc to replace")
    for _, _, parent, attr in found:
        if isinstance(parent, list):
            parent[attr] = MaskcAttention.Config()
        else:
            setattr(parent, attr, MaskcAttention.Config())
    return model_config


def use_maskc(config: Any) -> MaskcTrainer.Config:
    """A MaskcTrainer.Config from a torchtitan Trainer.Config (e.g. a config_registry function's):
    the same settings, with maskc's attention in every layer and maskc's parallelize_fn, and the
    "partial_dtensor" SPMD backend, the one whose path `parallelize` follows (torchtitan's default,
    "spmd_types", annotates every batch for torchtitan's own sharding, which maskc replaces)."""
    if not isinstance(config, Trainer.Config):
        raise TorchtitanAttentionError(f"use_maskc takes a torchtitan Trainer.Config, got {type(config).__name__}")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    spec = fields["model_spec"]
    use_maskc_attention(spec.model)
    fields["model_spec"] = dataclasses.replace(spec, parallelize_fn=parallelize)
    fields["parallelism"] = dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor")
    return MaskcTrainer.Config(**fields)
