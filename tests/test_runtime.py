"""Runtime pieces that need no GPU: finding the runtime library, the ABI, input checks."""

from __future__ import annotations

import ctypes
import json
import lzma
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_kernels import FIELDS, KEY, fake_kernel

import maskc
from maskc.artifact import source, toolchain
from maskc.artifact.abi import BACKWARD_ABI, FORWARD_ABI, ScalarArg, TensorArg, abi_to_json
from maskc.artifact.kernel_families import HeadDim, Tiles
from maskc.artifact.manifest import write_manifest
from maskc.codegen import LoweredMask, write_artifact
from maskc.errors import ArtifactError
from maskc.ir import Mask
from maskc.runtime import call_plan, launch, ops, register_artifact, registry


def kernel_artifact(directory: Path, extra: dict[str, bytes] | None = None, toolchain: dict | None = None) -> Path:
    """An artifact directory holding one (fake) forward kernel object and the `extra` files, all hashed."""
    directory.mkdir(exist_ok=True)
    variant = fake_kernel(directory)
    for name, data in (extra or {}).items():
        (directory / name).write_bytes(data)
    write_manifest(directory, {"toolchain": toolchain or {}, "variants": [variant], "files": [variant["object"], *(extra or {})]})
    return directory


@pytest.fixture
def runtimes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """Which runtime library each registration loads: ("installed", path) or ("shipped", its bytes)."""
    loaded: list[tuple[str, object]] = []
    monkeypatch.setattr(registry, "runtime_at", lambda path: loaded.append(("installed", path)))
    monkeypatch.setattr(registry, "runtime_of", lambda data, name: loaded.append(("shipped", data)))
    monkeypatch.setattr(registry, "KERNELS", {})
    monkeypatch.setattr(registry, "LOADED", [])
    monkeypatch.setattr(toolchain, "installed_library", lambda: Path("/installed/libcute_dsl_runtime.so"))
    monkeypatch.delenv(toolchain.ENV_LIBRARY, raising=False)
    return loaded


def test_a_shipped_library_is_used_from_the_bytes_its_manifest_hashed(tmp_path: Path, runtimes: list) -> None:
    register_artifact(kernel_artifact(tmp_path / "plain", {toolchain.LIBRARY: b"\x7fELF plain"}))
    register_artifact(kernel_artifact(tmp_path / "packed", {toolchain.LIBRARY + ".xz": lzma.compress(b"\x7fELF packed")}))
    assert runtimes == [("shipped", b"\x7fELF plain"), ("shipped", b"\x7fELF packed")]
    kernel_artifact(tmp_path / "bad", {toolchain.LIBRARY + ".xz": b"not xz"})
    with pytest.raises(ArtifactError, match="libcute_dsl_runtime.so.xz is not a valid xz archive"):
        register_artifact(tmp_path / "bad")


def test_a_library_the_manifest_does_not_hash_is_never_loaded(tmp_path: Path, runtimes: list) -> None:
    """A shared library dropped into an artifact directory would run its code in the training process."""
    art = kernel_artifact(tmp_path / "art")
    (art / toolchain.LIBRARY).write_bytes(b"\x7fELF dropped in")
    (art / (toolchain.LIBRARY + ".xz")).write_bytes(lzma.compress(b"\x7fELF dropped in"))
    assert register_artifact(art) == [KEY]
    assert runtimes == [("installed", Path("/installed/libcute_dsl_runtime.so"))]


def test_kernel_objects_run_as_the_bytes_that_were_verified(tmp_path: Path, runtimes: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The object is read once, hashed and kept: a file swapped on disk after registration is never used."""
    built = []
    monkeypatch.setattr(registry, "Kernel", lambda runtime, data, function, abi: built.append(data))
    art = kernel_artifact(tmp_path / "art")
    verified = (art / f"{KEY}.o").read_bytes()
    register_artifact(art)
    (art / f"{KEY}.o").write_bytes(b"swapped in later")
    registry.KERNELS[registry.request_key(FIELDS)].kernel  # noqa: B018 (the lookup loads the kernel)
    assert built == [verified]


def test_library_missing_everywhere_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(toolchain.ENV_LIBRARY, raising=False)
    monkeypatch.setattr(toolchain, "installed_library", lambda: None)
    with pytest.raises(ArtifactError, match=r"libcute_dsl_runtime.so not found; looked in: the nvidia-cutlass-dsl package"):
        toolchain.find_runtime_library()
    monkeypatch.setenv(toolchain.ENV_LIBRARY, str(tmp_path / "lib.so.xz"))
    (tmp_path / "lib.so.xz").write_bytes(lzma.compress(b"\x7fELF"))
    assert toolchain.find_runtime_library() == tmp_path / "lib.so.xz"
    assert toolchain.library_bytes(tmp_path / "lib.so.xz") == b"\x7fELF"


def test_a_library_loads_from_exactly_the_bytes_given() -> None:
    """No path on disk that could be swapped between the check and the load: an in-memory file."""
    installed = toolchain.installed_library()
    if installed is None:
        pytest.skip("the CUTLASS DSL wheel is not installed")
    runtime = launch.runtime_of(installed.read_bytes(), "a test")
    assert runtime.name.startswith("libcute_dsl_runtime.so of a test (sha256 ")
    assert any("/memfd:libcute_dsl_runtime.so" in line for line in Path("/proc/self/maps").read_text().splitlines())
    assert launch.runtime_of(installed.read_bytes(), "another name") is runtime


def test_installed_wheel_library_is_found_without_importing_cutlass() -> None:
    pytest.importorskip("nvidia_cutlass_dsl", reason="the CUTLASS DSL wheel is not installed")
    path = toolchain.installed_library()
    assert path is not None and path.name == toolchain.LIBRARY


def test_abi_structs_hold_only_dynamic_extents() -> None:
    by_name = {a.name: a for a in FORWARD_ABI if isinstance(a, TensorArg)}
    assert by_name["q"].dynamic_dims() == (0,)
    assert by_name["lines"].dynamic_dims() == (0,)
    struct = launch._tensor_struct(by_name["ranges"])
    assert ctypes.sizeof(struct) == 16  # void* + int32[1], padded
    assert json.loads(json.dumps(abi_to_json(FORWARD_ABI)))[0] == {
        "kind": "tensor", "name": "q", "dtype": "input", "shape": ["Tq", "Hq", "D"], "align": 16
    }
    backward = {a.name: a for a in BACKWARD_ABI if isinstance(a, TensorArg)}
    assert backward["lse_log2"].alignment == 16 and backward["dq_accum"].alignment == 16  # TMA operands
    # What the caller zeroes is part of the interface: dK and dV are written, dQ added.
    records = {r["name"]: r for r in abi_to_json(BACKWARD_ABI) if r["kind"] == "tensor"}
    assert records["dq_accum"]["zeroed"] and "zeroed" not in records["dk"] and "zeroed" not in records["dv"]
    assert by_name["sink"].alignment == 4  # the caller's tensor: only element alignment is assumed


class _RecordingRuntime:
    """A runtime whose kernel records, at each launch, what the argument array points the kernel
    at: each tensor's data pointer and first dynamic extent, the stream and the scalars."""

    def __init__(self, abi: tuple) -> None:
        self.abi = abi
        self.launches: list[dict[str, tuple | float | int]] = []
        self.lib = type("Lib", (), {"CuteDSLRT_Function_Run": self._run})()

    def function(self, object_bytes: bytes, prefix: str) -> None:
        return None

    def _run(self, fn, args, nargs) -> int:
        assert nargs == len(self.abi) + 1
        seen = {}
        for arg, address in zip(self.abi, args):
            if isinstance(arg, TensorArg):
                extent = ctypes.c_int32.from_address(address + 8).value if arg.dynamic_dims() else -1
                seen[arg.name] = (ctypes.c_uint64.from_address(address).value, extent)
            elif isinstance(arg, ScalarArg):
                seen[arg.name] = (ctypes.c_float if arg.dtype == "float32" else ctypes.c_int32).from_address(address).value
            else:
                seen[arg.name] = ctypes.c_uint64.from_address(address).value
        self.launches.append(seen)
        return 0


def test_a_launch_reads_the_schedule_it_was_given_also_after_another() -> None:
    """The launcher fills a schedule's slots only when the schedule changes (layers with one
    mask share it): alternating schedules, also one with an array fewer (which then comes with
    the call), every launch still sees its own arrays, and the call's tensors, stream and
    scalars anew each time."""
    runtime = _RecordingRuntime(FORWARD_ABI)
    kernel = launch.Kernel(runtime, b"", "attn_fwd", FORWARD_ABI)
    names = [a.name for a in FORWARD_ABI if isinstance(a, TensorArg)]
    forward_schedule = call_plan.SCHEDULE_ARGS[:6]  # the forward's arrays (work_tile .. key_bounds)
    schedules = [{a.name: torch.zeros(rows, *a.shape[1:], dtype=torch.int32) for a in forward_schedule} for rows in (3, 7)]
    schedules.append({name: t for name, t in schedules[0].items() if name != "key_bounds"})
    for i, which in enumerate((0, 1, 1, 0, 2, 2, 1)):
        call = {n: torch.zeros(4 + i, 2, 8, dtype=torch.bfloat16) for n in names if n not in schedules[which]}
        scalars = {"softmax_scale": 0.5 + i, "softcap": 0.25 * i, "num_ctas": 1 + i}
        kernel(call, schedules[which], scalars, 1000 + i)
        seen = runtime.launches[-1]
        for n in names:
            t = schedules[which][n] if n in schedules[which] else call[n]
            assert seen[n][0] == t.data_ptr(), (i, n)
            if seen[n][1] >= 0:
                assert seen[n][1] == t.shape[0], (i, n)
        assert {n: seen[n] for n in scalars} == scalars and seen["stream"] == 1000 + i


def test_artifact_without_kernels_registers_nothing(tmp_path: Path) -> None:
    write_artifact(tmp_path, [LoweredMask("m", {}, Mask.from_cu_seqlens([0, 8]))])
    assert register_artifact(tmp_path) == []


def test_artifact_for_another_abi_is_refused(tmp_path: Path) -> None:
    variant = {**fake_kernel(tmp_path), "abi": [{"kind": "stream", "name": "stream"}]}
    write_manifest(tmp_path, {"variants": [variant], "files": [variant["object"]]})
    with pytest.raises(ArtifactError, match="another argument ABI"):
        register_artifact(tmp_path)


def test_attention_refuses_other_devices_and_non_tensors() -> None:
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    mask = Mask.from_cu_seqlens([0, 4])
    with pytest.raises(ValueError, match="runs on CUDA or CPU tensors; q is on meta"):
        maskc.attention(q.to("meta"), q, q, mask)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        maskc.attention([1, 2], q, q, mask)
    # A 2-D slice is named by its shape, not by the strides it happens to have.
    with pytest.raises(ValueError, match=r"q must be \[seqlen, heads, head_dim\] or \[batch, .*got \(4, 64\)"):
        maskc.attention(q[:, 0], q, q, mask)


@pytest.mark.parametrize(
    "option, message",
    [
        ({"pack_gqa": "yes"}, "pack_gqa must be None, True or False, got 'yes'"),
        ({"deterministic": "no"}, "deterministic must be True or False, got 'no'"),
        ({"deterministic": None}, "deterministic must be True or False, got None"),
        ({"portable": 1}, "portable must be None, True or False, got 1"),
        ({"return_max_logits": "no"}, "return_max_logits must be True or False, got 'no'"),
        ({"softmax_scale": "0.125"}, "softmax_scale must be a number, got str"),
        ({"softcap": True}, "softcap must be a number, got bool"),
    ],
)
def test_attention_options_of_the_wrong_type_are_errors_not_truthy(option: dict, message: str) -> None:
    """A string for a flag would be truthy and a bool a number: each is refused by name."""
    q, k = torch.randn(4, 2, 64), torch.randn(4, 1, 64)
    with pytest.raises(TypeError, match=re.escape(message)):
        maskc.attention(q, k, k, Mask.from_cu_seqlens([0, 4]), **option)


def test_a_target_refuses_flags_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="deterministic must be True or False, got 'yes'"):
        maskc.target_for("cuda", num_heads_q=8, num_heads_kv=2, head_dim=64, deterministic="yes")


def test_a_target_for_a_gpu_this_process_does_not_see_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not torch's assertion (no CUDA build) or its invalid ordinal: where the target must come from."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(maskc.MaskcError, match=r"target_for\('cuda:2'\) asks for a GPU this process does not see \(2 visible\)"):
        maskc.target_for("cuda:2", num_heads_q=8, num_heads_kv=2, head_dim=64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(maskc.MaskcError, match=r"target_for\('cuda'\) asks for a GPU .* \(0 visible\): ask for the target where"):
        maskc.target_for("cuda", num_heads_q=8, num_heads_kv=2, head_dim=64)


def test_kernels_built_with_another_dsl_release_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no runtime shipped beside them, objects must match the installed DSL's runtime library."""
    pytest.importorskip("nvidia_cutlass_dsl", reason="the CUTLASS DSL wheel is not installed")
    monkeypatch.delenv(toolchain.ENV_LIBRARY, raising=False)
    kernel_artifact(tmp_path, toolchain={"nvidia-cutlass-dsl": "0.0.1"})
    with pytest.raises(ArtifactError, match=r"built with nvidia-cutlass-dsl 0.0.1, but the runtime library found is"):
        register_artifact(tmp_path)


def test_the_unmasked_backward_serves_only_masks_without_partial_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel without line masks for a full mask (any length: blocks past the last query
    count as full); the masked kernel for the rest, and for a full mask when only it is
    registered (never a compile while a registered kernel can serve the call)."""
    def compile_refused(request):
        raise ArtifactError(f"would compile {request}")

    monkeypatch.setattr(registry, "KERNELS", {})
    monkeypatch.setattr(registry, "LOADED", [])
    monkeypatch.setattr(source, "_source", compile_refused)
    target = call_plan.make_target((9, 0), 132, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, None, False)
    request = call_plan.backward_requests(Mask.from_cu_seqlens([0, 1000], causal=True), target)[0]
    entries = {}
    for unmasked in (False, True):
        fields = {**request, "unmasked": unmasked, "tile_m": 64, "tile_n": 128, "num_stages": 2}
        entries[unmasked] = registry.KERNELS[registry.request_key(fields)] = registry.entry_for(None, fields)
    full, causal = Mask.from_cu_seqlens([0, 1000]), Mask.from_cu_seqlens([0, 1000], causal=True)
    assert call_plan.backward_kernel(full, target) is entries[True]
    assert call_plan.backward_kernel(causal, target) is entries[False]
    assert call_plan.backward_kernel(Mask.from_cu_seqlens([0, 1000, 1100]), target) is entries[False]  # a boundary mid-block
    assert call_plan.backward_kernel(Mask.from_cu_seqlens([0, 1024, 1100]), target) is entries[True]  # at a k tile edge
    del registry.KERNELS[registry.request_key({**request, "unmasked": True})]
    assert call_plan.backward_kernel(full, target) is entries[False]
    # The masked kernel compiled by the kernel source for an earlier call is no artifact of the
    # user's: with a source, the unmasked one is compiled; with none, the masked one serves.
    monkeypatch.setattr(registry, "FROM_SOURCE", {registry.request_key(request)})
    with pytest.raises(ArtifactError, match="would compile .*'unmasked': True"):
        call_plan.backward_kernel(full, target)
    monkeypatch.setattr(source, "_source", None)
    assert call_plan.backward_kernel(full, target) is entries[False]
    monkeypatch.setattr(source, "_source", compile_refused)
    del registry.KERNELS[registry.request_key(request)]
    with pytest.raises(ArtifactError, match="'unmasked': True"):
        call_plan.backward_kernel(full, target)  # neither registered: compile the unmasked one


def test_the_forward_takes_the_tall_tile_per_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """At d=128 a full mask asks for the tall forward (192x128) and short causal documents for
    the 128x128 one; the other tile's kernel with the same GQA strategy serves the call where
    only it is registered (an artifact compiled before the tall tile), never a compile. A GQA
    strategy the caller fixed stays fixed."""
    def compile_refused(request):
        raise ArtifactError(f"would compile {request}")

    monkeypatch.setattr(registry, "KERNELS", {})
    monkeypatch.setattr(source, "_source", compile_refused)
    target = call_plan.make_target((9, 0), 132, torch.bfloat16, 64, 8, HeadDim(128, 128), False, False, False, None, False)
    full = Mask.from_cu_seqlens([0, 16384])
    request, alternative = call_plan.forward_requests(full, target)
    assert request["tall"] and not request["pack_gqa"] and alternative == {k: v for k, v in request.items() if k != "tall"}
    docs = Mask.from_cu_seqlens(list(range(0, 16385, 512)), causal=True)
    request_docs, alternative_docs = call_plan.forward_requests(docs, target)
    assert "tall" not in request_docs and request_docs["pack_gqa"] and not alternative_docs["pack_gqa"]
    fields = {**alternative, "tile_m": 128, "tile_n": 128, "num_stages": 2}
    entry = registry.KERNELS[registry.request_key(fields)] = registry.entry_for(None, fields)
    assert registry.find_kernel(request, alternative) is entry
    with pytest.raises(ArtifactError, match="would compile .*'tall': True"):
        registry.find_kernel(request)
    forced = call_plan.make_target((9, 0), 132, torch.bfloat16, 64, 8, HeadDim(128, 128), False, False, False, True, False)
    assert call_plan.forward_requests(full, forced)[0]["pack_gqa"] and call_plan.forward_requests(full, forced)[0]["tall"]


def fake_gpu_without_compiler(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], num_sms: int):
    """The runtime on a fake GPU with no kernel registered and a compiler that refuses (recording
    each request in `asked`); `plan_call` plans a causal 16k-token call, 8:2 heads, d=128, bf16."""
    monkeypatch.setattr(registry, "KERNELS", {})
    monkeypatch.setattr(registry, "LOADED", [])
    monkeypatch.setattr(call_plan, "_host_schedule", lambda mask, build, num_ctas, *params: call_plan.HostSchedule(
        torch.zeros(1, dtype=torch.int32), (1000, 0, 0, 0, 0), 0, num_ctas))  # fmt: skip
    asked = []

    def compile_refused(request):
        asked.append(request)
        raise ArtifactError("no compiler here")

    monkeypatch.setattr(source, "_source", compile_refused)
    mask = Mask.from_cu_seqlens([0, 16384], causal=True)

    def plan_call(pack_gqa: bool | None, needs_grad: bool, deterministic: bool, sm_margin: int = 0,
                  portable: bool | None = None) -> call_plan.Launch:  # fmt: skip
        target = call_plan.make_target(capability, num_sms, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, pack_gqa,
                                       deterministic, sm_margin, portable)  # fmt: skip
        forward = call_plan.plan_forward(mask, target, torch.device("cpu"))
        return call_plan.plan_backward(mask, target, torch.device("cpu")) if needs_grad else forward

    return asked, plan_call


def test_the_portable_kernel_serves_gpus_without_kernels_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an sm_86 GPU the runtime asks for the portable kernels (PackGQA off; the backward
    deterministic or not), runs one CTA per SM (d=128's forward takes 80 KiB of shared memory,
    and an SM has 100), and refuses the native kernels and PackGQA
    with clear errors."""
    asked, plan_call = fake_gpu_without_compiler(monkeypatch, (8, 6), 84)
    with pytest.raises(ArtifactError):
        plan_call(None, False, False)
    assert asked[-1]["arch"] == "sm_86" and asked[-1]["portable"] and not asked[-1]["pack_gqa"]
    fields = {**asked[-1], "tile_m": 64, "tile_n": 64, "num_stages": 2}
    entry = registry.KERNELS[registry.request_key(fields)] = registry.entry_for(None, fields)
    forward = plan_call(None, False, False)
    assert forward.kernel is entry and forward.num_ctas == 84
    with pytest.raises(maskc.MaskcError, match="sm_86 has only the portable kernel"):
        plan_call(None, False, False, 0, False)
    for deterministic in (False, True):
        with pytest.raises(ArtifactError):
            plan_call(None, True, deterministic)
        assert asked[-1]["direction"] == "bwd" and asked[-1]["portable"] and asked[-1]["deterministic"] == deterministic
    with pytest.raises(maskc.MaskcError, match="has no PackGQA yet"):
        plan_call(True, False, False)


def test_blackwell_runs_the_portable_kernels_unless_its_own_are_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm_100 the default is the portable family (verified on real hardware); portable=False
    asks for the experimental SM100 forward (no PackGQA) and backward (never split)."""
    asked, plan_call = fake_gpu_without_compiler(monkeypatch, (10, 0), 148)
    for portable, native_forward in ((None, False), (True, False), (False, True)):
        with pytest.raises(ArtifactError):
            plan_call(None, False, False, 0, portable)
        assert asked[-1]["arch"] == "sm_100a" and asked[-1].get("portable", False) != native_forward
        assert not asked[-1]["pack_gqa"]
    fields = {**asked[-1], "tile_m": 128, "tile_n": 128, "num_stages": 3}
    registry.KERNELS[registry.request_key(fields)] = registry.entry_for(None, fields)
    for deterministic in (True, False):
        with pytest.raises(ArtifactError):
            plan_call(None, True, deterministic, 0, False)  # the forward is registered; the backward is compiled
        assert asked[-1]["direction"] == "bwd" and not asked[-1]["portable"] and not asked[-1].get("unmasked", False)
        assert asked[-1]["arch"] == "sm_100a" and asked[-1]["deterministic"] == deterministic
    backward = {**asked[-1], "tile_m": 128, "tile_n": 128, "num_stages": 2}
    assert registry.entry_for(None, backward).shape.pieces == 1
    assert registry.entry_for(None, {**backward, "arch": "sm_90a", "tile_m": 64}).shape.pieces == 4
    with pytest.raises(maskc.MaskcError, match="has no PackGQA yet"):
        plan_call(True, False, False)


# Audits every write a process attempts under a directory (argv[1]), then registers that
# directory as an artifact and loads it: a read-only artifact directory must need no write.
_REGISTER_WITHOUT_WRITING = """
import os, sys
root = os.path.realpath(sys.argv[1])
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
MUTATIONS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
             "os.symlink", "os.link", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
writes = []

def inside(path):
    return isinstance(path, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(path)).startswith(root)

def audit(event, args):
    if event == "open":
        path, mode, flags = args
        if (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS:
            writes.extend((event, path) for p in [path] if inside(p))
    elif event in MUTATIONS:
        writes.extend((event, p) for p in args if inside(p))

sys.addaudithook(audit)
import maskc.runtime
print(maskc.runtime.register_artifact(root), sorted(maskc.runtime.load_artifact(root).masks))
assert not writes, writes
"""


@pytest.mark.slow
def test_a_read_only_artifact_directory_registers_without_a_write(tmp_path: Path) -> None:
    """What a training job does with a model repo's artifact directory it may not write to."""
    pytest.importorskip("nvidia_cutlass_dsl", reason="registering needs the runtime library of the DSL wheel")
    art = tmp_path / "art"
    write_artifact(art, [LoweredMask("docs", {}, Mask.from_cu_seqlens([0, 8, 20], causal=True))])
    body = json.loads((art / "manifest.json").read_text())
    body["variants"] = [fake_kernel(art, data=b"object bytes, loaded on first use")]
    body["toolchain"]["nvidia-cutlass-dsl"] = toolchain.installed_dsl_version()
    write_manifest(art, {**body, "files": [*body["files"], f"{KEY}.o"]})
    for path in [art, *art.iterdir()]:
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o222)
    try:
        result = subprocess.run([sys.executable, "-c", _REGISTER_WITHOUT_WRITING, str(art)], capture_output=True,
                                text=True, timeout=120)  # fmt: skip
    finally:
        art.chmod(0o755)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"[{KEY!r}] ['docs']"


def test_a_call_keeps_the_opt_in_it_began_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call's options hold $MASKC_PORTABLE_NEXT as it was when the call began, so a backward
    run after the variable changed still runs the forward's family (its lse_log2 rows follow
    that family's tiles)."""
    monkeypatch.setenv("MASKC_PORTABLE_NEXT", "1")
    encoded = ops.Options(None, False, True).encode()
    monkeypatch.setenv("MASKC_PORTABLE_NEXT", "0")
    assert ops.Options.decode(encoded).portable_next
    assert not ops.Options.decode(ops.Options(None, False, True).encode()).portable_next


def test_the_next_portable_kernels_run_only_where_the_environment_opts_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """$MASKC_PORTABLE_NEXT=1 swaps the portable kernels for the experimental next ones wherever
    portable ones run (an A100 by default, or portable=True on Hopper), never the Hopper
    default; the backward's 256-thread CTAs run one per SM, and on an sm_86 GPU (99 KiB a CTA)
    the d=128 backward takes 32-query blocks in one stage."""
    monkeypatch.delenv("MASKC_PORTABLE_NEXT", raising=False)
    assert not call_plan.portable_next_opted_in()
    monkeypatch.setenv("MASKC_PORTABLE_NEXT", "1")
    assert call_plan.portable_next_opted_in()
    monkeypatch.setenv("MASKC_PORTABLE_NEXT", "yes")
    with pytest.raises(maskc.MaskcError, match="MASKC_PORTABLE_NEXT must be 0 or 1, got 'yes'"):
        call_plan.portable_next_opted_in()
    hopper = call_plan.make_target((9, 0), 132, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, None, False,
                                   0, None, True)  # fmt: skip
    assert not hopper.portable and not hopper.portable_next and "portable_next" not in hopper.fields

    def backward_shape(capability: tuple[int, int], num_sms: int, portable_next: bool) -> registry.LaunchShape:
        target = call_plan.make_target(capability, num_sms, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False,
                                       None, False, 0, None, portable_next)  # fmt: skip
        tiles = target.tiles("bwd")
        request = call_plan.backward_requests(Mask.from_cu_seqlens([0, 4096], causal=True), target)[0]
        assert request.get("portable_next", False) == portable_next and request["portable"]
        return call_plan.launch_shape_of(target, request), tiles

    assert backward_shape((8, 0), 108, False) == (registry.LaunchShape(64, 64, 2, ctas_per_sm=2), Tiles(64, 64, 1))
    assert backward_shape((8, 0), 108, True) == (registry.LaunchShape(64, 128, 2, ctas_per_sm=1), Tiles(64, 128, 2))
    assert backward_shape((8, 6), 84, True) == (registry.LaunchShape(32, 128, 2, ctas_per_sm=1), Tiles(32, 128, 1))


def test_head_dims_of_the_next_portable_kernels_are_named_where_a_call_lacks_them() -> None:
    """On an A100, d=96 runs only with the next portable kernels (the error says how to opt in);
    with them d=256 has a forward and a backward (two walks), and on an A10 (99 KiB a CTA) the
    backward's error says why it has none there."""
    with pytest.raises(maskc.MaskcError, match=re.escape("supported head dims: 64, 128; the experimental next portable kernels "
                                                         "have 64, 96, 128, 256 (MASKC_PORTABLE_NEXT=1)")):  # fmt: skip
        call_plan.make_target((8, 0), 108, torch.bfloat16, 8, 2, HeadDim(96, 96), False, False, False, None, False)
    target = call_plan.make_target((8, 0), 108, torch.bfloat16, 8, 2, HeadDim(256, 256), False, False, False, None, False,
                                   0, None, True)  # fmt: skip
    assert target.tiles("fwd") == Tiles(64, 32, 2) and target.tiles("bwd") == Tiles(32, 64, 2)
    compact = call_plan.make_target((8, 6), 84, torch.bfloat16, 8, 2, HeadDim(256, 256), False, False, False, None, False,
                                    0, None, True)  # fmt: skip
    assert compact.tiles("fwd") == Tiles(64, 32, 2)
    with pytest.raises(maskc.errors.VariantError, match="the portable next backward has no kernel for head_dim 256 on "
                                                        r"sm_86 \(its shapes need more than the 99 KiB"):  # fmt: skip
        compact.tiles("bwd")


def test_the_next_portable_forward_has_pack_gqa_and_maskc_picks_it_per_mask() -> None:
    """The verified portable forward refuses pack_gqa=True; the next one takes it, and left to
    maskc (pack_gqa=None) a mask's forward may pick either, the packed kernel's q tiles counted
    in tokens (128 packed rows: 32 tokens of 4 heads) with two CTAs an SM."""
    with pytest.raises(maskc.MaskcError, match=re.escape("has no PackGQA yet; the experimental next portable kernels have it "
                                                         "(MASKC_PORTABLE_NEXT=1)")):  # fmt: skip
        call_plan.make_target((8, 0), 108, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, True, False)
    forced = call_plan.make_target((8, 0), 108, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, True, False,
                                   0, None, True)  # fmt: skip
    mask = Mask.from_cu_seqlens([0, 4096], causal=True)
    request, alternative = call_plan.forward_requests(mask, forced)
    assert request["pack_gqa"] and request["portable_next"] and alternative is None
    assert call_plan.launch_shape_of(forced, request) == registry.LaunchShape(32, 32, 2, ctas_per_sm=2)
    chosen = call_plan.make_target((8, 0), 108, torch.bfloat16, 8, 2, HeadDim(128, 128), False, False, False, None, False,
                                   0, None, True)  # fmt: skip
    request, alternative = call_plan.forward_requests(mask, chosen)
    assert alternative == {**request, "pack_gqa": not request["pack_gqa"]}
