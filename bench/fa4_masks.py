"""The benchmark masks as FlashAttention-4 `mask_mod`s (CuTe-DSL), for bench/kernel.py's
`fa4_mask_mod` rows: the same predicates as `kernel.flex_mask_mod`, read from the per-token
tables `kernel.mask_tables` gives (document, block within the document, shared-question part),
passed to FA4 as its aux tensors in that order.

FA4 calls a mask_mod with (batch, head, q index, k index, sequence info, aux tensors), each index
a one-element TensorSSA, and keeps the pair where it returns True. Only imported where
flash_attn and the CUTLASS DSL are installed; the DSL re-reads this file's source to compile
the functions, so they live in a module of their own.
"""

from __future__ import annotations

from collections.abc import Callable

import cutlass
import cutlass.cute as cute
from flash_attn.cute.utils import scalar_to_ssa
from kernel import GLOBALS, HALF_WINDOW, WINDOW


def _at(table: cute.Tensor, index: cute.TensorSSA) -> cute.TensorSSA:
    """`table`'s entry at a one-element index, as a one-element TensorSSA (traced inline into the
    mask_mod that calls it)."""
    return scalar_to_ssa(table[index[0]], cutlass.Int32)


def _constant(value: int) -> cute.TensorSSA:
    return scalar_to_ssa(value, cutlass.Int32)


@cute.jit
def causal(b, h, q, k, seqlen, aux) -> cute.TensorSSA:
    return k <= q


@cute.jit
def varlen_full(b, h, q, k, seqlen, aux) -> cute.TensorSSA:
    return _at(aux[0], q) == _at(aux[0], k)


@cute.jit
def varlen_causal(b, h, q, k, seqlen, aux) -> cute.TensorSSA:
    return (_at(aux[0], q) == _at(aux[0], k)) & (k <= q)


@cute.jit
def sliding_window_causal(b, h, q, k, seqlen, aux) -> cute.TensorSSA:
    return (k <= q) & (q - k < _constant(WINDOW))


@cute.jit
def varlen_block_causal(b, h, q, k, seqlen, aux) -> cute.TensorSSA:
    return (_at(aux[0], q) == _at(aux[0], k)) & (_at(aux[1], k) <= _at(aux[1], q))


@cute.jit
def shared_question(b, h, q, k, seqlen, aux) -> cute.TensorSSA:
    asked_q, asked_k = _at(aux[2], q), _at(aux[2], k)
    return ((asked_q == asked_k) & (k <= q)) | ((asked_k == _constant(0)) & (asked_q > _constant(0)))


@cute.jit
def global_sliding_window(b, h, q, k, seqlen, aux) -> cute.TensorSSA:
    near = (q - k <= _constant(HALF_WINDOW)) & (k - q <= _constant(HALF_WINDOW))
    return (k < _constant(GLOBALS)) | (q < _constant(GLOBALS)) | near


#: The mask_mod of each benchmark mask but full (which needs none).
MASK_MODS: dict[str, Callable] = {
    "causal": causal,
    "varlen_full": varlen_full,
    "varlen_causal": varlen_causal,
    "sliding_window_causal": sliding_window_causal,
    "varlen_block_causal": varlen_block_causal,
    "shared_question": shared_question,
    "global_sliding_window": global_sliding_window,
}
