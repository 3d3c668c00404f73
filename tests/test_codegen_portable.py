"""The portable kernels (warp MMA, cp.async, ldmatrix): variant rules, rendering, and compiling
the forward and backward for every supported arch on a machine with no GPU (skipped without the
CUTLASS DSL)."""

from __future__ import annotations

import re

import pytest
from conftest import compile_variants
from generated_source import (
    abi_kinds,
    assert_reads_top_to_bottom,
    entry_params,
    header_arg_kinds,
    module_constants,
)

from maskc.artifact.kernel_families import ARCH_NAMES, native_family
from maskc.artifact.variant import KernelVariant, variant_for
from maskc.codegen.render import render, template_name
from maskc.errors import VariantError


def variant(**overrides) -> KernelVariant:
    fields = dict(arch="sm_80", direction="fwd", head_dim=128, dtype="bf16", num_heads_q=8, num_heads_kv=2, tile_m=64,
                  tile_n=64, num_stages=2, portable=True)  # fmt: skip
    fields.update(overrides)
    return KernelVariant(**fields)


def backward(**overrides) -> KernelVariant:
    return variant(direction="bwd", num_stages=1, **overrides)


def next_backward(**overrides) -> KernelVariant:
    return variant_for({"arch": "sm_80", "direction": "bwd", "head_dim": 128, "dtype": "bf16", "num_heads_q": 8,
                        "num_heads_kv": 2, "portable": True, "portable_next": True, **overrides})  # fmt: skip


# ---- variants --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"portable": False}, "arch sm_80 has only the portable kernel (portable=True)"),
        ({"arch": "sm_120a", "portable": False}, "arch sm_120a has only the portable kernel"),
        ({"direction": "bwd"}, "portable backward tiles 64 x 64 with 2 stage(s) are not supported"),
        ({"direction": "bwd", "num_stages": 1, "unmasked": True}, "the portable backward has no unmasked variant"),
        ({"direction": "bwd", "num_stages": 1, "has_sink": True}, "the portable backward has no sink variant"),
        ({"num_heads_q": 8, "num_heads_kv": 2, "pack_gqa": True}, "the portable forward has no pack_gqa variant"),
        ({"tile_m": 128}, "portable forward tile_m 128 is not supported; supported: 64"),
        ({"tile_n": 96}, "portable forward tile_n 96 is not supported; supported: 64, 128"),
        ({"num_stages": 3}, "portable forward num_stages 3 is not supported; supported: 2"),
        ({"deterministic": True}, "deterministic is a backward option"),
        ({"portable": 1}, "portable must be a bool"),
        ({"arch": "sm_86", "tile_n": 128, "head_dim": 128}, "more than the 100352 a CTA has on sm_86"),
    ],
)
def test_bad_portable_variants_raise_clear_errors(overrides, message):
    with pytest.raises(VariantError, match=re.escape(message)):
        variant(**overrides)


def test_every_arch_has_the_portable_kernel_and_sm90a_its_own_too():
    assert {a for a in ARCH_NAMES if native_family(a) is not None} == {"sm_90a", "sm_100a"}
    for arch in ARCH_NAMES:
        v = variant(arch=arch)
        assert template_name(v) == "attn_fwd_sm80.py.jinja"
        assert v.key().startswith(f"attn_fwd_{arch.replace('_', '').rstrip('a')}_portable_d128_bf16_h8x2_t64x64s2")
    native = KernelVariant("sm_90a", "fwd", 128, "bf16", 8, 2, 128, 128, 2)
    assert template_name(native) == "attn_fwd_sm90.py.jinja" and native.key() != variant(arch="sm_90a").key()


# ---- rendering -------------------------------------------------------------------------------


FEATURES = [
    ("fwd", {}),
    ("fwd", {"has_softcap": True, "has_sink": True, "has_max_logits": True}),
    ("fwd", {"has_sink": True}),
    ("bwd", {}),
    ("bwd", {"has_softcap": True}),
    ("bwd", {"has_softcap": True, "deterministic": True}),
]


@pytest.mark.parametrize("kernel, features", FEATURES)
def test_rendered_source_reads_top_to_bottom_with_the_variant_as_module_constants(kernel, features):
    """The variant's shape and optional features are module constants, which the kernel code
    branches on at compile time (const_expr)."""
    v = variant(**features) if kernel == "fwd" else backward(**features)
    source = render(v)
    assert_reads_top_to_bottom(source, v.key())
    constants = module_constants(source)
    assert {name: constants[name] for name in ("HEAD_DIM", "NUM_HEADS_Q", "NUM_HEADS_KV", "NUM_THREADS")} == {
        "HEAD_DIM": 128, "NUM_HEADS_Q": 8, "NUM_HEADS_KV": 2, "NUM_THREADS": 128}  # fmt: skip
    tiles = ("TILE_M", "TILE_N", "NUM_STAGES") if kernel == "fwd" else ("TILE_Q", "TILE_K")
    assert [constants[name] for name in tiles] == [v.tile_m, v.tile_n, v.num_stages][: len(tiles)]
    flags = {"HAS_SOFTCAP": v.has_softcap, "HAS_SINK": v.has_sink, "HAS_MAX_LOGITS": v.has_max_logits,
             "PACK_GQA": v.pack_gqa, "DETERMINISTIC": v.deterministic, "UNMASKED": v.unmasked}  # fmt: skip
    assert {name: constants[name] for name in flags} == flags


def test_the_source_check_finds_a_function_used_before_its_definition():
    late = '"""variant k"""\n\n\ndef f():\n    return g()\n\n\ndef g():\n    return 1\n'
    with pytest.raises(AssertionError, match="used before their definition"):
        assert_reads_top_to_bottom(late, "k")
    assert_reads_top_to_bottom(late.replace("return g()", "return 2"), "k")


# ---- compiling (CUTLASS DSL, no GPU) ------------------------------------------------------------

COMPILED = {arch: variant(arch=arch) for arch in ARCH_NAMES}
COMPILED["sm_80_d64_fp16_features"] = variant(
    head_dim=64, dtype="fp16", num_heads_kv=8, tile_n=128, has_softcap=True, has_sink=True, has_max_logits=True
)
COMPILED.update({f"{arch}_bwd": backward(arch=arch) for arch in ("sm_80", "sm_90a", "sm_120a")})
COMPILED["sm_90a_bwd_deterministic"] = backward(arch="sm_90a", deterministic=True)
COMPILED["sm_86_bwd_d64_fp16_softcap"] = backward(arch="sm_86", head_dim=64, dtype="fp16", num_heads_kv=8, has_softcap=True)
COMPILED["sm_80_bwd_d64_deterministic_softcap"] = backward(head_dim=64, num_heads_kv=1, deterministic=True, has_softcap=True)
# The next backward: FA2's shape on every arch where it fits (d=128 on sm_86: 32-query blocks, one stage).
NEXT = {f"{arch}_next_bwd": next_backward(arch=arch) for arch in ("sm_80", "sm_86", "sm_90a", "sm_120a")}
NEXT["sm_89_next_bwd_d64_fp16_softcap"] = next_backward(arch="sm_89", head_dim=64, dtype="fp16", has_softcap=True)
NEXT["sm_80_next_bwd_d64_deterministic"] = next_backward(head_dim=64, num_heads_kv=1, deterministic=True)
NEXT["sm_80_next_bwd_d96"] = next_backward(head_dim=96)
NEXT["sm_86_next_bwd_d96_softcap"] = next_backward(arch="sm_86", head_dim=96, has_softcap=True)
# d=256: two walks per item (dV, then dK and dQ).
NEXT["sm_80_next_bwd_d256"] = next_backward(head_dim=256)
NEXT["sm_80_next_bwd_d256_deterministic"] = next_backward(head_dim=256, num_heads_kv=1, deterministic=True)
NEXT["sm_90a_next_bwd_d256_softcap"] = next_backward(arch="sm_90a", head_dim=256, has_softcap=True)
COMPILED.update(NEXT)
# Its forward: 32 query rows a warp up to d=128 (d=96: 32-column swizzle atoms and row copies),
# 16 against 32-key blocks at d=256.
COMPILED["sm_80_next_fwd"] = next_backward(direction="fwd")
COMPILED["sm_86_next_fwd_d64_fp16_softcap"] = next_backward(direction="fwd", arch="sm_86", head_dim=64, dtype="fp16",
                                                            has_softcap=True)  # fmt: skip
COMPILED["sm_80_next_fwd_d96"] = next_backward(direction="fwd", head_dim=96)
COMPILED["sm_80_next_fwd_pack_gqa_features"] = next_backward(direction="fwd", pack_gqa=True, has_softcap=True, has_sink=True,
                                                             has_max_logits=True)  # fmt: skip
COMPILED["sm_89_next_fwd_d64_pack_gqa_8x1"] = next_backward(direction="fwd", head_dim=64, num_heads_kv=1, pack_gqa=True)
COMPILED["sm_120a_next_fwd_d256_features"] = next_backward(direction="fwd", arch="sm_120a", head_dim=256, has_softcap=True,
                                                           has_sink=True, has_max_logits=True)  # fmt: skip


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_variants(tmp_path_factory, "portable_objects", COMPILED)


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiles_for_every_arch_with_warp_mma_cp_async_and_ldmatrix(compiled, name):
    obj = compiled[name]
    assert obj.object_path.read_bytes()[:4] == b"\x7fELF"
    ptx = obj.ptx_text
    arch = COMPILED[name].arch
    assert f".target {arch}" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx and "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert "cp.async.cg.shared.global" in ptx
    for hopper in ("wgmma", "cp.async.bulk", "setmaxnreg", "mbarrier.try_wait"):
        assert hopper not in ptx
    assert ("tanh.approx" in ptx) == COMPILED[name].has_softcap
    # The backward: its preprocess kernel first, dQ by L2 reductions (no other atomics).
    backward_kernel = COMPILED[name].direction == "bwd"
    assert (".entry kernel_cutlass_attn_bwd_prep_kernel" in ptx) == backward_kernel
    assert ("red.global.add.f32" in ptx) == backward_kernel and "atom.global" not in ptx
    # Deterministic: each q block's semaphore, waited on with acquire and counted with release.
    deterministic = COMPILED[name].deterministic
    assert ("ld.global.acquire.gpu" in ptx and "red.release.gpu.global.add.s32" in ptx) == deterministic
    # The kernel takes the arguments of its variant's features only (the others are None).
    v = COMPILED[name]
    params = entry_params(ptx, f"attn_{v.direction}_kernel")
    if v.direction == "fwd":
        # Global tensors: Q, K, V, O, the LSE, the backward's lse_log2 and the five schedule
        # tensors; the row max, the sinks.
        assert params[".align 8 .b8"] == 11 + v.has_max_logits + v.has_sink
        # Scalars: the exponent's scale and lse_log2's offset; the max logits' scale, the softcap's two.
        assert params[".f32"] == 2 + v.has_max_logits + 2 * v.has_softcap
    else:
        # Q, K, V, dO, lse, delta, dQ, dK, dV, the items, their CSR and the five schedule tensors;
        # the semaphores, work blocks and block ranks of the deterministic dQ.
        assert params[".align 8 .b8"] == 16 + 3 * deterministic
        assert params[".f32"] == 2 + 2 * v.has_softcap


def test_exported_headers_match_the_abis(compiled):
    """The exported functions take the ABI's arguments, in its order, with its tensor extents."""
    from abi_check import assert_header_matches_abi

    from maskc.artifact.abi import BACKWARD_ABI, FORWARD_ABI

    for name, abi in (("sm_80", FORWARD_ABI), ("sm_80_bwd", BACKWARD_ABI)):
        header = compiled[name].header_path.read_text()
        assert_header_matches_abi(header, abi)
        assert header_arg_kinds(header, f"attn_{COMPILED[name].direction}") == abi_kinds(abi)


# ---- the next portable kernels (experimental) ------------------------------------------------



def test_the_next_backward_has_fa2s_shape_and_archs_with_99_kib_keep_one_that_fits():
    """128-key tiles of eight warps and two (Q, dO) stages where 144 KiB fit (d=128); on the
    99-KiB archs d=128 takes 32-query blocks and one stage (88 KiB), d=64 keeps the shape (80 KiB)."""
    v = next_backward()
    assert (v.tile_m, v.tile_n, v.num_stages, v.smem_bytes()) == (64, 128, 2, 144 * 1024)
    assert v.experimental and v.key().startswith("attn_bwd_sm80_portable_next_d128_bf16_h8x2_t64x128s2_")
    for arch in ("sm_86", "sm_89", "sm_120a"):
        compact = next_backward(arch=arch)
        assert (compact.tile_m, compact.tile_n, compact.num_stages, compact.smem_bytes()) == (32, 128, 1, 88 * 1024)
        assert (next_backward(arch=arch, head_dim=64).tile_n, next_backward(arch=arch, head_dim=64).smem_bytes()) == (128, 80 * 1024)
    with pytest.raises(VariantError, match=re.escape("tiles 64 x 128 with 2 stage(s) are not supported; supported: 32 x 128, 1 stage")):
        variant(arch="sm_86", direction="bwd", tile_n=128, num_stages=2, portable_next=True)
    with pytest.raises(VariantError, match="portable_next chooses among the portable kernels: it needs portable=True"):
        KernelVariant("sm_90a", "bwd", 128, "bf16", 8, 2, 64, 128, 2, portable_next=True)
    # The verified kernels keep their keys (digests): the field is left out where unset.
    assert backward().key() == "attn_bwd_sm80_portable_d128_bf16_h8x2_t64x64s1_" + backward().digest()
    assert "portable_next" not in backward().to_dict() and next_backward().to_dict()["portable_next"]


def test_the_next_backward_at_d256_walks_each_item_twice_where_132_kib_fit():
    """dK and dV of a warp's 16 keys over 256 head dims (128 registers each) do not fit beside
    S^T and dP^T: the item's q blocks are walked twice, dV first (K alone in shared memory, dV
    stored through sV), then V loads and dK and dQ follow. 64-key tiles against 32-query blocks
    in two stages fit sm_80's 163 KiB; the 99-KiB archs have none, and say why."""
    v = next_backward(head_dim=256)
    assert (v.tile_m, v.tile_n, v.num_stages, v.smem_bytes()) == (32, 64, 2, 132 * 1024) and v.portable_bwd_two_walks
    source = render(v)
    assert module_constants(source)["TWO_WALKS"] and not module_constants(render(next_backward()))["TWO_WALKS"]
    # K and V a k step at a time in S^T and dP^T, as whole fragments on sm_100a (they spill less there).
    assert module_constants(source)["A_BY_K_STEP"] and not module_constants(render(next_backward()))["A_BY_K_STEP"]
    assert not module_constants(render(next_backward(arch="sm_100a", head_dim=256)))["A_BY_K_STEP"]
    kernel = source[source.index("def attn_bwd_kernel("):]
    walks = [m.start() for m in re.finditer(r"for step in cutlass\.range\(", kernel)]
    v_load = kernel.index("load_rows(g2s, tidx, cute.local_tile(mV[")
    dv_store = kernel.index("store_tile(acc_dV, sV,")
    assert len(walks) == 2 and walks[0] < dv_store < v_load < walks[1], "dV's walk, its store, V, then dK's walk"
    assert kernel.count("WALK_DV,") == 2 and kernel.count("WALK_DK_DQ,") == 2 and "WALK_ALL," not in kernel
    assert render(next_backward()).count("WALK_ALL,") == 2
    for arch in ("sm_86", "sm_89", "sm_120a"):
        with pytest.raises(VariantError, match="no kernel for head_dim 256 on " + arch):
            next_backward(arch=arch, head_dim=256)


def test_ctas_per_sm_are_as_many_as_registers_and_shared_memory_hold():
    """Two CTAs of four warps fit an SM's registers; they share its shared memory too, each with
    2 KiB for its barriers and the system, so 80-KiB forwards pair on an A100 (164 KiB) but not
    on the 100-KiB SMs, and the next d=256 backward (132 KiB) runs alone even on an H100."""
    forward = {"arch": "sm_80", "direction": "fwd", "head_dim": 128, "dtype": "bf16", "num_heads_q": 8, "num_heads_kv": 2,
               "portable": True}  # fmt: skip
    assert variant_for(forward).smem_bytes() == 80 * 1024 and variant_for(forward).ctas_per_sm == 2
    assert variant_for({**forward, "arch": "sm_90a"}).ctas_per_sm == 2
    for arch in ("sm_86", "sm_89", "sm_120a"):
        assert variant_for({**forward, "arch": arch}).ctas_per_sm == 1
    assert variant_for({**forward, "head_dim": 256, "portable_next": True}).smem_bytes() == 96 * 1024
    assert variant_for({**forward, "head_dim": 256, "portable_next": True}).ctas_per_sm == 1
    assert variant_for({**forward, "arch": "sm_90a", "head_dim": 256, "portable_next": True}).ctas_per_sm == 2
    assert next_backward(arch="sm_90a", head_dim=256).ctas_per_sm == 1
    assert (next_backward().ctas_per_sm, backward().ctas_per_sm) == (1, 2)  # eight warps; four in 72 KiB
    assert variant_for({**forward, "arch": "sm_90a", "portable": False}).ctas_per_sm == 1


@pytest.mark.parametrize("head_dim, tiles, rows_per_thread", [(64, (128, 128), 4), (96, (128, 64), 4), (128, (128, 32), 4),
                                                          (256, (64, 32), 2)])  # fmt: skip
def test_the_next_forward_has_32_rows_a_warp_up_to_d128(head_dim, tiles, rows_per_thread):
    """Four warps of 32 query rows (two M extents, Q read from shared memory a k step at a
    time) up to d=128, 16 at d=256; every shape fits 99 KiB, so every arch has the same."""
    for arch in ("sm_80", "sm_86", "sm_120a"):
        v = next_backward(direction="fwd", head_dim=head_dim, arch=arch)
        assert (v.tile_m, v.tile_n, v.num_stages) == (*tiles, 2) and v.smem_bytes() <= 96 * 1024
    constants = module_constants(render(v))
    assert (constants["NUM_THREADS"], constants["ROWS_PER_THREAD"]) == (128, rows_per_thread)
    assert constants["Q_IN_REGISTERS"] == (rows_per_thread == 2)
    assert module_constants(render(variant()))["Q_IN_REGISTERS"]  # the verified forward keeps Q in registers


@pytest.mark.parametrize("head_dim, warps, dq_grid", [(128, 8, (4, 2, 128)), (64, 8, (4, 2, 64)), (96, 8, (2, 4, 96)),
                                                      (256, 4, (4, 1, 64))])  # fmt: skip
def test_the_next_backward_renders_its_warps_stages_and_dq_grid_as_constants(head_dim, warps, dq_grid):
    """The dQ^T grid in one product over every head dim where its accumulator takes at most 32
    registers a thread (d=256's would take 64: four products of 16 rows a warp)."""
    v = next_backward(head_dim=head_dim)
    source = render(v)
    assert_reads_top_to_bottom(source, v.key())
    constants = module_constants(source)
    assert (constants["NUM_WARPS"], constants["NUM_THREADS"], constants["NUM_STAGES"]) == (warps, 32 * warps, 2)
    assert (constants["DQ_WARPS_M"], constants["DQ_WARPS_N"], constants["DQ_ROWS"]) == dq_grid == v.portable_dq_grid
    assert constants["ROWS_WITHOUT_BRANCHES"] and not module_constants(render(backward()))["ROWS_WITHOUT_BRANCHES"]
    if head_dim != 256:  # ptxas on sm_120a at d=64 spills 616 bytes with it, none without
        assert next_backward(arch="sm_120a", head_dim=head_dim).portable_bwd_rows_without_branches == (head_dim != 64)
    assert "ahead_m = " in source and "ahead_head = " in source  # the walk one step ahead
    verified = render(backward(head_dim=64))
    assert module_constants(verified)["NUM_STAGES"] == 1 and "ahead_m = " not in verified


def test_the_next_forward_loads_k_and_v_an_ldmatrix_x4_at_a_time_where_that_spills_less(compiled):
    """d=128's 128x32 forward with K and V fragments one ldmatrix.x4 at a time (B_BY_X4): ptxas
    spilled 132 bytes with a whole k step's; d=96's 128x64 keeps whole k steps (48 bytes, 224
    the other way)."""
    assert COMPILED["sm_80_next_fwd"].portable_b_by_x4 and compiled["sm_80_next_fwd"].ptxas.spill_bytes <= 16
    assert not COMPILED["sm_80_next_fwd_d96"].portable_b_by_x4 and compiled["sm_80_next_fwd_d96"].ptxas.spill_bytes <= 64
    assert not next_backward().portable_b_by_x4 and not variant().portable_b_by_x4


@pytest.mark.parametrize("name", sorted(NEXT))
def test_the_next_backward_prefetches_without_spilling(compiled, name):
    """With two stages the step waits for all but the latest cp.async group (the next step's
    Q and dO); ptxas keeps the kernel within a few dozen spill bytes (the verified d=128
    backward spills 2600; on sm_120a, 1208)."""
    v, obj = NEXT[name], compiled[name]
    assert bool(re.search(r"cp\.async\.wait_group\s+1;", obj.ptx_text)) == (v.num_stages == 2)
    assert obj.ptxas.spill_bytes <= 96, obj.ptxas


def most_in_one_block(ptx: str, instruction: str) -> int:
    """The most `instruction`s in one basic block of the backward kernel's PTX (a label or a
    branch ends one)."""
    counts, n = [0], 0
    for line in ptx[ptx.index(".entry kernel_cutlass_attn_bwd_kernel"):].splitlines():
        if re.match(r"^\$\w+:", line) or re.search(r"\bbra(\.uni)?\s", line):
            counts.append(n)
            n = 0
        n += instruction in line
    return max(counts + [n])


@pytest.mark.parametrize("name", ["sm_80_next_bwd", "sm_80_next_bwd_d96", "sm_80_next_bwd_d256_deterministic", "sm_80_bwd"])
def test_the_next_backward_loads_and_adds_its_rows_without_a_branch_each(compiled, name):
    """ROWS_WITHOUT_BRANCHES: a q block inside the sequence loads its Q (or dO) rows by cp.async
    in one basic block, and its dQ reductions of a product all issue in one; the verified kernels
    (and the next ones in a sequence's last block) branch a row for each."""
    v, ptx = COMPILED[name], compiled[name].ptx_text
    assert v.portable_bwd_rows_without_branches == v.portable_next
    threads = 32 * (v.tile_n // 16)
    if v.portable_next:
        assert most_in_one_block(ptx, "red.global.add.f32") == v.portable_dq_grid[2] * v.tile_m // threads
        assert most_in_one_block(ptx, "cp.async.cg.shared.global") == v.tile_m * v.head_dim * 2 // 16 // threads
    else:
        assert most_in_one_block(ptx, "red.global.add.f32") == 1 and most_in_one_block(ptx, "cp.async.cg.shared.global") == 1
