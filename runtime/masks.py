"""The mask of an attention call, from what reaches the custom ops as tensors: a mask table
(`Mask.table`) or position ids (`PositionMask`), maybe a plan prepared ahead of time
(`maskc.prepare`), the batch layout of q and k, and a padding mask.

Every layer of a step passes the same tensors, so what is derived from them (the Mask, the
mask of the whole batch) is kept on them: found again, not rebuilt, by the next layer and by
the backward.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from maskc.derived import derived
from maskc.errors import MaskcError, MaskError
from maskc.ir import Mask
from maskc.ir.mask import window_band
from maskc.runtime import plan_records
from maskc.runtime.call_plan import memoized
from maskc.runtime.prepared import PreparedMask

_BY_CONTENT: OrderedDict[bytes, Mask] = OrderedDict()
"""Masks by table content, for a table tensor that reaches an op as another tensor object than
the one its Mask holds. Small: each Mask keeps its schedules on the GPU while it lives."""
_CONTENT_CACHE = 2


def mask_of(table: torch.Tensor, prepared: torch.Tensor | None = None) -> Mask:
    """The Mask a table stands for: the one that holds it, else one with the same content, else
    a new one; a prepared plan (`maskc.prepare`) is handed to its memo."""
    mask = getattr(table, "_maskc_mask", None)
    if mask is not None:
        mask.check_table(table)
    else:
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
        for key, value in plan_records.decode(prepared, mask.table):  # the whole plan verified before any entry joins
            mask.memo.setdefault(key, value)
        prepared._maskc_seeded = mask
    return mask


@dataclass(frozen=True)
class PositionMask:
    """Packed documents given by their position ids, which restart at 0 where a document begins
    (`Mask.from_position_ids`), built inside the attention op rather than before the call:
    inside a compiled model the position ids are a tensor of the graph, and the host cannot read
    them before the op does. `position_ids` is [S], or [B, S] for a batch (one row per batch
    row, or [1, S] for all); the mask is built once per tensor, for every layer and the backward."""

    position_ids: torch.Tensor
    causal: bool
    window: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.position_ids, torch.Tensor) or self.position_ids.is_floating_point():
            raise MaskError(f"position_ids must be an integer tensor, got {self.position_ids!r:.60}")
        if self.position_ids.device.type not in ("cpu", "cuda"):
            raise MaskError(f"position_ids must be a CPU or CUDA tensor, got one on {self.position_ids.device}")
        window_band(self.causal, self.window)  # the document constructors' checks of causal and window

    def options(self) -> tuple[int, int, int]:
        """(causal, window left, window right; -1 without a window): constants of the op."""
        left, right = self.window if self.window is not None else (-1, -1)
        return int(self.causal), left, right


def positions_mask(position_ids: torch.Tensor, causal: bool, left: int, right: int) -> Mask:
    """The mask of a `PositionMask`: over one row when every row of position_ids is alike,
    else `Mask.stack` of the rows; kept on the tensor per (causal, window) while it holds the
    same positions (`maskc.derived`)."""
    window = None if left < 0 else (left, right)

    def build() -> Mask:
        rows = position_ids.detach().cpu().numpy()
        rows = rows.reshape(1, -1) if rows.ndim == 1 else rows
        if rows.ndim != 2:
            raise MaskError(f"position_ids are [S] or [B, S], got shape {tuple(position_ids.shape)}")
        if (rows == rows[:1]).all():
            return Mask.from_position_ids(rows[0], causal=causal, window=window)
        return Mask.stack([Mask.from_position_ids(row, causal=causal, window=window) for row in rows])

    return derived([position_ids], ("positions", causal, window), build)


def call_mask(mask: Mask, q_shape: Sequence[int], k_shape: Sequence[int], padding: torch.Tensor | None = None) -> Mask:
    """The mask over the call's packed rows: `mask` itself for q [Tq, H, D]; for q [B, S, H, D]
    a mask over one row (S x Sk) repeated down the batch's diagonal, or a mask over all B * S
    rows (`Mask.stack`) as it is; with `padding` ([B, S], true or 1 on real tokens) the padding
    tokens attend nothing and nothing attends them."""
    if len(q_shape) == 3:
        if mask.shape != (q_shape[0], k_shape[0]):
            raise MaskError(f"q/k sequence lengths ({q_shape[0]}, {k_shape[0]}) do not match the mask {mask.shape}")
        if padding is not None:
            raise MaskError("attention_mask (padding) goes with batched q [B, S, H, D]; a packed row has none")
        return mask
    (b, s), sk = q_shape[:2], k_shape[1]
    if mask.shape not in ((s, sk), (b * s, b * sk)):
        raise MaskError(
            f"for q [B, S, H, D] = {list(q_shape)} and k [B, Sk, H, D] = {list(k_shape)} the mask covers one row "
            f"({s}, {sk}) or the whole batch ({b * s}, {b * sk}); got {mask.shape}"
        )
    if padding is None:
        if mask.shape == (s, sk):
            return memoized(mask, ("batch", b), lambda: Mask.stack([mask] * b))
        _check_rows(mask, b)
        return mask
    if sk != s or tuple(padding.shape) != (b, s):
        raise MaskError(f"attention_mask is [B, S] = [{b}, {s}] for self-attention (Sk = S); got {list(padding.shape)} "
                        f"with Sk = {sk}")  # fmt: skip
    # Kept on the padding tensor, which every layer and the backward pass (it may live on the
    # GPU: read once), and which goes with its step; a mask's memo would keep every step's.
    # The entry holds `mask`, so no other mask takes its id while it lives.
    return derived([padding], ("padding", id(mask)), lambda: (mask, _without_padding(mask, _token_runs(padding), s, sk)))[1]


def _check_rows(mask: Mask, b: int) -> None:
    """A MaskError naming a slice of a mask over a whole batch of `b` rows (`Mask.stack`) that
    lets a row attend another row's keys; checked once per mask (`_rows_apart`)."""
    memoized(mask, ("rows", b), lambda: _rows_apart(mask, b))


def _rows_apart(mask: Mask, b: int) -> bool:
    """`_check_rows`: slices within one row's queries and keys pass at once; only a slice whose
    ranges cross rows has its area counted."""
    s, sk = mask.seqlen_q // b, mask.seqlen_k // b
    q, k = mask.q_ranges, mask.k_ranges
    live = (q[:, 1] > q[:, 0]) & (k[:, 1] > k[:, 0])
    row = q[:, 0] // s
    crosses = live & ((row != (q[:, 1] - 1) // s) | (row != k[:, 0] // sk) | (row != (k[:, 1] - 1) // sk))
    if crosses.any():
        blocks = [((i * s, (i + 1) * s), (i * sk, (i + 1) * sk)) for i in range(b)]
        if sum(mask.crop(*block).area() for block in blocks) != mask.area():
            i = int(np.flatnonzero(crosses)[0])
            raise MaskError(
                f"the batch mask {mask.shape} lets a batch row attend another row's tokens: slice {i} (q {tuple(q[i])}, k "
                f"{tuple(k[i])}) crosses rows of {s} queries and {sk} keys; stack one mask per row (Mask.stack of {b} "
                f"masks of shape ({s}, {sk}))"
            )  # fmt: skip
    return True


def _token_runs(padding: torch.Tensor) -> np.ndarray:
    """[B, 2]: where each row's real tokens begin and end (one run: right or left padding)."""
    keep = _real_tokens(padding)
    count = keep.sum(1)
    start = np.where(count > 0, keep.argmax(1), 0)
    position = np.arange(keep.shape[1])
    inside = (position >= start[:, None]) & (position < (start + count)[:, None])
    if (inside != keep).any():
        row = int(np.flatnonzero((inside != keep).any(1))[0])
        raise MaskError(f"attention_mask row {row} has padding between its tokens; each row's tokens must be one run "
                        f"(right or left padding)")  # fmt: skip
    return np.stack([start, start + count], 1)


def _real_tokens(padding: torch.Tensor) -> np.ndarray:
    """[B, S] bools, true on real tokens, from a padding mask of bools or of 0 / 1 (Hugging
    Face's convention); an additive mask (0 to keep, -inf to drop: SDPA's) or any other value
    would flip its meaning, so it is refused."""
    values = padding.detach().cpu()
    if values.dtype == torch.bool:
        return values.numpy()
    values = values.to(torch.float64).numpy()
    bad = (values != 0) & (values != 1)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise MaskError(
            f"attention_mask must be 1 (or True) on real tokens and 0 (or False) on padding, as Hugging Face's [B, S] "
            f"attention_mask; got {values[at]} at {list(at)}. An additive mask (0 to keep, -inf to drop, as SDPA takes) "
            f"is not one: pass (mask == 0) instead"
        )
    return values == 1


def _without_padding(mask: Mask, runs: np.ndarray, s: int, sk: int) -> Mask:
    """The batch mask of `mask` (over one row, s x sk, or over the whole batch) with each row
    cropped to its run of tokens."""
    if mask.shape == (s, sk):
        return Mask.stack([mask.crop((a, e), (a, e)) for a, e in runs.tolist()])
    _check_rows(mask, len(runs))
    rows = [mask.crop((i * s + a, i * s + e), (i * sk + a, i * sk + e)) for i, (a, e) in enumerate(runs.tolist())]
    return functools.reduce(operator.or_, rows)


def as_mask(mask: Mask | PreparedMask) -> Mask:
    """The Mask of a Mask or a PreparedMask (its prepared plan handed to its memo)."""
    if isinstance(mask, PreparedMask):
        return mask_of(mask.table, mask.plan)
    if isinstance(mask, Mask):
        return mask
    raise TypeError(f"mask must be a maskc Mask or PreparedMask (maskc.prepare), got {type(mask).__name__}")
