"""maskc as a Hugging Face Transformers attention implementation, `attn_implementation="maskc"`.

    import maskc.integrations.transformers            # registers "maskc" (register() again is a no-op)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="maskc")
    model(input_ids, position_ids=position_ids)        # packed rows: positions restart at 0 per document
    model(input_ids, maskc_mask=mask)                  # or any maskc.Mask (or PreparedMask), one row or all

No dense mask is built: Transformers' mask creation hands maskc only the [B, S] padding mask,
and the attention builds a `maskc.Mask` from what reaches it: an explicit `maskc_mask`, else
the documents of `cu_seq_lens_q`/`cu_seq_lens_k` (DataCollatorWithFlattening) or of
`position_ids` (a document begins where its position is 0), else one document per row; the
padding of the [B, S] attention_mask (left or right) attends nothing and nothing attends it.
The model's `is_causal`, `sliding_window`, `softcap`, `scaling` and attention sinks (`s_aux`)
carry over (an explicit mask replaces `is_causal` and `sliding_window`). Every layer of a
forward gets the same inputs, so the mask is built once per forward and cached on the tensors
it came from. The position_ids reach maskc's op as data (`maskc.PositionMask`), so a model
under torch.compile takes new documents every step without recompiling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import maskc
from maskc.derived import derived
from maskc.errors import MaskcError
from maskc.lazy import optional_imports

with optional_imports("maskc.integrations.transformers"):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

NAME = "maskc"
"""The `attn_implementation` name."""

MASK_KWARG = "maskc_mask"
"""The model keyword that carries an explicit `maskc.Mask` to every attention layer."""


class TransformersAttentionError(MaskcError, ValueError):
    """A Transformers model asks maskc's attention for something it does not do (dropout, a
    dense or model-specific mask, a KV cache), or passes inputs that contradict each other."""


@dataclass(frozen=True)
class _Unsupported:
    """What the mask interface hands the attention instead of a mask it cannot translate, so
    that the error is raised only where no explicit `maskc_mask` replaces it."""

    reason: str


def register() -> None:
    """Register "maskc" with Transformers' attention and attention-mask interfaces (idempotent:
    registering again replaces the entries with the same functions)."""
    AttentionInterface.register(NAME, transformers_attention)
    AttentionMaskInterface.register(NAME, padding_mask)


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    config: Any = None,
    use_vmap: bool = False,
    **kwargs: Any,
) -> torch.Tensor | _Unsupported | None:
    """maskc's entry in Transformers' AttentionMaskInterface: the [B, kv_length] bool padding
    mask (None without padding) instead of a dense 4-D mask; documents and windows reach the
    attention function itself. Model-specific overlays (Transformers passes them as mask
    functions, which maskc cannot read) become `_Unsupported`."""
    if use_vmap:
        return _Unsupported(
            "this model overlays a mask function of its own on the causal mask (or_mask_function / and_mask_function, "
            "e.g. for image tokens or bidirectional attention)"
        )
    if getattr(config, "attention_chunk_size", None):
        return _Unsupported(f"this model attends in chunks of {config.attention_chunk_size} tokens")
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    return None if bool(attention_mask.all()) else attention_mask


def transformers_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | _Unsupported | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """maskc's entry in Transformers' AttentionInterface: query [B, Hq, S, D], key/value
    [B, Hkv, S, D] -> (out [B, S, Hq, D], None), the layout and return Transformers expects."""
    if dropout > 0:
        raise TransformersAttentionError(
            f"attention dropout {dropout} in training: maskc has no attention dropout; "
            "set the config's attention_dropout to 0.0 or use another attn_implementation"
        )
    batch, _, seqlen, _ = query.shape
    if key.shape[2] != seqlen:
        raise TransformersAttentionError(
            f"{seqlen} queries attend {key.shape[2]} keys: a KV cache (generation) is not supported by maskc's "
            "Transformers integration, which attends within one forward; generate with another implementation, "
            "e.g. model.set_attn_implementation('sdpa')"
        )
    explicit = kwargs.get(MASK_KWARG)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim != 2:
        raise TransformersAttentionError(
            f"got a dense {attention_mask.ndim}-D attention_mask of shape {tuple(attention_mask.shape)}; maskc takes "
            f"no dense mask: pass a [B, S] padding mask, position_ids, or a maskc.Mask as {MASK_KWARG}="
        )
    if explicit is not None:
        mask = _explicit(explicit, batch, seqlen)
    elif isinstance(attention_mask, _Unsupported):
        raise TransformersAttentionError(
            f"{attention_mask.reason}: maskc cannot translate it; pass a maskc.Mask as {MASK_KWARG}= or use another "
            "attn_implementation"
        )
    else:
        causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        mask = _documents(batch, seqlen, causal, _window(sliding_window, causal), kwargs, query.device)
    padding = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    sink = None if s_aux is None else s_aux.float().reshape(1, -1)
    dtype = _dtype(query)
    q, k, v = (x.transpose(1, 2).to(dtype).contiguous() for x in (query, key, value))
    out, _ = maskc.attention(
        q, k, v, mask, softmax_scale=scaling, softcap=softcap or 0.0, sink=sink, attention_mask=padding
    )
    return out, None


def _dtype(query: torch.Tensor) -> torch.dtype:
    """Under autocast, q, k and v come in mixed dtypes (rotary embeddings promote q and k to
    float32, v stays half), and maskc takes one: the autocast dtype, as Transformers' flash
    attention does."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int] | None:
    """Transformers' sliding window w keeps the keys with q - w < k <= q: the query and the
    w - 1 keys before it, maskc's window (w - 1, 0)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise TransformersAttentionError(f"sliding_window must be a positive number of keys, got {sliding_window!r}")
    if not causal:
        raise TransformersAttentionError(
            "a bidirectional sliding window: Transformers' models disagree on how many keys it spans, so maskc does not "
            f"guess; pass a maskc.Mask as {MASK_KWARG}= "
            "(maskc.Mask.from_position_ids(..., causal=False, window=(left, right)))"
        )
    return (sliding_window - 1, 0)


def _explicit(mask: Any, batch: int, seqlen: int) -> maskc.Mask | maskc.PreparedMask:
    """The caller's own mask, over one row (shared by every row) or over the packed batch; a
    PreparedMask (planned in a DataLoader worker) is checked by maskc.attention."""
    if not isinstance(mask, (maskc.Mask, maskc.PreparedMask)):
        raise TransformersAttentionError(
            f"{MASK_KWARG} must be a maskc.Mask or maskc.PreparedMask, got {type(mask).__name__}"
        )
    if isinstance(mask, maskc.Mask) and mask.shape not in {(seqlen, seqlen), (batch * seqlen, batch * seqlen)}:
        raise TransformersAttentionError(
            f"{MASK_KWARG} has shape {mask.shape}; the batch has {batch} rows of {seqlen} tokens, so it must be "
            f"{(seqlen, seqlen)} (one row, shared) or {(batch * seqlen, batch * seqlen)} (the whole batch, packed)"
        )
    return mask


def _documents(
    batch: int, seqlen: int, causal: bool, window: tuple[int, int] | None, kwargs: dict[str, Any], device: torch.device
) -> maskc.Mask | maskc.PositionMask:
    """The documents of one forward: those of `cu_seq_lens_q/k` (over the flattened batch,
    built on the host once per forward), else those of `position_ids`, read inside the
    attention op (`maskc.PositionMask`: once per forward, and as data inside a compiled model),
    else one document per row."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise TransformersAttentionError("got only one of cu_seq_lens_q and cu_seq_lens_k; pass both (or neither)")
        return _cu_seq_lens_mask(causal, window, cu_q, cu_k)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return maskc.PositionMask(torch.arange(seqlen, device=device), causal, window)
    if position_ids.ndim not in (1, 2) or position_ids.shape[-1] != seqlen or position_ids.ndim == 2 and \
            position_ids.shape[0] not in (1, batch):  # fmt: skip
        raise TransformersAttentionError(
            f"position_ids has shape {tuple(position_ids.shape)}; expected [{batch}, {seqlen}] or [1, {seqlen}]"
        )
    return maskc.PositionMask(position_ids, causal, window)


@torch.compiler.disable  # host work: inside a compiled model it runs eagerly, a graph break (position_ids are data)
def _cu_seq_lens_mask(causal: bool, window: tuple[int, int] | None, cu_q: torch.Tensor, cu_k: torch.Tensor) -> maskc.Mask:
    """The mask of cu_seq_lens, kept on the tensors while they hold the same lengths
    (`maskc.derived`): the layers of one forward share them, so only the first layer plans."""
    return derived([cu_q, cu_k], ("cu_seq_lens", causal, window), lambda: _build(causal, window, cu_q, cu_k))


def _build(causal: bool, window: tuple[int, int] | None, cu_q: torch.Tensor, cu_k: torch.Tensor) -> maskc.Mask:
    """The documents of cu_seq_lens over the flattened batch (maskc.attention leaves the padding out)."""
    cu_q, cu_k = (t.detach().cpu().numpy() for t in (cu_q, cu_k))
    if window is None:
        return maskc.Mask.from_cu_seqlens(cu_q, cu_k, causal=causal)
    return maskc.Mask.sliding_window(cu_q, *window, cu_seqlens_k=cu_k)


register()
