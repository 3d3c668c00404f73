"""Communication tables against the dense mask: every remote row a rank needs arrives, exactly
once, and nothing else; the all-to-all-v they describe delivers it; GroupReduce is its transpose."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir import masks

from maskc.dist.comm import CommTables, build_comm_tables, needed_keys, remote_keys
from maskc.dist.pieces import cut
from maskc.errors import MaskError, MaskParamError
from maskc.ir import AttnSlice, Mask


@st.composite
def setups(draw) -> tuple[Mask, int, np.ndarray, int]:
    """A random mask made square and padded to whole chunks for every rank, with a random
    assignment of equally many chunks to each rank."""
    mask = draw(masks(max_len=40, max_slices=6))
    chunk_size = draw(st.integers(1, 8))
    cp = draw(st.integers(1, 8))
    unit = chunk_size * cp
    n = -(-max(mask.shape) // unit) * unit
    per_rank = n // unit
    roc = draw(st.permutations(np.repeat(np.arange(cp), per_rank).tolist()))
    return Mask(mask.slices, n, n), chunk_size, np.asarray(roc, dtype=np.int64), cp


def rows_of(ranges: np.ndarray) -> list[int]:
    return [k for b, e in ranges.tolist() for k in range(b, e)]


def assert_canonical(ranges: np.ndarray) -> None:
    """Sorted, non-empty, disjoint and not adjacent."""
    assert ranges.ndim == 2 and ranges.shape[1] == 2
    assert (ranges[:, 0] < ranges[:, 1]).all()
    assert (ranges[1:, 0] > ranges[:-1, 1]).all()


@pytest.mark.slow
@given(setups())
@settings(max_examples=300, deadline=None)
def test_tables_match_the_dense_mask(setup: tuple[Mask, int, np.ndarray, int]) -> None:
    mask, cs, roc, cp = setup
    dense = mask.to_dense().numpy()
    n = dense.shape[0]
    owner = np.repeat(roc, cs)  # rank owning each global row
    needed = [dense[owner == r].any(axis=0) for r in range(cp)]
    remote = [needed[r] & (owner != r) for r in range(cp)]
    pieces = cut(mask, cs)
    t = build_comm_tables(mask, cs, roc, cp)

    for r, (nk, rk) in enumerate(zip(needed_keys(pieces, roc, cp), remote_keys(pieces, cs, roc, cp))):
        assert_canonical(nk)
        assert_canonical(rk)
        assert rows_of(nk) == np.flatnonzero(needed[r]).tolist()
        assert rows_of(rk) == np.flatnonzero(remote[r]).tolist()

    # Receive side: exactly the remote keys, once each, grouped by source then ascending.
    for r in range(cp):
        rows = t.recv_rows(r)
        assert sorted(rows.tolist()) == np.flatnonzero(remote[r]).tolist()
        order = owner[rows] * n + rows
        assert (np.diff(order) > 0).all()
        src = t.recv_src[t.recv_ptr[r] : t.recv_ptr[r + 1]]
        assert [int(owner[k]) for b, e in t.recv(r).tolist() for k in range(b, e)] == np.repeat(
            src, np.diff(t.recv(r), axis=1)[:, 0]
        ).tolist()
        for s in range(cp):
            assert t.send_counts[s, r] == int((remote[r] & (owner == s)).sum())
    assert (np.diag(t.send_counts) == 0).all()
    assert np.array_equal(t.recv_counts, t.send_counts.T)

    # The forward all-to-all-v: each source gathers its send buffer, splits it by send_counts;
    # each destination concatenates what arrives by source and gets its remote buffer.
    received: list[list[np.ndarray]] = [[] for _ in range(cp)]
    for s in range(cp):
        local = t.local_rows(s)
        assert local.tolist() == np.flatnonzero(owner == s).tolist()
        send = local[t.gather_index(s)]
        assert send.size == t.send_counts[s].sum()
        for r, part in enumerate(np.split(send, np.cumsum(t.send_counts[s])[:-1])):
            received[r].append(part)
            assert_canonical(t.gather(s, r))
            offset = t.send_counts[s, :r].sum()
            assert rows_of(t.gather(s, r)) == t.gather_index(s)[offset : offset + t.send_counts[s, r]].tolist()
    for r in range(cp):
        assert np.concatenate(received[r]).tolist() == t.recv_rows(r).tolist()

    # GroupCast: maximal local segments whose destination sets say who gets each row.
    rows_per_rank = t.rows_per_rank
    for s in range(cp):
        by_gather = np.zeros((rows_per_rank, cp), dtype=bool)
        for r in range(cp):
            by_gather[rows_of(t.gather(s, r)), r] = True
        by_cast = np.zeros_like(by_gather)
        segments = t.cast_segments(s)
        for i, (b, e, dsts) in enumerate(segments):
            assert 0 <= b < e <= rows_per_rank and dsts and list(dsts) == sorted(set(dsts)) and s not in dsts
            if i:
                pb, pe, pd = segments[i - 1]
                assert pe <= b and (pe < b or pd != dsts)  # disjoint, sorted, maximal
            by_cast[b:e, list(dsts)] = True
        assert np.array_equal(by_cast, by_gather)

    # The backward GroupReduce: each rank returns partial dK/dV of its remote buffer to the
    # owners (split by source), which scatter-add them; the sums match a dense reduction.
    assert np.array_equal(t.reduce_send_counts, t.send_counts.T)
    assert np.array_equal(t.reduce_recv_counts, t.send_counts)
    rng = np.random.default_rng(0)
    partial = [rng.integers(-9, 10, t.recv_rows(r).size) for r in range(cp)]
    expected = np.zeros(n, dtype=np.int64)
    for r in range(cp):
        np.add.at(expected, t.recv_rows(r), partial[r])
    back = [np.split(partial[r], np.cumsum(t.reduce_send_counts[r])[:-1]) for r in range(cp)]
    for s in range(cp):
        arrived = np.concatenate([back[r][s] for r in range(cp)]).astype(np.int64)
        assert arrived.size == t.reduce_recv_counts[s].sum()
        grad = np.zeros(rows_per_rank, dtype=np.int64)
        np.add.at(grad, t.scatter_index(s), arrived)
        assert np.array_equal(grad, expected[t.local_rows(s)])

    # Totals and baselines.
    assert t.recv_rows_per_rank.tolist() == [int(x.sum()) for x in remote]
    assert t.comm_rows_total == sum(int(x.sum()) for x in remote)
    hops = [
        max([(r - s) % cp for r in range(cp) if r != s and (remote[r] & (owner == s)).any()], default=0)
        for s in range(cp)
    ]
    assert t.ring_hops.tolist() == hops
    assert t.ring_p2p_rows_total == sum(hops) * rows_per_rank
    assert t.allgather_rows_total == cp * (cp - 1) * rows_per_rank
    assert t.comm_rows_total <= t.ring_p2p_rows_total <= t.allgather_rows_total

    assert_round_trip(t)


def assert_round_trip(t: CommTables) -> None:
    data = json.loads(json.dumps(t.to_dict()))
    back = CommTables.from_dict(data)
    assert back.to_dict() == t.to_dict()
    assert np.array_equal(back.send_counts, t.send_counts)
    assert back.cast_ranges.shape == t.cast_ranges.shape and back.cast_ranges.dtype == np.int64


def causal(n: int) -> Mask:
    return Mask.from_cu_seqlens([0, n], causal=True)


def test_causal_four_ranks_in_order_and_reversed() -> None:
    t = build_comm_tables(causal(16), 4, np.array([0, 1, 2, 3]), 4)
    # Rank r needs every earlier chunk; rank s's block goes to every higher rank.
    assert t.send_counts.tolist() == [[0, 4, 4, 4], [0, 0, 4, 4], [0, 0, 0, 4], [0, 0, 0, 0]]
    assert t.recv_rows_per_rank.tolist() == [0, 4, 8, 12]
    assert [t.cast_segments(s) for s in range(4)] == [[(0, 4, (1, 2, 3))], [(0, 4, (2, 3))], [(0, 4, (3,))], []]
    assert t.recv(3).tolist() == [[0, 4], [4, 8], [8, 12]]
    assert t.ring_hops.tolist() == [3, 2, 1, 0]
    assert (t.comm_rows_total, t.ring_p2p_rows_total, t.allgather_rows_total) == (24, 24, 48)

    t = build_comm_tables(causal(16), 4, np.array([3, 2, 1, 0]), 4)
    # Chunk 0 on rank 3 is needed by ranks 0, 1, 2: the ring carries it 3 -> 0 -> 1 -> 2.
    assert t.ring_hops.tolist() == [0, 3, 3, 3]
    assert (t.comm_rows_total, t.ring_p2p_rows_total, t.allgather_rows_total) == (24, 36, 48)


def test_zigzag_causal_two_ranks() -> None:
    t = build_comm_tables(causal(16), 4, np.array([0, 1, 1, 0]), 2)
    # Rank 0 (chunks 0, 3) needs chunks 1, 2; rank 1 (chunks 1, 2) needs chunk 0.
    assert t.send_counts.tolist() == [[0, 4], [8, 0]]
    assert t.recv(0).tolist() == [[4, 12]] and t.recv(1).tolist() == [[0, 4]]
    assert t.gather_index(0).tolist() == [0, 1, 2, 3] and t.gather_index(1).tolist() == list(range(8))
    assert t.local_rows(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert (t.comm_rows_total, t.ring_p2p_rows_total, t.allgather_rows_total) == (12, 16, 16)


def test_sliding_window_destination_sets() -> None:
    # Row i sees keys [i-5, i]; rank r owns chunks r and r+4 of 4 rows.
    mask = Mask.sliding_window([0, 32], 5)
    roc = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    t = build_comm_tables(mask, 4, roc, 4)
    # Rank 1 needs chunk 0 (rank 0) for chunk 1, keys 15..19 for chunk 5: 15 from rank 3, 16..19 from rank 0.
    assert t.recv(1).tolist() == [[0, 4], [16, 20], [15, 16]]
    assert t.recv_src[t.recv_ptr[1] : t.recv_ptr[2]].tolist() == [0, 0, 3]
    assert remote_keys(cut(mask, 4), 4, roc, 4)[1].tolist() == [[0, 4], [15, 20]]
    assert needed_keys(cut(mask, 4), roc, 4)[1].tolist() == [[0, 8], [15, 24]]
    # Rank 0's local rows: chunk 0 then chunk 4. Rank 2 takes keys 3 and 19 (local 3 and 7).
    assert t.gather(0, 2).tolist() == [[3, 4], [7, 8]]
    assert t.gather_index(0).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 3, 7]
    assert t.cast_segments(0) == [(0, 3, (1,)), (3, 4, (1, 2)), (4, 7, (1,)), (7, 8, (1, 2))]
    assert t.send_counts[0].tolist() == [0, 8, 2, 0]
    assert t.ring_hops[0] == 2


def test_full_mask_every_rank_needs_everything() -> None:
    t = build_comm_tables(Mask([AttnSlice((0, 32), (0, 32), "full")], 32, 32), 2, np.arange(16) % 4, 4)
    assert t.cast_segments(2) == [(0, 8, (0, 1, 3))]
    assert t.comm_rows_total == t.ring_p2p_rows_total == t.allgather_rows_total == 4 * 3 * 8


def test_one_rank_has_no_communication() -> None:
    t = build_comm_tables(causal(12), 4, np.zeros(3, dtype=np.int64), 1)
    assert t.send_counts.tolist() == [[0]]
    assert t.gather_index(0).size == 0 and t.recv_rows(0).size == 0 and t.cast_segments(0) == []
    assert (t.comm_rows_total, t.ring_p2p_rows_total, t.allgather_rows_total) == (0, 0, 0)
    assert_round_trip(t)


def test_bad_inputs() -> None:
    m = causal(16)
    with pytest.raises(MaskError, match="square mask, got 16 x 20"):
        build_comm_tables(Mask([], 16, 20), 4, np.array([0, 1, 0, 1]), 2)
    with pytest.raises(MaskParamError, match="rank_of_chunk has 2 chunks of 4 rows, but the mask has 16 rows"):
        build_comm_tables(m, 4, np.array([0, 1]), 2)
    with pytest.raises(MaskParamError, match="every rank must own 2 chunks; rank 0 owns 3"):
        build_comm_tables(m, 4, np.array([0, 0, 0, 1]), 2)
    with pytest.raises(MaskParamError, match="4 chunks cannot be dealt equally to 3 ranks"):
        build_comm_tables(m, 4, np.array([0, 1, 2, 0]), 3)
    with pytest.raises(MaskParamError, match=r"ranks outside \[0, 2\): \[2\]"):
        build_comm_tables(m, 4, np.array([0, 1, 2, 1]), 2)
    with pytest.raises(MaskParamError, match="must be integers"):
        build_comm_tables(m, 4, np.array([0.0, 1.0, 0.0, 1.0]), 2)
    with pytest.raises(MaskParamError, match="cp_size must be a positive int"):
        build_comm_tables(m, 4, np.array([0, 0, 0, 0]), 0)
    with pytest.raises(MaskParamError, match="chunk_size must be a positive int"):
        build_comm_tables(m, 0, np.array([0, 0, 0, 0]), 1)
    with pytest.raises(MaskParamError, match="pieces reach chunk 3 but rank_of_chunk has 2 entries"):
        needed_keys(cut(m, 4), np.array([0, 1]), 2)
    t = build_comm_tables(m, 4, np.array([0, 1, 1, 0]), 2)
    with pytest.raises(MaskParamError, match=r"rank must be an int in \[0, 2\), got 2"):
        t.recv(2)
    data = t.to_dict()
    with pytest.raises(MaskParamError, match="expected format"):
        CommTables.from_dict({**data, "format": "other"})
    with pytest.raises(MaskParamError, match="gather_ptr must have shape"):
        CommTables.from_dict({**data, "gather_ptr": data["gather_ptr"][:-1]})
