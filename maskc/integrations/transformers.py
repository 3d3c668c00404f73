"""maskc as a Hugging Face Transformers attention implementation, `attn_implementation="maskc"`.

    import maskc.integrations.transformers            # registers "maskc" (register() again is a no-op)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="maskc")
    model(input_ids, position_ids=position_ids)        # packed rows: positions restart at 0 per document
    model(input_ids, maskc_mask=mask)                  # or any maskc.Mask, over one row or the whole batch

No dense mask is built: Transformers' mask creation hands maskc only the [B, S] padding mask,
and the attention builds a `maskc.Mask` from what reaches it: an explicit `maskc_mask`, else
the documents of `cu_seq_lens_q`/`cu_seq_lens_k` (DataCollatorWithFlattening) or of
`position_ids` (a document begins where its position is 0), else one document per row, with
padding tokens attending nothing and attended by nothing. The model's `is_causal`,
`sliding_window`, `softcap`, `scaling` and attention sinks (`s_aux`) carry over. Every layer
of a forward gets the same inputs, so the mask is built once per forward and cached on the
tensors it came from.
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
        return _Unsupported(f"this model attends in chunks of {config.attention_chunk_size} tokens (attention_chunk_size)")
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
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    window = _window(sliding_window, causal)
    explicit = kwargs.get(MASK_KWARG)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim != 2:
        raise TransformersAttentionError(
            f"got a dense {attention_mask.ndim}-D attention_mask of shape {tuple(attention_mask.shape)}; maskc takes "
            f"no dense mask: pass a [B, S] padding mask, position_ids, or a maskc.Mask as {MASK_KWARG}="
        )
    if explicit is not None:
        mask = _explicit(explicit, attention_mask, batch, seqlen)
    elif isinstance(attention_mask, _Unsupported):
        raise TransformersAttentionError(
            f"{attention_mask.reason}: maskc cannot translate it; pass a maskc.Mask as {MASK_KWARG}= or use another "
            "attn_implementation"
        )
    else:
        if torch.compiler.is_compiling():
            raise TransformersAttentionError(
                f"maskc builds its mask from position_ids and padding on the host, outside torch.compile: build a "
                f"maskc.Mask before the compiled region and pass it as {MASK_KWARG}="
            )
        mask = _CACHE.get(batch, seqlen, causal, window, attention_mask, kwargs)
    sink = None if s_aux is None else s_aux.float().reshape(1, -1)
    dtype = _dtype(query)
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))
    out, _ = _attend(q, k, v, mask, softmax_scale=scaling, softcap=softcap or 0.0, sink=sink)
    return out, None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: maskc.Mask, **kwargs: Any):
    """TEMPORARY seam until maskc.attention takes [B, S, H, D] and runs on CPU: calls the
    packed [T, H, D] form, row by row for a mask over one row."""
    fn = maskc.attention if q.is_cuda else maskc.reference_attention
    batch, seqlen = q.shape[:2]
    if mask.shape == (seqlen, seqlen) and batch > 1:
        return torch.stack([fn(q[b], k[b], v[b], mask, **kwargs)[0] for b in range(batch)]), None
    out, meta = fn(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), mask, **kwargs)
    return out.unflatten(0, (batch, seqlen)), meta


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
            f"guess; pass a maskc.Mask as {MASK_KWARG}= (maskc.Mask.from_position_ids(..., causal=False, window=(left, right)))"
        )
    return (sliding_window - 1, 0)


def _explicit(mask: Any, padding: torch.Tensor | _Unsupported | None, batch: int, seqlen: int) -> maskc.Mask:
    """The caller's own mask, over one row (shared by every row) or over the packed batch."""
    if not isinstance(mask, maskc.Mask):
        raise TransformersAttentionError(f"{MASK_KWARG} must be a maskc.Mask, got {type(mask).__name__}")
    if isinstance(padding, torch.Tensor):
        raise TransformersAttentionError(
            f"both {MASK_KWARG} and an attention_mask with padding: the maskc.Mask must leave the padding tokens out "
            "itself; pass an attention_mask of ones (or none)"
        )
    if mask.shape not in {(seqlen, seqlen), (batch * seqlen, batch * seqlen)}:
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
        self,
        batch: int,
        seqlen: int,
        causal: bool,
        window: tuple[int, int] | None,
        padding: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> maskc.Mask:
        sources = (kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), kwargs.get("position_ids"), padding)
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
    padding: torch.Tensor | None,
) -> maskc.Mask:
    """The mask of one forward: documents from cu_seq_lens (over the flattened batch) or from
    position_ids, else one per row; padding tokens get no slice at all."""
    if cu_q is not None or cu_k is not None:
        starts = _cu_starts(cu_q, cu_k, batch * seqlen, padding)
    elif position_ids is not None:
        starts = _position_starts(position_ids, batch, seqlen)
    else:
        starts = np.zeros((1, seqlen), dtype=bool)
    valid = None
    if padding is not None:
        valid = _host(padding).astype(bool)
        starts = np.broadcast_to(starts, valid.shape)
    return _documents(starts, valid, causal, window)


def _cu_starts(cu_q: torch.Tensor | None, cu_k: torch.Tensor | None, total: int, padding: torch.Tensor | None) -> np.ndarray:
    """Document starts [1, B*S] of DataCollatorWithFlattening's cu_seq_lens_q / cu_seq_lens_k."""
    if cu_q is None or cu_k is None:
        raise TransformersAttentionError("got only one of cu_seq_lens_q and cu_seq_lens_k; pass both (or neither)")
    if padding is not None:
        raise TransformersAttentionError("both cu_seq_lens_q/cu_seq_lens_k and an attention_mask with padding; pass one")
    cq, ck = _host(cu_q).ravel(), _host(cu_k).ravel()
    if not np.array_equal(cq, ck):
        raise TransformersAttentionError("cu_seq_lens_q and cu_seq_lens_k differ; maskc's integration attends each document to itself")
    if cq.size < 2 or cq[0] != 0 or cq[-1] != total or np.any(np.diff(cq) < 0):
        raise TransformersAttentionError(
            f"cu_seq_lens_q must rise from 0 to the {total} tokens of the flattened batch, got {cq.tolist()[:8]}"
            + (" ..." if cq.size > 8 else "")
        )
    starts = np.zeros((1, total), dtype=bool)
    starts[0, cq[:-1][cq[:-1] < total]] = True
    return starts


def _position_starts(position_ids: torch.Tensor, batch: int, seqlen: int) -> np.ndarray:
    """Document starts [rows, S] where positions restart at 0; one row when every row is alike."""
    positions = _host(position_ids)
    if positions.ndim == 1:
        positions = positions[None]
    if positions.ndim != 2 or positions.shape[1] != seqlen or positions.shape[0] not in (1, batch):
        raise TransformersAttentionError(
            f"position_ids has shape {tuple(position_ids.shape)}; expected [{batch}, {seqlen}] or [1, {seqlen}]"
        )
    if (positions < 0).any():
        raise TransformersAttentionError(f"position_ids must be >= 0, got {int(positions.min())}")
    if (positions == positions[:1]).all():
        positions = positions[:1]
    return positions == 0


def _documents(starts: np.ndarray, valid: np.ndarray | None, causal: bool, window: tuple[int, int] | None) -> maskc.Mask:
    """Each row's documents (a row always begins one) attending themselves, over one row or,
    for several, the packed batch. With padding, a document's tokens must be one run (left or
    right padding); the padding runs are left without slices."""
    rows, seqlen = starts.shape
    documents = starts.copy()
    documents[:, 0] = True
    begins = documents.copy()
    if valid is not None:
        begins[:, 1:] |= valid[:, 1:] != valid[:, :-1]
        runs_per_document = np.add.reduceat((begins & valid).ravel(), np.flatnonzero(documents.ravel()))
        if (runs_per_document > 1).any():
            raise TransformersAttentionError(
                "padding inside a document (its tokens are not one run): maskc's integration takes left or right "
                f"padding; pass a maskc.Mask as {MASK_KWARG}= for anything else"
            )
    mask = maskc.Mask.from_document_ids(np.cumsum(begins.ravel()), causal=causal, window=window)
    if valid is None:
        return mask
    q, k, t = mask.q_ranges, mask.k_ranges, mask.types
    keep = valid.ravel()[np.minimum(q[:, 0], rows * seqlen - 1)] & (q[:, 1] > q[:, 0])
    return maskc.Mask.from_arrays(q[keep], k[keep], t[keep], rows * seqlen, rows * seqlen)


register()
