"""The mask of an attention call, from what reaches the custom ops as tensors: a mask table
(`Mask.table`), maybe a plan prepared ahead of time (`maskc.prepare`), the batch layout of q
and k, and a padding mask.

Every layer of a step passes the same tensors, so what is derived from them (the Mask, the
mask of the whole batch) is kept on them: found again, not rebuilt, by the next layer and by
the backward.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from maskc.errors import MaskcError, MaskError
from maskc.ir import Mask
from maskc.runtime import prepared as preparing

_BY_CONTENT: OrderedDict[bytes, Mask] = OrderedDict()
"""Masks by table content, for a table tensor that reaches an op as another tensor object than
the one its Mask holds (a few per step: the LRU keeps the latest)."""
_CONTENT_CACHE = 16


def mask_of(table: torch.Tensor, prepared: torch.Tensor | None = None) -> Mask:
    """The Mask a table stands for: the one that holds it, else one with the same content, else
    a new one; a prepared plan (`maskc.prepare`) is handed to its memo."""
    mask = getattr(table, "_maskc_mask", None)
    if mask is None:
        if table.device.type != "cpu":
            raise MaskcError(f"a mask table lives on the CPU (Mask.table), got one on {table.device}")
        key = table.numpy().tobytes()
        mask = _BY_CONTENT.get(key)
        if mask is None:
            mask = _BY_CONTENT[key] = Mask.from_table(table)
            if len(_BY_CONTENT) > _CONTENT_CACHE:
                _BY_CONTENT.popitem(last=False)
        _BY_CONTENT.move_to_end(key)
    if prepared is not None and getattr(prepared, "_maskc_seeded", None) is not mask:
        for key, value in preparing.decode(prepared, mask.table):
            mask.memo.setdefault(key, value)
        prepared._maskc_seeded = mask
    return mask


def call_mask(mask: Mask, q_shape: Sequence[int], k_shape: Sequence[int]) -> Mask:
    """The mask over the call's packed rows: `mask` itself for q [Tq, H, D]; for q [B, S, H, D]
    a mask over one row (S x Sk) repeated down the batch's diagonal, or a mask over all B * S
    rows (`Mask.stack`) as it is."""
    if len(q_shape) == 3:
        if mask.shape != (q_shape[0], k_shape[0]):
            raise MaskError(f"q/k sequence lengths ({q_shape[0]}, {k_shape[0]}) do not match the mask {mask.shape}")
        return mask
    (b, s), sk = q_shape[:2], k_shape[1]
    if mask.shape == (b * s, b * sk):
        return mask
    if mask.shape != (s, sk):
        raise MaskError(
            f"for q [B, S, H, D] = {list(q_shape)} and k [B, Sk, H, D] = {list(k_shape)} the mask covers one row "
            f"({s}, {sk}) or the whole batch ({b * s}, {b * sk}); got {mask.shape}"
        )
    key = ("batch", b)
    batched = mask.memo.get(key)
    if batched is None:
        batched = mask.memo[key] = Mask.stack([mask] * b)
    return batched


def as_mask(mask: Mask | preparing.PreparedMask) -> Mask:
    """The Mask of a Mask or a PreparedMask (its prepared plan handed to its memo)."""
    if isinstance(mask, preparing.PreparedMask):
        return mask_of(mask.table, mask.plan)
    if isinstance(mask, Mask):
        return mask
    raise TypeError(f"mask must be a maskc Mask or PreparedMask (maskc.prepare), got {type(mask).__name__}")
