"""maskc as a Transformers attention implementation (maskc.integrations.transformers), on CPU
with tiny models built from configs: packed documents, padding, sliding windows, softcaps
and sinks give what Transformers' own eager attention gives each document alone."""

from __future__ import annotations

import copy
import gc
import importlib.util
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")

import maskc  # noqa: E402
import maskc.integrations.transformers as hf  # noqa: E402

VOCAB = 61
DOCS = [5, 9, 3, 11]  # longer and shorter than the sliding window below


def llama_config(**overrides) -> transformers.LlamaConfig:
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)  # fmt: skip
    return transformers.LlamaConfig(**{**args, **overrides})


def gemma2_config() -> transformers.Gemma2Config:
    """Gemma 2: sliding-window and full layers alternating, logits softcapped at a value that bites."""
    return transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                     sliding_window=4, attn_logit_softcapping=0.5, max_position_embeddings=64)  # fmt: skip


def gpt_oss_config() -> transformers.GptOssConfig:
    """gpt-oss: attention sinks (s_aux), sliding-window and full layers."""
    return transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip


def deepseek_v3_config() -> transformers.DeepseekV3Config:
    """DeepSeek-V3: multi-head latent attention, whose v has a narrower head dim than q and k
    (24 / 16 here, 192 / 128 in the real model)."""
    return transformers.DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                         v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                         topk_group=1, first_k_dense_replace=1, max_position_embeddings=64)  # fmt: skip


CONFIGS = {"llama": llama_config, "gemma2": gemma2_config, "gpt_oss": gpt_oss_config, "deepseek_v3": deepseek_v3_config}


def twins(config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights with maskc's attention and with Transformers' eager attention (each
    model sets the attention implementation on its config, so each gets its own copy)."""
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="maskc", dtype=torch.float32)
    if hasattr(ours.model.layers[0].self_attn, "sinks"):  # initialised to zero: make them matter
        for layer in ours.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32)
    eager.load_state_dict(ours.state_dict())
    return ours, eager


def packed(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of documents: tokens [1, T] and positions restarting at 0 per document."""
    tokens = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return tokens, positions


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to 1e-5 of the largest value: float32 sums in another order differ by about 1e-7 of it."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.detach().abs().max()))


def eager_by_document(eager: torch.nn.Module, tokens: torch.Tensor, weights: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The eager model's logits of each document alone, side by side, with the gradients of the
    weighted loss accumulated in the model."""
    pieces, start = [], 0
    for n in lengths:
        piece = eager(tokens[:, start : start + n]).logits
        (piece * weights[:, start : start + n]).sum().backward()
        pieces.append(piece)
        start += n
    return torch.cat(pieces, dim=1)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "deepseek_v3"])
def test_packed_documents_match_eager_on_each_document_alone(family: str) -> None:
    ours, eager = twins(CONFIGS[family]())
    tokens, positions = packed(DOCS)
    weights = torch.randn(1, sum(DOCS), VOCAB, generator=torch.Generator().manual_seed(2))

    logits = ours(tokens, position_ids=positions).logits
    (logits * weights).sum().backward()

    close(logits, eager_by_document(eager, tokens, weights, DOCS))
    ours_grads, eager_grads = grads(ours), grads(eager)
    assert ours_grads.keys() == eager_grads.keys() and len(ours_grads) > 0
    for name, g in ours_grads.items():
        close(g, eager_grads[name])


def test_rows_of_different_documents_pack_as_one_batch() -> None:
    ours, eager = twins(gemma2_config())
    rows = [[7, 4, 5], [2, 10, 4]]
    tokens = torch.cat([packed(r, seed=i)[0] for i, r in enumerate(rows)])
    positions = torch.cat([packed(r)[1] for r in rows])
    logits = ours(tokens, position_ids=positions).logits
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            close(logits[b : b + 1, start : start + n], eager(tokens[b : b + 1, start : start + n]).logits)
            start += n


def test_data_collator_with_flattening_kwargs() -> None:
    """DataCollatorWithFlattening's cu_seq_lens_q/k (and its position_ids) reach the attention."""
    ours, _ = twins(llama_config())
    tokens, positions = packed(DOCS)
    starts = torch.cumsum(torch.tensor([0, *DOCS]), 0).tolist()
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collate([{"input_ids": tokens[0, s:e].tolist()} for s, e in zip(starts, starts[1:])])
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "position_ids"} <= batch.keys()
    by_positions = ours(tokens, position_ids=positions).logits
    close(ours(**batch).logits, by_positions)
    del batch["position_ids"]  # the documents come from cu_seq_lens alone
    close(ours(**batch).logits, by_positions)


def test_padded_batch_matches_eager_on_its_tokens() -> None:
    ours, eager = twins(gemma2_config())
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones(3, 12, dtype=torch.long)
    attention_mask[1, 8:] = 0  # right padding
    attention_mask[2, :5] = 0  # left padding
    got = ours(tokens, attention_mask=attention_mask).logits
    want = eager(tokens, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    close(got[real], want[real])


def test_padding_between_tokens_is_a_clear_error() -> None:
    ours, _ = twins(llama_config())
    attention_mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    with pytest.raises(maskc.MaskError, match="padding between its tokens"):
        ours(torch.zeros(1, 6, dtype=torch.long), attention_mask=attention_mask)


def test_an_explicit_mask_wins() -> None:
    ours, _ = twins(llama_config())
    tokens, positions = packed(DOCS)
    documents = ours(tokens, position_ids=positions).logits
    mask = maskc.Mask.from_position_ids(positions, causal=True)
    # The positions below say one document; the explicit mask says four.
    close(ours(tokens, position_ids=positions, **{hf.MASK_KWARG: mask}).logits, documents)
    one_document = ours(tokens).logits
    assert not torch.allclose(one_document, documents, atol=1e-3)
    # Over the whole batch too, shared by rows or packed.
    two = torch.cat([tokens, tokens])
    close(ours(two, position_ids=positions, maskc_mask=mask).logits, torch.cat([documents, documents]))
    packed_mask = maskc.Mask.from_position_ids(torch.cat([positions, positions], dim=1), causal=True)
    close(ours(two, position_ids=positions, maskc_mask=packed_mask).logits, torch.cat([documents, documents]))
    # Planned ahead (in a DataLoader worker; on a CPU without a plan).
    close(ours(tokens, maskc_mask=maskc.prepare(mask, None)).logits, documents)
    # With padding, which maskc leaves out of the explicit mask too.
    attention_mask = torch.ones(2, 28, dtype=torch.long)
    attention_mask[1, 20:] = 0
    padded = ours(two, position_ids=positions, attention_mask=attention_mask, maskc_mask=mask).logits
    close(padded[0], documents[0])
    close(padded[1, :20], documents[0, :20])
    with pytest.raises(hf.TransformersAttentionError, match=r"must be \(28, 28\) .* or \(56, 56\)"):
        ours(two, maskc_mask=maskc.Mask.from_cu_seqlens([0, 10], causal=True))
    leaky = maskc.Mask.stack([maskc.Mask.from_cu_seqlens([0, n], causal=True) for n in (20, 36)])  # 56 tokens, not 28 + 28
    with pytest.raises(maskc.MaskError, match="lets a batch row attend another row's tokens"):
        ours(two, maskc_mask=leaky)


def test_the_mask_is_built_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    builds = []
    from_position_ids = maskc.Mask.from_position_ids
    monkeypatch.setattr(maskc.Mask, "from_position_ids", lambda *a, **kw: builds.append(a) or from_position_ids(*a, **kw))
    llama, _ = twins(llama_config(num_hidden_layers=3))
    tokens, positions = packed(DOCS)
    llama(tokens, position_ids=positions).logits.sum().backward()
    assert len(builds) == 1
    llama(tokens, position_ids=positions)  # the same tensor, unchanged: cached
    assert len(builds) == 1
    positions[0, 2] = 0  # changed in place: a new mask
    llama(tokens, position_ids=positions)
    assert len(builds) == 2
    llama(tokens, position_ids=positions.clone())
    assert len(builds) == 3
    gemma, _ = twins(gemma2_config())
    gemma(tokens, position_ids=positions.clone())  # a sliding-window mask and a full one
    assert len(builds) == 5


def test_cu_seq_lens_masks_are_kept_while_their_tensors_hold_them(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[weakref.ref] = []
    build = hf._build
    monkeypatch.setattr(hf, "_build", lambda *a: built.append(weakref.ref(mask := build(*a))) or mask)
    ours, _ = twins(llama_config(num_hidden_layers=2))
    cu = torch.cumsum(torch.tensor([0, *DOCS], dtype=torch.int32), 0)
    tokens, _ = packed(DOCS)

    def forward() -> torch.Tensor:
        return ours(tokens, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(DOCS), max_length_k=max(DOCS)).logits  # noqa: F821 (cu is deleted below, after the last call)

    first = forward()
    assert len(built) == 1  # two layers, one mask
    cu.numpy()[1:] += 1  # a write torch does not count: the lengths are compared, not the version
    cu.numpy()[-1] = sum(DOCS)
    assert not torch.equal(forward(), first) and len(built) == 2
    del cu, first  # the first output's graph holds its mask too
    gc.collect()
    assert [ref() for ref in built] == [None, None]  # the masks went with their tensor


def test_dropout_is_a_clear_error() -> None:
    ours, _ = twins(llama_config(attention_dropout=0.1))
    tokens, positions = packed(DOCS)
    ours.eval()
    ours(tokens, position_ids=positions)  # no dropout outside training
    ours.train()
    with pytest.raises(hf.TransformersAttentionError, match="attention dropout 0.1 in training"):
        ours(tokens, position_ids=positions)


def test_generation_with_a_kv_cache_is_a_clear_error() -> None:
    ours, _ = twins(llama_config())
    tokens, _ = packed(DOCS)
    prefill = ours(tokens[:, :6], use_cache=True)
    with pytest.raises(hf.TransformersAttentionError, match="KV cache"):
        ours(tokens[:, 6:7], past_key_values=prefill.past_key_values, use_cache=True)


def test_a_dense_mask_is_a_clear_error() -> None:
    ours, _ = twins(llama_config())
    dense = torch.zeros(1, 1, 6, 6)
    with pytest.raises(hf.TransformersAttentionError, match="dense 4-D attention_mask"):
        ours(torch.zeros(1, 6, dtype=torch.long), attention_mask=dense)


def test_register_is_idempotent_and_import_maskc_stays_light() -> None:
    hf.register()
    hf.register()
    assert transformers.AttentionInterface._global_mapping["maskc"] is hf.transformers_attention
    code = "import sys, maskc; maskc.Mask; maskc.reference_attention; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_autocast_runs_in_its_half_dtype() -> None:
    """Under autocast and without a cache (as in training) rotary embeddings leave q and k in
    float32 and v in bfloat16: maskc takes all three in the autocast dtype, as Transformers'
    flash attention does."""
    ours, _ = twins(llama_config())
    tokens, positions = packed(DOCS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours(tokens, position_ids=positions, use_cache=False).logits
    want = ours(tokens, position_ids=positions).logits
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * float(want.detach().abs().max()))


@pytest.mark.slow
def test_the_packed_finetune_example_learns_on_cpu() -> None:
    path = Path(__file__).resolve().parents[1] / "examples" / "hf_packed_finetune.py"
    spec = importlib.util.spec_from_file_location("hf_packed_finetune", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.train(steps=40, tokens=1024, device="cpu")
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)


def test_mask_overlays_of_a_model_are_a_clear_error_unless_a_mask_is_given() -> None:
    """Gemma 3's bidirectional mode overlays a mask function (or_mask_function) that maskc
    cannot read, over both its full and its sliding-window layers."""
    config = transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                           use_bidirectional_attention=True, max_position_embeddings=64)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="maskc")
    tokens = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(hf.TransformersAttentionError, match="overlays a mask function of its own"):
        model(tokens)
    assert model(tokens, maskc_mask=maskc.Mask.from_cu_seqlens([0, 10])).logits.shape == (1, 10, VOCAB)


def test_chunked_attention_is_a_clear_error() -> None:
    config = types.SimpleNamespace(attention_chunk_size=8)
    unsupported = hf.padding_mask(1, 10, 10, config=config, attention_mask=None)
    ours, _ = twins(llama_config())
    layer = ours.model.layers[0].self_attn
    q, kv = torch.zeros(1, 4, 10, 16), torch.zeros(1, 2, 10, 16)
    with pytest.raises(hf.TransformersAttentionError, match="attends in chunks of 8 tokens"):
        hf.transformers_attention(layer, q, kv, kv, unsupported)


@pytest.mark.slow
def test_a_compiled_model_takes_new_documents_every_step_without_recompiling() -> None:
    """torch.compile of a Llama with attn_implementation="maskc": position_ids are data, so new
    packings (other document counts and lengths) compile no more after the second step; logits
    and gradients are the eager model's."""
    torch._dynamo.reset()
    counters.clear()
    ours, _ = twins(llama_config())
    compiled = torch.compile(ours, backend="aot_eager")
    rng = torch.Generator().manual_seed(3)
    graphs = []
    for step in range(6):
        lengths = torch.randint(2, 12, (int(torch.randint(1, 5, (1,), generator=rng)),), generator=rng).tolist()
        tokens, positions = packed(lengths, seed=step)
        logits = compiled(tokens, position_ids=positions).logits
        logits.square().sum().backward()
        got = {name: p.grad.clone() for name, p in ours.named_parameters()}
        ours.zero_grad()
        eager = ours(tokens, position_ids=positions).logits
        eager.square().sum().backward()
        close(logits, eager)
        for name, p in ours.named_parameters():
            close(got[name], p.grad)
        ours.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1] and graphs[1] <= 2 * graphs[0], graphs
    # cu_seq_lens are read on the host: a graph break, the same logits.
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 5, "max_length_k": 5}
    close(compiled(tokens[:, :10], **kwargs).logits, ours(tokens[:, :10], **kwargs).logits)


def test_a_bidirectional_sliding_window_is_a_clear_error() -> None:
    ours, _ = twins(llama_config())
    layer = ours.model.layers[0].self_attn
    q, kv = torch.zeros(1, 4, 10, 16), torch.zeros(1, 2, 10, 16)
    with pytest.raises(hf.TransformersAttentionError, match="bidirectional sliding window"):
        hf.transformers_attention(layer, q, kv, kv, None, sliding_window=4, is_causal=False)
    mask = maskc.Mask.from_cu_seqlens([0, 10])  # an explicit mask decides for itself
    out, _ = hf.transformers_attention(layer, q, kv, kv, None, sliding_window=4, is_causal=False, maskc_mask=mask)
    assert out.shape == (1, 10, 4, 16)


GPU_DOCS = [300, 1000, 77, 700]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_documents_on_the_gpu_match_eager_on_each_document_alone(family: str) -> None:
    """maskc's kernels in bf16 (head dim 64) against Transformers' eager attention in float32,
    document by document: logits and parameter gradients within bf16's error."""
    configs = {
        "llama": lambda: llama_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=2048),  # fmt: skip
        "gemma2": lambda: transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=192,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                    head_dim=64, query_pre_attn_scalar=64, sliding_window=128,
                                                    attn_logit_softcapping=20.0, max_position_embeddings=2048),  # fmt: skip
    }
    ours, eager = twins(configs[family]())
    ours, eager = ours.to("cuda", torch.bfloat16), eager.to("cuda")
    tokens, positions = (x.cuda() for x in packed(GPU_DOCS))
    weights = torch.randn(1, sum(GPU_DOCS), VOCAB, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    logits = ours(tokens, position_ids=positions).logits
    (logits.float() * weights).sum().backward()
    assert _relative(logits, eager_by_document(eager, tokens, weights, GPU_DOCS)) < 2e-2
    ours_grads, eager_grads = grads(ours), grads(eager)
    assert ours_grads.keys() == eager_grads.keys()
    for name, g in ours_grads.items():
        assert _relative(g, eager_grads[name]) < 5e-2, name
