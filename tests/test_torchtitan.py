"""maskc as torchtitan's attention backend (maskc.integrations.torchtitan) on CPU, with a tiny
torchtitan Llama 3 (its debugmodel cut to two layers): packed documents give torchtitan's own
flex backend's logits and each document's logits and gradients alone; under context
parallelism (gloo, 2 and 4 processes, with and without FSDP2) the loss and every gradient are
one process's."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
import traceback
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

torchtitan = pytest.importorskip("torchtitan")

from test_dist_execute import run_ranks  # noqa: E402
from test_dist_prepared import planning_calls  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

import maskc  # noqa: E402
import maskc.integrations.torchtitan as tt  # noqa: E402

VOCAB = 2048  # the debugmodel's
LENGTHS = [[20, 30, 14], [5, 59]]  # the documents of each row
SEQ = 64
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchtitan_llama.py"


def tiny_llama(backend: str = "maskc", seed: int = 0) -> torch.nn.Module:
    """torchtitan's Llama 3 debugmodel with two layers, float32, weights drawn from `seed`;
    backend "maskc" (use_maskc_attention) or one of torchtitan's."""
    config = model_registry("debugmodel", attn_backend="flex" if backend == "maskc" else backend).model
    config.layers = config.layers[:2]
    if backend == "maskc":
        tt.use_maskc_attention(config)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, labels, positions) [2, SEQ] of LENGTHS, positions restarting at 0 per document."""
    gen = torch.Generator().manual_seed(seed)
    tokens, labels = (torch.randint(0, VOCAB, (len(LENGTHS), SEQ), generator=gen) for _ in range(2))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    return tokens, labels, positions


def by_document(model: torch.nn.Module, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The logits of each document alone (its own row), side by side, with the gradients of the
    weighted sum accumulated in the model."""
    rows = []
    for b, lengths in enumerate(LENGTHS):
        pieces, start = [], 0
        for n in lengths:
            t, p = tokens[b : b + 1, start : start + n], torch.arange(n).unsqueeze(0)
            piece = model(t, positions=p, attention_masks=tt.document_mask(t, p))
            (piece * weights[b : b + 1, start : start + n]).sum().backward()
            pieces.append(piece)
            start += n
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to 1e-5 of the largest value (float32 sums in another order)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.detach().abs().max()))


def test_the_backend_replaces_every_inner_attention() -> None:
    model = tiny_llama()
    assert all(isinstance(layer.attention.inner_attention, tt.MaskcAttention) for layer in model.layers.values())
    with pytest.raises(tt.TorchtitanAttentionError, match="no flex or varlen attention"):
        tt.use_maskc_attention(model_registry("debugmodel").model.layers[0].feed_forward)


@pytest.mark.parametrize("source", ["positions", "document_ids"])
def test_packed_documents_match_each_document_alone(source: str) -> None:
    """Logits and every weight's gradient of the packed rows are those of each document run
    alone: the mask keeps the documents apart (positions and document ids alike)."""
    ours, alone = tiny_llama(), tiny_llama()
    tokens, _, positions = batch()
    weights = torch.randn(*tokens.shape, VOCAB, generator=torch.Generator().manual_seed(2))
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in LENGTHS])
    mask = tt.document_mask(tokens, positions) if source == "positions" else tt.document_mask(tokens, document_ids=ids)
    logits = ours(tokens, positions=positions, attention_masks=mask)
    (logits * weights).sum().backward()
    close(logits, by_document(alone, tokens, weights))
    ours_grads, alone_grads = grads(ours), grads(alone)
    assert ours_grads.keys() == alone_grads.keys() and len(ours_grads) > 10
    for name, g in ours_grads.items():
        close(g, alone_grads[name])


@pytest.mark.slow
def test_logits_equal_torchtitans_flex_backend() -> None:
    """The same weights with torchtitan's FlexAttention and its own block-causal document mask
    (forward only: FlexAttention has no backward on CPU)."""
    ours, flex = tiny_llama(), tiny_llama("flex")
    tokens, _, positions = batch()
    with torch.no_grad():
        want = flex(tokens, positions=positions, attention_masks=flex.get_attention_masks(positions))
        close(ours(tokens, positions=positions, attention_masks=tt.document_mask(tokens, positions)), want)


def test_the_packed_mask_is_the_rows_masks_end_to_end() -> None:
    """Context parallelism's mask over the rows laid end to end: every row's first token begins
    a document (even where a data loader's positions or ids continue across rows), padding
    (id < 0) attends nothing."""
    tokens, _, positions = batch()
    rows = [maskc.Mask.from_position_ids(p, causal=True) for p in positions]
    assert torch.equal(tt.packed_document_mask(tokens, positions).to_dense(), maskc.Mask.stack(rows).to_dense())
    ids = torch.tensor([[3, 3, 4, 4, -1], [4, 4, 4, 5, 5]])  # row 1 continues row 0's document 4
    rows = [maskc.Mask.from_document_ids(r, causal=True) for r in ids]
    assert torch.equal(tt.packed_document_mask(ids, document_ids=ids).to_dense(), maskc.Mask.stack(rows).to_dense())


def test_bad_input_is_named() -> None:
    attention = tt.MaskcAttention(tt.MaskcAttention.Config())
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(tt.TorchtitanAttentionError, match="needs a maskc mask as attention_masks, got NoneType"):
        attention(q, q, q, attention_masks=None)
    with pytest.raises(tt.TorchtitanAttentionError, match="score_mod"):
        attention(q, q, q, attention_masks=tt.document_mask(q[..., 0, 0].long()), score_mod=lambda s, *_: s)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(tt.TorchtitanAttentionError, match=r"positions must be an integer tensor shaped like the tokens \(2, 8\)"):
        tt.document_mask(tokens, torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(tt.TorchtitanAttentionError, match="use_maskc takes a torchtitan Trainer.Config, got dict"):
        tt.use_maskc({})


def test_compiled_blocks_take_new_documents_without_recompiling() -> None:
    """Each transformer block compiled with fullgraph=True, as torchtitan's apply_compile does
    (aot_eager: the graph capture, without inductor's C++ build), gives the eager logits, and
    batches of other documents compile nothing new once the first two have run."""
    torch._dynamo.reset()
    eager, compiled = tiny_llama(), tiny_llama()
    for block in compiled.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    tokens, _, positions = batch()
    batches = [positions, positions.flip(0)] + [
        torch.cat([torch.arange(n), torch.arange(SEQ - n)]).repeat(2, 1) for n in (40, 7, 63)
    ]
    for i, p in enumerate(batches):
        with torch.no_grad():
            want = eager(tokens, positions=p, attention_masks=tt.document_mask(tokens, p))
            close(compiled(tokens, positions=p, attention_masks=tt.document_mask(tokens, p)), want)
        if i == 1:
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs > 0


def test_use_maskc_makes_a_maskc_trainer_config_of_torchtitans(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's own llama3_debugmodel config, made maskc's: MaskcTrainer builds it, every
    layer attends with maskc, maskc's parallelize_fn, the partial_dtensor SPMD backend; the
    example's config is one, and its data loader gives torchtitan's batch format."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = tt.use_maskc(llama3_debugmodel())
    assert type(config) is tt.MaskcTrainer.Config and config._owner is tt.MaskcTrainer
    layers = config.model_spec.model.layers
    assert len(layers) == 6 and all(isinstance(layer.attention.inner_attention, tt.MaskcAttention.Config) for layer in layers)
    assert config.model_spec.parallelize_fn is tt.parallelize and config.parallelism.spmd_backend == "partial_dtensor"

    spec = importlib.util.spec_from_file_location("torchtitan_llama", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "torchtitan_llama", example)  # its dataclasses look their module up
    spec.loader.exec_module(example)
    assert isinstance(example.maskc_llama3_debugmodel(), tt.MaskcTrainer.Config)
    loader = example.SyntheticDocuments(example.SyntheticDocuments.Config(), dp_rank=0, dp_world_size=1, seq_len=SEQ,
                                        local_batch_size=2)  # fmt: skip
    inputs, labels = next(iter(loader))
    assert inputs["input"].shape == inputs["positions"].shape == labels.shape == (2, SEQ)
    starts = inputs["positions"] == 0
    assert starts[:, 0].all() and starts.sum() > 2
    assert torch.equal(inputs["input"][:, 2:][~(starts[:, 1:-1] | starts[:, 2:])],
                       inputs["input"][:, :-2][~(starts[:, 1:-1] | starts[:, 2:])])  # fmt: skip


def test_the_trainer_hands_the_model_maskcs_mask() -> None:
    """MaskcTrainer.post_dataloading_process on one process: the documents of the batch's
    positions reach the model as attention_masks, document_ids (when given) replace them and
    never reach the model."""
    trainer = tt.MaskcTrainer.__new__(tt.MaskcTrainer)  # its __init__ needs an accelerator (torchtitan 0.3.0)
    trainer.parallel_dims, trainer.ntokens_seen = types.SimpleNamespace(cp_enabled=False), 0
    tokens, labels, positions = batch()
    inputs, got_labels, extra = trainer.post_dataloading_process({"input": tokens, "positions": positions}, labels)
    assert inputs is tokens and got_labels is labels and trainer.ntokens_seen == labels.numel()
    assert isinstance(extra["attention_masks"], maskc.PositionMask) and extra["attention_masks"].position_ids is positions
    ids = torch.zeros_like(tokens)
    _, _, extra = trainer.post_dataloading_process({"input": tokens, "positions": positions, tt.DOCUMENT_IDS: ids}, labels)
    assert set(extra) == {"positions", "attention_masks"}
    assert extra["attention_masks"].shape == (tokens.numel(), tokens.numel())
    prepared = tt.plan_batch(tokens, 2, 0, None, positions)
    with pytest.raises(tt.TorchtitanAttentionError, match="cp_plan entry, but context parallelism is off"):
        trainer.post_dataloading_process({"input": tokens, "positions": positions, tt.CP_PLAN: prepared}, labels)


# ---- context parallelism: gloo, several processes -------------------------------------------------


def _loss(logits: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
    """torchtitan's loss: summed cross-entropy over the rank's tokens / the batch's token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100, reduction="sum") / tokens


def _cp_worker(rank: int, world: int, port: int, fsdp: bool, ahead: bool, errors: mp.Queue) -> None:
    """Every rank holds the whole batch; one process's loss and gradients first, then the cp
    ranks' (dispatch_batch, maskc.dist attention in every layer), whose gradients are summed
    (by FSDP2's reduce-scatter, or an all-reduce without it). `ahead`: the batch comes with its
    plan for the rank (plan_batch, as a data loader's worker makes it, pickled across) through
    MaskcTrainer.post_dataloading_process, and the step plans nothing."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        tokens, labels, positions = batch()
        reference = tiny_llama()
        want_logits = reference(tokens, positions=positions, attention_masks=tt.document_mask(tokens, positions))
        want = _loss(want_logits, labels, labels.numel())
        want.backward()

        model, group = tiny_llama(), dist.group.WORLD
        if fsdp:  # tt.parallelize on torchtitan's meshes: FSDP2 over the cp ranks ("fsdp" = dp_shard x cp)
            import torchtitan.distributed.parallel_dims as parallel_dims_module
            from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

            parallel_dims_module.device_type = "cpu"  # torchtitan 0.3.0 takes "cuda" where no accelerator is found
            parallelism = ParallelismConfig(context_parallel_degree=world, spmd_backend="partial_dtensor")
            dims = parallel_dims_module.ParallelDims.from_config(parallelism, world)
            training = TrainingConfig(mixed_precision_param="float32")
            tt.parallelize(model, parallel_dims=dims, training=training, parallelism=parallelism,
                           compile_config=CompileConfig(), ac_config=None, dump_folder="")  # fmt: skip
            group = dims.get_mesh("cp").get_group()
        if ahead:
            prepared = pickle.loads(pickle.dumps(tt.plan_batch(tokens, world, dist.get_rank(group), None, positions)))
            trainer = tt.MaskcTrainer.__new__(tt.MaskcTrainer)  # its __init__ needs an accelerator (torchtitan 0.3.0)
            mesh = types.SimpleNamespace(get_group=lambda: group)
            trainer.parallel_dims = types.SimpleNamespace(cp_enabled=True, get_mesh=lambda name: mesh)
            trainer.ntokens_seen = 0
            with planning_calls() as in_step:
                local_tokens, local_labels, extra = trainer.post_dataloading_process(
                    {"input": tokens, "positions": positions, tt.CP_PLAN: prepared}, labels
                )
                logits = model(local_tokens, **extra)
            assert not in_step, in_step
            assert extra["attention_masks"].plan is prepared and tt.CP_PLAN not in extra
            short = tt.plan_batch(tokens[:, :32], world, dist.get_rank(group), None, positions[:, :32])
            with pytest.raises(tt.TorchtitanAttentionError, match=f"plans 64 tokens over {world} ranks, but the batch has 128"):
                tt.dispatch_batch(tokens, labels, {"positions": positions}, group, prepared=short)
            with pytest.raises(tt.TorchtitanAttentionError, match="must be a maskc.dist.PreparedPlan"):
                tt.dispatch_batch(tokens, labels, {"positions": positions}, group, prepared=prepared.plan)
        else:
            local_tokens, local_labels, extra = tt.dispatch_batch(tokens, labels, {"positions": positions}, group)
            logits = model(local_tokens, **extra)
        loss = _loss(logits, local_labels, labels.numel())
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        close(total, want.detach())
        close(extra["attention_masks"].undispatch(logits), want_logits)
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if fsdp else p.grad
            if not fsdp:
                dist.all_reduce(g)
            close(g, reference.get_parameter(name).grad)
        dist.destroy_process_group()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise


@pytest.mark.slow
@pytest.mark.parametrize("world,fsdp,ahead", [(2, False, False), (4, False, False), (2, True, False), (4, True, False),
                                              (2, False, True)])  # fmt: skip
def test_context_parallel_loss_and_gradients_equal_one_process(world: int, fsdp: bool, ahead: bool) -> None:
    run_ranks(_cp_worker, world, fsdp, ahead, timeout=300)
