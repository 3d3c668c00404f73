"""Mask: a union of AttnSlices over seqlen_q x seqlen_k.

Masks of long sequences hold thousands of slices and are rebuilt every training step, so a
Mask keeps its slices as read-only numpy arrays and builds AttnSlice objects only when
asked for them. It is immutable: every transformation returns a new Mask.

Each Mask also holds itself as one tensor, `Mask.table`, which is what reaches the attention
ops: under torch.compile a mask is then data (a graph input), not a constant the graph is
specialised to, so a new mask every step compiles nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch

from maskc.errors import MaskError
from maskc.ir.normalize import normalize_arrays
from maskc.ir.slices import TYPE_NAMES, AttnSlice, RowLines, _range_pair, band_lines, slice_areas, type_id
from maskc.limits import MAX_ROWS, MAX_TOKENS, check_count

JSON_FORMAT = "maskc.mask/1"


def _int_array(value: Any, what: str, *, bools: bool = False) -> np.ndarray:
    """`value` as int64 numpy (bools as 0 and 1 where `bools`), or a MaskError naming `what`."""
    if isinstance(value, torch.Tensor):
        value = host_values(value, what)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        raise MaskError(f"{what} must be a rectangular array of integers, got {type(value).__name__} {str(value)[:60]}") from None
    if arr.size == 0 or (bools and arr.dtype == bool):
        arr = arr.astype(np.int64)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise MaskError(f"{what} must be {'bools or ' if bools else ''}integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and (arr > np.iinfo(np.int64).max).any():
        raise MaskError(f"{what} holds {int(arr.max()):,}, more than any token count or position can be")
    return arr.astype(np.int64, copy=False)


def host_values(tensor: torch.Tensor, what: str) -> np.ndarray:
    """A tensor's values on the host; a MaskError for a tensor that holds none (the meta device)."""
    if tensor.device.type == "meta":
        raise MaskError(f"{what} is on the meta device, which holds no values: pass a CPU or GPU tensor")
    return tensor.detach().cpu().numpy()


def _seqlen(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise MaskError(f"{what} must be an int, got {value!r}")
    if value < 0:
        raise MaskError(f"{what} must be >= 0, got {value}")
    if value > MAX_TOKENS:
        raise MaskError(
            f"{what} = {value:,} is more than maskc supports: at most {MAX_TOKENS:,} tokens (the kernels' offsets are 32-bit)"
        )
    return int(value)


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    arr.flags.writeable = False
    return arr


class Mask:
    """An attention mask: the union of its slices, over `seqlen_q` queries and `seqlen_k` keys."""

    def __init__(self, slices: Iterable[AttnSlice], seqlen_q: int, seqlen_k: int):
        slices = list(slices)
        for i, s in enumerate(slices):
            if not isinstance(s, AttnSlice):
                raise MaskError(f"slice {i}: expected an AttnSlice, got {type(s).__name__}")
        q = np.array([s.q for s in slices], dtype=np.int64).reshape(-1, 2)
        k = np.array([s.k for s in slices], dtype=np.int64).reshape(-1, 2)
        t = np.array([s.type_id for s in slices], dtype=np.int64)
        self._init(q, k, t, seqlen_q, seqlen_k)

    def _init(self, q: np.ndarray, k: np.ndarray, t: np.ndarray, seqlen_q: int, seqlen_k: int) -> None:
        self._sq = _seqlen(seqlen_q, "seqlen_q")
        self._sk = _seqlen(seqlen_k, "seqlen_k")
        check_count(t.shape[0], MAX_ROWS, "slices of a mask")
        _validate(q, k, t, self._sq, self._sk)
        self._q, self._k, self._t = _frozen(q), _frozen(k), _frozen(t)
        header = np.array([[self._sq, self._sk, 0, 0, 0]], np.int32)
        rows = np.concatenate([header, np.c_[q, k, t].astype(np.int32)])
        self._table_bytes = rows.tobytes()
        self.table = torch.from_numpy(rows)
        """The mask as one int32 CPU tensor `[N + 1, 5]`: row 0 holds (seqlen_q, seqlen_k, 0, 0,
        0), row i + 1 slice i as (q start, q end, k start, k end, type id) (`from_table`). Read
        only: a Mask never changes, and the ops refuse a Mask whose table was written to
        (`check_table`)."""
        self.table._maskc_mask = self  # the ops find this Mask, and the plans in its memo, again

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_arrays(cls, q_ranges: Any, k_ranges: Any, types: Any, seqlen_q: int, seqlen_k: int) -> Mask:
        """Build from `[N, 2]` q/k ranges and `[N]` type ids (numpy, torch or lists); validated."""
        q = _int_array(q_ranges, "q_ranges")
        k = _int_array(k_ranges, "k_ranges")
        t = _int_array(types, "types")
        if q.ndim != 2 or q.shape[1:] != (2,) or k.shape != q.shape or t.shape != (q.shape[0],):
            raise MaskError(
                f"expected q_ranges [N, 2], k_ranges [N, 2] and types [N]; got shapes "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(t.shape)}"
            )
        mask = cls.__new__(cls)
        mask._init(q, k, t, seqlen_q, seqlen_k)
        return mask

    from_tensors = from_arrays

    @classmethod
    def from_table(cls, table: torch.Tensor) -> Mask:
        """The Mask a `Mask.table` tensor holds (validated), on any device; the new Mask has a
        table of its own, so later writes to `table` change nothing."""
        if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.ndim != 2 or table.shape[1:] != (5,) \
                or table.shape[0] < 1:  # fmt: skip
            what = f"{table.dtype} tensor of shape {tuple(table.shape)}" if isinstance(table, torch.Tensor) else type(table).__name__
            raise MaskError(f"a mask table is an int32 tensor [N + 1, 5] (Mask.table), got a {what}")
        rows = host_values(table, "a mask table").astype(np.int64)
        return cls.from_arrays(rows[1:, 0:2], rows[1:, 2:4], rows[1:, 4], int(rows[0, 0]), int(rows[0, 1]))

    def check_table(self, table: torch.Tensor) -> None:
        """Refuse `table` (one this Mask holds) if it no longer holds this Mask: a write to a
        Mask's table would otherwise be ignored, its plans made for the mask it held before."""
        if table.numpy().tobytes() != self._table_bytes:  # a microsecond for a table of a few slices
            raise MaskError(
                "a Mask's table (Mask.table) was written to; a Mask never changes, so the write would be ignored: "
                "build a new Mask (Mask.from_table(table) reads the edited table)"
            )

    @classmethod
    def from_magi(
        cls,
        q_ranges: Sequence[Sequence[int]],
        k_ranges: Sequence[Sequence[int]],
        attn_type_map: Sequence[int | str],
        seqlen_q: int | None = None,
        seqlen_k: int | None = None,
    ) -> Mask:
        """From MagiAttention's `(q_ranges, k_ranges, attn_type_map)`; seqlens default to the last range end."""
        if len(q_ranges) != len(k_ranges) or len(q_ranges) != len(attn_type_map):
            raise MaskError(
                f"q_ranges, k_ranges and attn_type_map differ in length: "
                f"{len(q_ranges)}, {len(k_ranges)}, {len(attn_type_map)}"
            )
        types = [type_id(t) for t in attn_type_map]
        q = _int_array(list(q_ranges), "q_ranges").reshape(-1, 2)
        k = _int_array(list(k_ranges), "k_ranges").reshape(-1, 2)
        sq = int(q[:, 1].max(initial=0)) if seqlen_q is None else seqlen_q
        sk = int(k[:, 1].max(initial=0)) if seqlen_k is None else seqlen_k
        return cls.from_arrays(q, k, types, sq, sk)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens_q: Any, cu_seqlens_k: Any = None, *, causal: bool = False, prefix: int = 0) -> Mask:
        """Packed documents: document i's queries attend its own keys (fully, or causally), and
        its first `prefix` keys in any case (see `_documents`)."""
        return cls._documents(*_cu_documents(cu_seqlens_q, cu_seqlens_k, "cu_seqlens_q"), window_band(causal, None), prefix)

    @classmethod
    def sliding_window(cls, cu_seqlens: Any, left: int, right: int = 0, *, cu_seqlens_k: Any = None, prefix: int = 0) -> Mask:
        """Per-document band: each query sees `left` keys before and `right` after itself (its diagonal,
        bottom-right aligned, where `cu_seqlens_k` gives key documents of other lengths), in its document."""
        band = _seqlen(left, "left"), _seqlen(right, "right")
        return cls._documents(*_cu_documents(cu_seqlens, cu_seqlens_k, "cu_seqlens"), band, prefix)

    @classmethod
    def from_document_ids(
        cls,
        document_ids: Any,
        *,
        causal: bool,
        window: tuple[int, int] | None = None,
        prefix: int = 0,
        key_document_ids: Any = None,
    ) -> Mask:
        """Packed documents given one id per token, as a data loader's document or sequence ids:
        each run of one id is a document whose queries attend its own keys (see `_documents` for
        `causal`, `window` and `prefix`). A document is one run: an id that comes back after
        another id is an error, not a document in two pieces. An id < 0 marks padding, which
        attends nothing and is attended by nothing (it may come back).

        With `key_document_ids` (one per key, as many as there are keys) it is cross-attention:
        the queries of document d attend the keys of key document d, matched by id in any order;
        a document missing on either side attends, or is attended by, nothing."""
        band = window_band(causal, window)
        q_docs, q_ids, sq = _id_documents(document_ids, "document_ids")
        if key_document_ids is None:
            return cls._documents(q_docs, q_docs, sq, sq, band, prefix)
        k_docs, k_ids, sk = _id_documents(key_document_ids, "key_document_ids")
        order = np.argsort(k_ids)
        at = np.searchsorted(k_ids[order], q_ids)
        both = np.flatnonzero(np.r_[k_ids[order], -1][at] == q_ids)  # -1: past the last key document
        return cls._documents(q_docs[:, both], k_docs[:, order[at[both]]], sq, sk, band, prefix)

    @classmethod
    def from_position_ids(
        cls,
        position_ids: Any,
        *,
        causal: bool,
        window: tuple[int, int] | None = None,
        prefix: int = 0,
        attention_mask: Any = None,
    ) -> Mask:
        """Packed documents as Hugging Face marks them: positions restart at 0 where a document
        begins (shape [S] or [1, S]); the first token begins one whatever its position. See
        `_documents` for `causal`, `window` and `prefix`. Tokens whose `attention_mask` (bools or
        0/1, shaped like `position_ids`) is 0 are padding: they attend nothing and nothing attends
        them, their positions are ignored, and the first token after them begins a document."""
        band = window_band(causal, window)
        positions = _token_row(position_ids, "position_ids")
        breaks, real = positions[1:] == 0, None
        if attention_mask is not None:
            real = _token_row(attention_mask, "attention_mask", flags=True)
            if real.shape != positions.shape:
                raise MaskError(f"attention_mask has {real.size:,} tokens but position_ids {positions.size:,}")
            positions = np.where(real, positions, 0)
            breaks = (breaks & real[1:]) | (real[1:] != real[:-1])
        if positions.min() < 0:
            i = int(positions.argmin())
            raise MaskError(f"position_ids must be >= 0, got {int(positions[i])} at token {i}")
        docs = _runs(breaks)
        if real is not None:
            docs = docs[:, real[docs[0]]]
        return cls._documents(docs, docs, positions.size, positions.size, band, prefix)

    @classmethod
    def _documents(
        cls, q_docs: np.ndarray, k_docs: np.ndarray, seqlen_q: int, seqlen_k: int, band: tuple[int, int], prefix: int
    ) -> Mask:
        """Query document i (tokens q_docs[0, i] to q_docs[1, i]) attends key document i: the keys
        within `band` = (left, right) keys of the query's diagonal (bottom-right aligned; MAX_TOKENS
        for no bound), and the first `prefix` keys of the document (with a causal band a prefix-LM,
        with a window attention sinks). The prefix keys are cut out of the band's slices: every
        slice is non-empty and disjoint from the others, so the mask is its own normal form."""
        prefix = _seqlen(prefix, "prefix")
        left, right = band
        lines, doc = band_lines(q_docs[0], q_docs[1], k_docs[0], k_docs[1], left, right)
        if prefix and min(left, right) < MAX_TOKENS:
            ends = np.minimum(k_docs[0] + prefix, k_docs[1])
            lines, piece = lines.cropped(0, seqlen_q, ends[doc], seqlen_k)
            heads = np.flatnonzero((q_docs[1] > q_docs[0]) & (ends > k_docs[0]))
            flat = np.zeros_like(heads)
            prefixes = RowLines(q_docs[0, heads], q_docs[1, heads], k_docs[0, heads], flat, ends[heads] - 1, flat)
            order = np.argsort(np.concatenate([heads, doc[piece]]), kind="stable")
            lines = RowLines.join([prefixes, lines]).take(order)
        q, k, t = lines.to_slices()
        return cls.from_arrays(q, k, t, seqlen_q, seqlen_k)._as_normal()

    @classmethod
    def stack(cls, masks: Sequence[Mask]) -> Mask:
        """Block-diagonal union: mask i over the queries and keys that follow those of masks
        0..i-1, so that one kernel launch runs a packed batch of masks of any shapes."""
        if isinstance(masks, Mask) or not isinstance(masks, Iterable):
            raise MaskError(f"Mask.stack takes a sequence of masks, got {type(masks).__name__}")
        masks = list(masks)
        if not masks:
            raise MaskError("Mask.stack needs at least one mask, got none")
        for i, m in enumerate(masks):
            if not isinstance(m, Mask):
                raise MaskError(f"Mask.stack: item {i} is a {type(m).__name__}, not a Mask")
        counts = [len(m) for m in masks]
        shift_q = np.repeat(np.cumsum([0] + [m.seqlen_q for m in masks[:-1]]), counts)[:, None]
        shift_k = np.repeat(np.cumsum([0] + [m.seqlen_k for m in masks[:-1]]), counts)[:, None]
        return cls.from_arrays(
            np.concatenate([m._q for m in masks]) + shift_q,
            np.concatenate([m._k for m in masks]) + shift_k,
            np.concatenate([m._t for m in masks]),
            sum(m.seqlen_q for m in masks),
            sum(m.seqlen_k for m in masks),
        )

    def with_global_tokens(self, count: int) -> Mask:
        """Add `count` global tokens at the start: every query sees them and they see every key."""
        count = _seqlen(count, "global token count")
        if count > min(self._sq, self._sk):
            raise MaskError(f"{count} global tokens do not fit a {self._sq} x {self._sk} mask")
        extra = [AttnSlice(q=(0, count), k=(0, self._sk)), AttnSlice(q=(0, self._sq), k=(0, count))]
        return self | Mask(extra, self._sq, self._sk)

    def crop(self, q_range: tuple[int, int], k_range: tuple[int, int]) -> Mask:
        """Only the pairs whose query is in `q_range` and key in `k_range`, over the same shape:
        what drops a batch row's padding (its queries see nothing, its keys are seen by nothing).
        Built from the normalised slices, each cut into at most three that stay disjoint, so the
        result is normalised too (free for a document mask, whose slices are already)."""
        q0, q1 = _range_pair(q_range, "crop q")
        k0, k1 = _range_pair(k_range, "crop k")
        for side, end, seqlen in (("q", q1, self._sq), ("k", k1, self._sk)):
            if end > seqlen:
                raise MaskError(f"crop {side} range ends at {end}, past seqlen_{side}={seqlen}")
        norm = self._normalized
        lines, _ = RowLines.of(norm._q, norm._k, norm._t).cropped(q0, q1, k0, k1)
        q, k, t = lines.to_slices()
        return Mask.from_arrays(q, k, t, self._sq, self._sk)._as_normal()

    def __or__(self, other: Mask) -> Mask:
        """Union of two masks over the same sequence lengths."""
        if not isinstance(other, Mask):
            return NotImplemented
        if other.shape != self.shape:
            raise MaskError(f"cannot unite masks of shapes {self.shape} and {other.shape}")
        return Mask.from_arrays(
            np.concatenate([self._q, other._q]),
            np.concatenate([self._k, other._k]),
            np.concatenate([self._t, other._t]),
            self._sq,
            self._sk,
        )

    # ---- views ---------------------------------------------------------------------------

    @property
    def seqlen_q(self) -> int:
        return self._sq

    @property
    def seqlen_k(self) -> int:
        return self._sk

    @property
    def shape(self) -> tuple[int, int]:
        return (self._sq, self._sk)

    @property
    def q_ranges(self) -> np.ndarray:
        return self._q

    @property
    def k_ranges(self) -> np.ndarray:
        return self._k

    @property
    def types(self) -> np.ndarray:
        return self._t

    @cached_property
    def slices(self) -> tuple[AttnSlice, ...]:
        return tuple(
            AttnSlice(q=(int(q0), int(q1)), k=(int(k0), int(k1)), type=TYPE_NAMES[t])
            for (q0, q1), (k0, k1), t in zip(self._q.tolist(), self._k.tolist(), self._t.tolist())
        )

    def __len__(self) -> int:
        return int(self._t.shape[0])

    def __iter__(self):
        return iter(self.slices)

    def __eq__(self, other: object) -> bool:
        """Same slices in the same order (use `equivalent` to compare the masked sets)."""
        if not isinstance(other, Mask):
            return NotImplemented
        return (
            self.shape == other.shape
            and np.array_equal(self._q, other._q)
            and np.array_equal(self._k, other._k)
            and np.array_equal(self._t, other._t)
        )

    def __hash__(self) -> int:
        return hash((self.shape, self._q.tobytes(), self._k.tobytes(), self._t.tobytes()))

    def __repr__(self) -> str:
        return f"Mask({len(self)} slices, seqlen_q={self._sq}, seqlen_k={self._sk})"

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int32 `[N, 2]` q ranges, `[N, 2]` k ranges and `[N]` type ids (the kernels' form)."""
        return (
            torch.from_numpy(self._q.astype(np.int32)),
            torch.from_numpy(self._k.astype(np.int32)),
            torch.from_numpy(self._t.astype(np.int32)),
        )

    @cached_property
    def memo(self) -> dict[Any, Any]:
        """Per-mask cache for things derived from it (schedules, device copies): a Mask never changes."""
        return {}

    # ---- semantics -----------------------------------------------------------------------

    @cached_property
    def _normalized(self) -> Mask:
        q, k, t = normalize_arrays(self._q, self._k, self._t)
        return Mask.from_arrays(q, k, t, self._sq, self._sk)

    def normalize(self) -> Mask:
        """Equivalent mask with no empty slice and no two slices sharing a (query, key) pair."""
        return self._normalized

    def _as_normal(self) -> Mask:
        """This mask, recorded as its own normal form: for masks built disjoint and without empty
        slices, which every schedule would otherwise normalise again."""
        self.__dict__["_normalized"] = self
        return self

    def transpose(self) -> Mask:
        """The mask of keys attending queries (seqlen_k x seqlen_q): the backward's k-tile view.

        Built from the normalised slices: transposing maps disjoint slices to disjoint slices,
        so the result is itself normalised and is recorded as such (no second normalisation).
        """
        norm = self._normalized
        lines = RowLines.of(norm._q, norm._k, norm._t).transposed()
        q, k, t = lines.to_slices()
        return Mask.from_arrays(q, k, t, self._sk, self._sq)._as_normal()

    def area(self) -> int:
        """Exact number of allowed (query, key) pairs; overlapping slices count once."""
        n = self._normalized
        return int(slice_areas(n._q[:, 1] - n._q[:, 0], n._k[:, 1] - n._k[:, 0], n._t).sum())

    def density(self) -> float:
        total = self._sq * self._sk
        return self.area() / total if total else 0.0

    def dense_rows(self, q0: int, q1: int) -> torch.Tensor:
        """`torch.bool [q1 - q0, seqlen_k]`: the mask's rows q0..q1-1, without building the rest."""
        if not 0 <= q0 <= q1 <= self._sq:
            raise MaskError(f"row range ({q0}, {q1}) is outside 0..{self._sq}")
        norm = self._normalized
        lines = RowLines.of(norm._q, norm._k, norm._t)
        r0 = np.maximum(lines.r0, q0)
        r1 = np.minimum(lines.r1, q1)
        hit = np.flatnonzero(r1 > r0)
        counts = (r1 - r0)[hit]
        owner = np.repeat(hit, counts)
        rows = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(r0[hit], counts)
        lo = lines.lo_a[owner] + lines.lo_s[owner] * rows
        hi = lines.hi_a[owner] + lines.hi_s[owner] * rows
        # Normalised slices are disjoint: +1 where an interval opens and -1 after it closes
        # never sum past 1, so a prefix sum in int8 marks the covered keys.
        edges = torch.zeros(q1 - q0, self._sk + 1, dtype=torch.int8)
        local = torch.from_numpy(rows - q0)
        ones = torch.ones(local.shape[0], dtype=torch.int8)
        edges.index_put_((local, torch.from_numpy(lo)), ones, accumulate=True)
        edges.index_put_((local, torch.from_numpy(hi + 1)), -ones, accumulate=True)
        return edges.cumsum(1, dtype=torch.int8)[:, : self._sk] > 0

    def to_dense(self) -> torch.Tensor:
        """`torch.bool [seqlen_q, seqlen_k]`, for tests and pictures of small masks."""
        return self.dense_rows(0, self._sq)

    def equivalent(self, other: Mask) -> bool:
        """Whether both masks allow exactly the same (query, key) pairs."""
        if self.shape != other.shape:
            return False
        a, b = self.normalize(), other.normalize()
        if a == b:
            return True
        return a.area() == b.area() == (a | b).area()

    # ---- serialisation -------------------------------------------------------------------

    def to_json(self) -> str:
        body = {
            "format": JSON_FORMAT,
            "seqlen_q": self._sq,
            "seqlen_k": self._sk,
            "slices": [[*q, *k, TYPE_NAMES[t]] for q, k, t in zip(self._q.tolist(), self._k.tolist(), self._t.tolist())],
        }
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> Mask:
        try:
            body = json.loads(text)
            if body.get("format") != JSON_FORMAT:
                raise MaskError(f"not a maskc mask document (format {body.get('format')!r}, expected {JSON_FORMAT!r})")
            rows = body["slices"]
            q = np.array([r[0:2] for r in rows], dtype=np.int64).reshape(-1, 2)
            k = np.array([r[2:4] for r in rows], dtype=np.int64).reshape(-1, 2)
            t = [type_id(r[4]) for r in rows]
            return cls.from_arrays(q, k, np.array(t, dtype=np.int64), body["seqlen_q"], body["seqlen_k"])
        except MaskError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise MaskError(f"malformed mask JSON: {exc}") from None


def _token_row(value: Any, what: str, *, flags: bool = False) -> np.ndarray:
    """One value per token of one packed row: shape [S], or [1, S] as models pass it; with
    `flags`, one bool or 0/1 per token (an attention mask), returned as bools."""
    arr = _int_array(value, what, bools=flags)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or arr.size == 0:
        raise MaskError(f"{what} must hold one value per token of one packed row, shape [S] or [1, S]; got shape {arr.shape}")
    _seqlen(arr.size, f"the length of {what}")
    if not flags:
        return arr
    bad = arr.view(np.uint64) > 1  # negative values too
    if bad.any():
        i = int(np.argmax(bad))
        raise MaskError(f"{what} must be 0 or 1 per token, got {int(arr[i])} at token {i}")
    return arr == 1


def _runs(breaks: np.ndarray) -> np.ndarray:
    """[2, R] starts and ends of the runs of a row of tokens that `breaks` cuts: breaks[i] says
    whether token i + 1 begins a run (token 0 always does)."""
    starts = np.flatnonzero(breaks) + 1
    return np.stack([np.r_[0, starts], np.r_[starts, breaks.size + 1]])


def _id_documents(value: Any, what: str) -> tuple[np.ndarray, np.ndarray, int]:
    """The documents [2, D] and ids [D] of a row of document ids (runs of ids < 0 are padding,
    not documents), and the row's length; a document in two runs is a MaskError."""
    ids = _token_row(value, what)
    docs = _runs(ids[1:] != ids[:-1])
    run_ids = ids[docs[0]]
    docs, run_ids = docs[:, run_ids >= 0], run_ids[run_ids >= 0]
    order = np.argsort(run_ids, kind="stable")
    again = np.flatnonzero(run_ids[order][1:] == run_ids[order][:-1])
    if again.size:
        first, second = docs[0, np.sort(order[again[0] : again[0] + 2])]
        raise MaskError(
            f"{what}: document {run_ids[order][again[0]]} is split: it runs from token {first} and again from "
            f"token {second}; a document must be one run of tokens"
        )
    return docs, run_ids, ids.size


def _cu_documents(cu_q: Any, cu_k: Any, name: str) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Query and key documents [2, D] from boundaries (the keys' default to the queries'), and the seqlens."""
    cq = _cu_seqlens(cu_q, name)
    ck = cq if cu_k is None else _cu_seqlens(cu_k, "cu_seqlens_k")
    if ck.shape != cq.shape:
        raise MaskError(f"{name} and cu_seqlens_k hold {cq.size} and {ck.size} boundaries")
    return np.stack([cq[:-1], cq[1:]]), np.stack([ck[:-1], ck[1:]]), int(cq[-1]), int(ck[-1])


def window_band(causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """The keys a query sees as (left, right) keys around its diagonal, MAX_TOKENS for no bound:
    all of them, or with `causal` those up to the diagonal; with `window=(left, right)`, only
    those from `left` before to `right` after it (right is 0 when causal)."""
    if not isinstance(causal, bool):
        raise MaskError(f"causal must be True or False, got {causal!r}")
    if window is None:
        return MAX_TOKENS, 0 if causal else MAX_TOKENS
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise MaskError(f"window must be a pair (left, right) of key counts, got {window!r}")
    left, right = _seqlen(window[0], "window left"), _seqlen(window[1], "window right")
    if causal and right:
        raise MaskError(f"a causal mask sees no key after its query: window right must be 0, got {right}")
    return left, right


def _cu_seqlens(value: Any, what: str) -> np.ndarray:
    cu = _int_array(value, what)
    if cu.ndim != 1 or cu.size == 0 or cu[0] != 0:
        raise MaskError(f"{what} must be a 1-D list starting at 0, got {_short(cu)}")
    check_count(cu.size - 1, MAX_ROWS, f"documents in {what}")
    if np.any(np.diff(cu) < 0):
        raise MaskError(f"{what} must be non-decreasing, got {_short(cu)}")
    _seqlen(int(cu[-1]), f"the last of {what}")
    return cu


def _short(values: np.ndarray, limit: int = 8) -> str:
    """A long array in an error message: its first values and its length."""
    values = values.ravel()
    head = values[:limit].tolist()
    return str(head) if values.size <= limit else f"[{', '.join(map(str, head))}, ...] ({values.size:,} values)"


def _validate(q: np.ndarray, k: np.ndarray, t: np.ndarray, sq: int, sk: int) -> None:
    """Raise a MaskError naming the first bad slice, checked vectorised."""
    checks = [
        ((q < 0).any(1) | (k < 0).any(1), "has a negative range"),
        ((q[:, 0] > q[:, 1]) | (k[:, 0] > k[:, 1]), "has a reversed range (start > end)"),
        (q[:, 1] > sq, f"has a q range past seqlen_q={sq}"),
        (k[:, 1] > sk, f"has a k range past seqlen_k={sk}"),
        ((t < 0) | (t >= len(TYPE_NAMES)), "has an unknown type id (expected 0..3)"),
    ]
    for bad, what in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise MaskError(
                f"slice {i} {what}: q={tuple(q[i].tolist())}, k={tuple(k[i].tolist())}, type={int(t[i])}"
            )
