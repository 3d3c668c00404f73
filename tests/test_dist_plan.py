"""The context-parallel plan as a product: make_plan, JSON round trip, mixed masks, `maskc plan`."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ir import masks

import maskc
from maskc.dist.assign import pad
from maskc.dist.comm import build_comm_tables
from maskc.dist.plan import Plan, default_chunk_size, make_plan
from maskc.errors import MaskError, MaskParamError
from maskc.ir import AttnSlice, Mask

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = {"imbalance", "ranks", "comm_rows_total", "ring_p2p_rows_total", "allgather_rows_total", "num_stages",
                "fuse_local"}  # fmt: skip


def square(mask: Mask) -> Mask:
    n = max(mask.shape)
    return Mask(mask.slices, n, n)


@pytest.mark.slow
@given(masks(max_len=40, max_slices=6), st.sampled_from([1, 2, 3, 5, 8, 16, 33, 64]), st.sampled_from([1, 2, 5]))
@settings(max_examples=80, deadline=None)
def test_plans_deal_every_chunk_once_and_round_trip(mask: Mask, cp: int, chunk: int) -> None:
    mask = square(mask)
    plan = make_plan(mask, cp, chunk)
    dense = plan.mask.to_dense().numpy()
    for r in range(cp):  # zero redundancy: the remote rows received are exactly the ones needed
        own = np.zeros(plan.padded_length, dtype=bool)
        own[plan.comm.local_rows(r)] = True
        needed = dense[own].any(axis=0) & ~own
        assert sorted(plan.comm.recv_rows(r).tolist()) == np.flatnonzero(needed).tolist()
    s = plan.summary()
    assert sum(r["ring_p2p_recv_rows"] for r in s["ranks"]) == s["ring_p2p_rows_total"]
    assert s["comm_rows_total"] <= s["ring_p2p_rows_total"] <= s["allgather_rows_total"]
    assert plan.padded_length % (cp * chunk) == 0 and plan.padded_length >= mask.seqlen_q
    counts = np.bincount(plan.rank_of_chunk, minlength=cp)
    assert (counts == plan.num_chunks // cp).all()
    assert plan.rank_areas().sum() == mask.area()  # padding adds no work
    assert plan.rank_areas().max() >= plan.lower_bound()
    again = Plan.from_json(plan.to_json())
    assert again.summary() == plan.summary() and np.array_equal(again.rank_of_chunk, plan.rank_of_chunk)
    assert (again.stages.num_stages, again.stages.fuse_local) == (plan.stages.num_stages, plan.stages.fuse_local)
    assert plan.stages.rows_per_rank == plan.padded_length // cp
    assert SUMMARY_KEYS <= set(json.loads(plan.to_json()))


def test_a_tampered_or_foreign_document_is_refused() -> None:
    plan = make_plan(Mask.from_cu_seqlens([0, 300, 1000], causal=True), 4, 64)
    doc = json.loads(plan.to_json())
    doc["comm_rows_total"] += 1
    with pytest.raises(MaskError, match="do not match"):
        Plan.from_json(json.dumps(doc))
    for text in ("{}", "[1, 2]", json.dumps({**doc, "format": 99})):
        with pytest.raises(MaskError):
            Plan.from_json(text)


@pytest.mark.parametrize("fuse", [False, True])
def test_fuse_local_is_an_input_the_json_keeps(fuse: bool) -> None:
    mask = Mask.from_cu_seqlens([0, 300, 1000, 1150, 2048], causal=True)
    plan = make_plan(mask, 4, 64, num_stages=2, fuse_local=fuse)
    assert (plan.stages.num_stages, plan.stages.fuse_local) == (2, fuse)
    assert [(n, u) for n, u, _, _ in plan.stages.scan] == [(2, fuse)]
    assert plan.summary()["fuse_local"] is fuse
    doc = json.loads(plan.to_json())
    again = Plan.from_json(json.dumps(doc))
    assert again.stages.fuse_local is fuse and again.summary() == plan.summary()
    # The other fusion models other times, so a flipped flag no longer matches the numbers.
    with pytest.raises(MaskError, match="do not match"):
        Plan.from_json(json.dumps({**doc, "fuse_local": not fuse}))
    with pytest.raises(MaskError, match="not a maskc plan"):
        Plan.from_json(json.dumps({k: v for k, v in doc.items() if k != "fuse_local"}))
    with pytest.raises(MaskError, match="fuse_local must be a bool"):
        Plan.from_json(json.dumps({**doc, "fuse_local": "yes"}))
    # Left to the planner, both are tried; another layer's mask is planned afresh.
    best = make_plan(mask, 4, 64)
    assert {(n, u) for n, u, _, _ in best.stages.scan} == {(n, u) for n in range(1, 9) for u in (False, True)}
    assert best.stages.time <= plan.stages.time * (1 + 1e-9)
    assert len(plan.for_mask(mask).stages.scan) == 16


def test_another_mask_keeps_the_dispatch_and_gets_its_own_tables() -> None:
    docs = Mask.from_cu_seqlens([0, 700, 1500, 2048], causal=True)
    window = Mask.sliding_window([0, 2048], 128)
    plan = make_plan(docs, 8, 64)
    other = plan.for_mask(window)
    assert np.array_equal(other.rank_of_chunk, plan.rank_of_chunk)
    expected = build_comm_tables(pad(window, plan.padded_length), 64, plan.rank_of_chunk, 8)
    assert other.comm.to_dict() == expected.to_dict()
    assert other.rank_areas().sum() == window.area()
    with pytest.raises(MaskError, match="this plan is for 2048"):
        plan.for_mask(Mask.sliding_window([0, 1024], 16))


def test_bad_arguments_are_clear_errors() -> None:
    mask = Mask.from_cu_seqlens([0, 256], causal=True)
    with pytest.raises(MaskError, match="must be square"):
        make_plan(Mask([AttnSlice((0, 10), (0, 20))], 10, 20), 2)
    with pytest.raises(MaskParamError, match="cp_size must be a positive int"):
        make_plan(mask, 0)
    with pytest.raises(MaskParamError, match="unknown dispatch algorithm 'best'"):
        make_plan(mask, 2, algorithm="best")
    with pytest.raises(MaskParamError, match="fuse_local must be a bool"):
        make_plan(mask, 2, fuse_local=1)


def test_default_chunk_size() -> None:
    assert default_chunk_size(1 << 20, 64) == 2048
    assert default_chunk_size(65536, 8) == 1024
    assert default_chunk_size(1000, 64) == 64


def maskc_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maskc.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_plan_command_json_png_and_report(tmp_path: Path) -> None:
    docs = "--param", "docs=3000,1000,5000,2000,1192"
    result = maskc_cli("plan", "examples/varlen_causal.mask", *docs, "--cp", "4", "--json", "--png", str(tmp_path / "p.png"))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert SUMMARY_KEYS <= set(doc) and len(doc["ranks"]) == 4
    assert sorted(c for r in doc["ranks"] for c in r["chunks"]) == list(range(sum(len(r["chunks"]) for r in doc["ranks"])))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    report = maskc_cli("plan", "examples/varlen_causal.mask", *docs, "--cp", "4", "--algorithm", "greedy")
    assert report.returncode == 0, report.stderr
    assert "imbalance" in report.stdout and "ring P2P" in report.stdout and "all-gather" in report.stdout
    for flag, fused in (("--fuse-local", True), ("--no-fuse-local", False)):
        forced = maskc_cli("plan", "examples/varlen_causal.mask", *docs, "--cp", "4", "--stages", "2", flag, "--json")
        assert forced.returncode == 0, forced.stderr
        assert (json.loads(forced.stdout)["num_stages"], json.loads(forced.stdout)["fuse_local"]) == (2, fused)
    fused = maskc_cli("plan", "examples/varlen_causal.mask", *docs, "--cp", "4", "--fuse-local")
    assert "fused with the local keys" in fused.stdout
    bad = maskc_cli("plan", "examples/varlen_causal.mask", "--cp", "4", "--algorithm", "nope")
    assert bad.returncode == 2 and "unknown dispatch algorithm" in bad.stderr


@pytest.mark.slow
def test_compile_writes_the_plan_into_the_artifact(tmp_path: Path) -> None:
    result = maskc_cli("compile", "examples/varlen_causal.mask", "-o", str(tmp_path), "--ir-only", "--cp", "2")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entry = manifest["masks"]["varlen_causal"]
    assert entry["plan"] in manifest["files"]
    plan = Plan.from_json((tmp_path / entry["plan"]).read_text())
    assert plan.cp_size == 2 and plan.seqlen == entry["seqlen_q"]


def test_a_prepared_mask_plans_as_its_mask() -> None:
    """What a DataLoader worker hands over (maskc.prepare) feeds maskc.dist as the mask does."""
    mask = Mask.from_cu_seqlens([0, 700, 1500, 4096], causal=True)
    shipped = pickle.loads(pickle.dumps(maskc.prepare(mask, None)))
    assert make_plan(shipped, cp_size=4).to_json() == make_plan(mask, cp_size=4).to_json()
    with pytest.raises(TypeError, match="maskc Mask or PreparedMask"):
        make_plan(mask.table, cp_size=4)
