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
it came from.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import maskc
from maskc.errors import MaskcError

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
    AttentionInterface.register(NAME, attention_forward)
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


def attention_forward(
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
        if torch.compiler.is_compiling():
            raise TransformersAttentionError(
                f"maskc builds its mask from position_ids on the host, outside torch.compile: build a maskc.Mask "
                f"before the compiled region and pass it as {MASK_KWARG}="
            )
        causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        mask = _CACHE.get(batch, seqlen, causal, _window(sliding_window, causal), kwargs)
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


class _MaskCache:
    """Masks by the tensors they were built from: the layers of one forward share those tensors,
    so only the first layer plans. An entry lives as long as its tensors, and a tensor changed
    in place (its `_version`) misses."""

    def __init__(self) -> None:
        self._masks: dict[tuple, tuple[list[weakref.ref], maskc.Mask]] = {}

    def get(
        self, batch: int, seqlen: int, causal: bool, window: tuple[int, int] | None, kwargs: dict[str, Any]
    ) -> maskc.Mask:
        sources = (kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), kwargs.get("position_ids"))
        key = (batch, seqlen, causal, window, *((id(t), t._version) if t is not None else None for t in sources))
        hit = self._masks.get(key)
        if hit is not None:
            return hit[1]
        mask = _build(batch, seqlen, causal, window, *sources)
        refs = [weakref.ref(t, lambda _, key=key: self._masks.pop(key, None)) for t in sources if t is not None]
        self._masks[key] = (refs, mask)
        return mask


_CACHE = _MaskCache()


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _build(
    batch: int,
    seqlen: int,
    causal: bool,
    window: tuple[int, int] | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> maskc.Mask:
    """The mask of one forward: the documents of cu_seq_lens (over the flattened batch), else
    those of position_ids (over one row when every row is alike, else stacked), else one
    document per row. maskc.attention leaves the padding out."""
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise TransformersAttentionError("got only one of cu_seq_lens_q and cu_seq_lens_k; pass both (or neither)")
        if window is None:
            return maskc.Mask.from_cu_seqlens(_host(cu_q), _host(cu_k), causal=causal)
        return maskc.Mask.sliding_window(_host(cu_q), *window, cu_seqlens_k=_host(cu_k))
    if position_ids is None:
        positions = np.arange(seqlen)[None]
    else:
        positions = _host(position_ids)
        if positions.ndim == 1:
            positions = positions[None]
        if positions.ndim != 2 or positions.shape[1] != seqlen or positions.shape[0] not in (1, batch):
            raise TransformersAttentionError(
                f"position_ids has shape {tuple(position_ids.shape)}; expected [{batch}, {seqlen}] or [1, {seqlen}]"
            )
    if (positions == positions[:1]).all():
        return maskc.Mask.from_position_ids(positions[0], causal=causal, window=window)
    return maskc.Mask.stack([maskc.Mask.from_position_ids(row, causal=causal, window=window) for row in positions])


register()
