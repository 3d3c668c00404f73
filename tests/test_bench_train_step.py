"""bench/train_step.py on the CPU: its options, its packed rows and document masks, the check
that keeps an implementation attending across documents out of the timings, its rows; and the
trap it guards against (README.md, Hugging Face Transformers): with packed position_ids and no
mask, Transformers' sdpa and eager attend across documents while a cache is in play."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import record  # noqa: E402
import report  # noqa: E402
import train_step as ts  # noqa: E402
from record import Run, read_results  # noqa: E402

LENGTHS = [100, 150, 50]


def test_options_are_parsed_and_checked(capsys: pytest.CaptureFixture) -> None:
    args = ts.parse_args([])
    assert (args.tokens, args.steps, args.impls, args.compile) == ([32768, 65536, 131072], 10, list(ts.IMPLS), False)
    assert (args.size, args.dtype, args.device, args.out) == (ts.Size(), torch.bfloat16, torch.device("cuda"), record.RESULTS)
    args = ts.parse_args(["--tokens", "1024,2048", "--impls", "sdpa,maskc,sdpa", "--steps", "3", "--compile"])
    assert (args.tokens, args.impls, args.steps, args.compile) == ([1024, 2048], ["maskc", "sdpa"], 3, True)
    tiny = ts.parse_args(["--tiny", "--device", "cpu"])
    assert (tiny.size, tiny.dtype) == (ts.TINY, torch.float32)
    for argv, message in ((["--impls", "maskc,fa3"], "unknown implementation 'fa3'"),
                          (["--tokens", "1k"], "comma-separated integers"),
                          (["--tokens", "0"], "at least one token"),
                          (["--device", "cpu"], "--device cpu needs --tiny")):  # fmt: skip
        with pytest.raises(SystemExit):
            ts.parse_args(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        ts.parse_args(["--help"])
    assert done.value.code == 0 and "bench/README.md" in capsys.readouterr().out


def test_a_packed_row_restarts_its_positions_at_every_document() -> None:
    row = ts.packed_row(4096, 1000, "cpu")
    assert row.tokens == int(row.lengths.sum()) == 4096 and len(row.lengths) > 2 and row.lengths.max() <= 4096 // 4
    starts = torch.cumsum(torch.as_tensor(row.lengths), 0) - torch.as_tensor(row.lengths)
    assert torch.equal(row.position_ids[0], torch.cat([torch.arange(n) for n in row.lengths.tolist()]))
    assert torch.equal(torch.nonzero(row.position_ids[0] == 0)[:, 0], starts)
    assert torch.equal(torch.bincount(row.document_ids), torch.as_tensor(row.lengths))
    assert 0 <= int(row.input_ids.min()) and int(row.input_ids.max()) < 1000
    again = ts.packed_row(4096, 1000, "cpu")
    assert torch.equal(again.input_ids, row.input_ids) and torch.equal(again.position_ids, row.position_ids)


def test_the_document_masks_agree() -> None:
    """SDPA's dense mask is the BlockMask's mask_mod on every pair, and the BlockMask keeps the
    blocks that hold a pair of it; both are causal within each document."""
    row = ts.row_of(LENGTHS, 61, "cpu")
    dense = ts.dense_mask(row.document_ids)
    assert dense.shape == (1, 1, 300, 300) and dense.dtype == torch.bool
    expected = torch.block_diag(*(torch.ones(n, n, dtype=torch.bool).tril() for n in LENGTHS))
    assert torch.equal(dense[0, 0], expected)
    blocks = ts.block_mask(row.document_ids, compiled=False)
    i = torch.arange(300)
    assert torch.equal(blocks.mask_mod(torch.tensor(0), torch.tensor(0), i[:, None], i[None, :]), expected)
    size = blocks.BLOCK_SIZE[0]
    n = -(-300 // size)
    padded = torch.zeros(n * size, n * size, dtype=torch.bool)
    padded[:300, :300] = expected
    assert torch.equal(blocks.to_dense()[0, 0].bool(), padded.reshape(n, size, n, size).any(3).any(1))


def test_each_implementation_gets_the_documents_its_way() -> None:
    row = ts.row_of(LENGTHS, 61, "cpu")
    for impl in ("maskc", "flash_attention_4", "flash_attention_2"):
        inputs = ts.batch(impl, row)
        assert inputs["use_cache"] is False and "attention_mask" not in inputs
        assert inputs["labels"] is row.input_ids and inputs["position_ids"] is row.position_ids
    assert ts.batch("maskc", row).keys() == {"input_ids", "position_ids", "labels", "use_cache"}
    # FlashAttention gets the boundaries as Transformers' flattening collator makes them: FA4's
    # varlen call refuses a tensor for the longest document
    flash = ts.batch("flash_attention_4", row)
    assert flash["cu_seq_lens_q"].tolist() == flash["cu_seq_lens_k"].tolist() == [0, 100, 250, sum(LENGTHS)]
    assert flash["cu_seq_lens_q"].dtype == torch.int32
    assert type(flash["max_length_q"]) is int and flash["max_length_q"] == flash["max_length_k"] == max(LENGTHS)
    assert torch.equal(ts.batch("sdpa", row)["attention_mask"], ts.dense_mask(row.document_ids))


@pytest.mark.slow
def test_the_compiled_block_mask_is_the_uncompiled_one() -> None:
    row = ts.row_of(LENGTHS, 61, "cpu")
    compiled, plain = ts.block_mask(row.document_ids), ts.block_mask(row.document_ids, compiled=False)
    assert torch.equal(compiled.to_dense(), plain.to_dense())


def test_the_check_tolerates_rounding_not_other_attention() -> None:
    hidden = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    maskc = ts.FirstForward(10.4, hidden)
    assert ts.compare(ts.FirstForward(10.401, hidden * 1.01), None) == {"loss": 10.401}
    checked = ts.compare(ts.FirstForward(10.401, hidden * 1.01), maskc)
    assert checked["loss_diff"] == pytest.approx(1e-3, rel=1e-5) and checked["hidden_diff"] == pytest.approx(1e-2, rel=1e-5)
    with pytest.raises(ts.DocumentMismatch, match=r"loss 10.4200 against maskc's 10.4000 \(at most 0.005 apart\)"):
        ts.compare(ts.FirstForward(10.42, hidden), maskc)
    with pytest.raises(ts.DocumentMismatch, match=r"last hidden states 1.000 apart \(at most 0.5\)"):
        ts.compare(ts.FirstForward(10.4, hidden * 2), maskc)


def _named(impl: str) -> torch.nn.Module:
    """A stand-in model that says which implementation it is."""
    model = torch.nn.Linear(1, 1)
    model.impl = impl
    return model


def test_an_implementation_differing_from_maskc_records_an_error_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With fake first forwards and timings: the one that differs gets an error row with its
    numbers and is not timed; the others' rows carry how close they came. Where maskc cannot run,
    the others go unchecked."""
    hidden = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    firsts = {"maskc": ts.FirstForward(10.40, hidden), "sdpa": ts.FirstForward(10.401, hidden * 1.01),
              "flash_attention_2": ts.FirstForward(10.42, -hidden)}  # fmt: skip
    timed = []

    def timed_steps(step: object, steps: int, device: torch.device) -> dict:
        timed.append(steps)
        return {"ms": 250.0, "peak_mib": 4096.0}

    monkeypatch.setattr(ts, "build_model", lambda impl, *rest: _named(impl))
    monkeypatch.setattr(ts, "first_forward", lambda model, inputs: firsts[model.impl])
    monkeypatch.setattr(ts, "timed_steps", timed_steps)
    args = ts.parse_args(["--tiny", "--device", "cpu", "--tokens", "300", "--steps", "4",
                          "--impls", "sdpa,flash_attention_2,maskc", "--out", str(tmp_path)])  # fmt: skip
    run = Run.start("train_step", "NVIDIA H200", tmp_path, argv=["bench/train_step.py"])
    rows = {row["impl"]: row for row in ts.measure_all(run, args)}
    assert list(rows) == ["maskc", "sdpa", "flash_attention_2"] and timed == [4, 4]
    assert rows["maskc"]["loss"] == 10.40 and "loss_diff" not in rows["maskc"]
    assert rows["sdpa"]["tokens_per_s"] == 300 / 0.25 and rows["sdpa"]["loss_diff"] == pytest.approx(1e-3, rel=1e-5)
    assert rows["flash_attention_2"]["error"] == (
        "DocumentMismatch: attends across documents? loss 10.4200 against maskc's 10.4000 (at most 0.005 apart), "
        "last hidden states 2.000 apart (at most 0.5)"
    )
    assert "ms" not in rows["flash_attention_2"]
    assert read_results(tmp_path) == list(rows.values())
    for row in rows.values():
        record.validate(row)
    assert "| 300 | 5 | 1,200/s, 250 ms, 4.0 GiB | failed | 1,200/s, 250 ms, 4.0 GiB |" in report.train_table(list(rows.values()))

    def no_maskc(impl: str, *rest: object) -> torch.nn.Module:
        if impl == "maskc":
            raise RuntimeError("no kernel")
        return _named(impl)

    monkeypatch.setattr(ts, "build_model", no_maskc)
    rows = {row["impl"]: row for row in ts.measure_all(run, args)}
    assert rows["maskc"]["error"] == "RuntimeError: no kernel"
    assert rows["flash_attention_2"]["loss"] == 10.42 and "loss_diff" not in rows["flash_attention_2"]



def test_the_benchmark_runs_a_tiny_model_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole run on a tiny model: maskc (its reference attention on the CPU) and SDPA with the
    dense document mask agree, FlashAttention without its package is an error row, and the page
    shows the run."""
    argv = ["--tiny", "--device", "cpu", "--tokens", "300", "--steps", "1", "--impls", "sdpa,maskc,flash_attention_4",
            "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["bench/train_step.py", *argv])
    runpy.run_path(str(BENCH / "train_step.py"), run_name="__main__")
    rows = {row["impl"]: row for row in read_results(tmp_path)}
    assert {row["kind"] for row in rows.values()} == {"train"} and {row["bench"] for row in rows.values()} == {"train_step"}
    assert rows["sdpa"]["loss_diff"] < 1e-5 and rows["sdpa"]["hidden_diff"] < 1e-5 and rows["sdpa"]["ms"] > 0
    assert rows["flash_attention_4"]["error"].startswith("ImportError: flash_attention_4 needs the flash-attn-4 package")
    assert rows["maskc"]["command"] == f"python bench/train_step.py {' '.join(argv)}"
    for page in report.render_pages(list(rows.values())).values():
        assert "## Training steps in Hugging Face Transformers" in page and "| 300 | 5 |" in page


def test_packed_position_ids_without_a_mask_attend_across_documents() -> None:
    """The trap: with a cache in play (use_cache's default, in training too) Transformers reads
    no documents from position_ids, so sdpa and eager attend across the row; a document mask, or
    use_cache=False (Transformers then builds one), keeps each document alone, as maskc does
    from position_ids alone."""
    config = ts.llama_config(ts.TINY, 512)
    row = ts.row_of(LENGTHS, ts.TINY.vocab, "cpu")
    weights = ts.initial_weights(config, torch.device("cpu"), torch.float32)
    dense = ts.dense_mask(row.document_ids)
    # eager adds its mask to the scores: 0 where a pair attends, the float minimum where not
    masks = {"sdpa": dense, "eager": torch.zeros(dense.shape).masked_fill_(~dense, torch.finfo(torch.float32).min),
             "maskc": None}  # fmt: skip
    ids, positions = row.input_ids, row.position_ids
    starts = [0, 100, 250]
    for impl, mask in masks.items():
        model = ts.build_model(impl, config, weights, torch.device("cpu"), torch.float32).eval()
        with torch.no_grad():
            alone = torch.cat([model(ids[:, s : s + n]).logits for s, n in zip(starts, LENGTHS)], dim=1)
            leaky = model(ids, position_ids=positions).logits
            masked = model(ids, position_ids=positions, attention_mask=mask).logits
            uncached = model(ids, position_ids=positions, use_cache=False).logits
        assert (masked - alone).abs().max() < 1e-5 and (uncached - alone).abs().max() < 1e-5
        first = slice(0, LENGTHS[0])  # the first document has nothing before it to attend to
        assert (leaky[:, first] - alone[:, first]).abs().max() < 1e-5
        if impl == "maskc":
            assert (leaky - alone).abs().max() < 1e-5
        else:
            assert (leaky - alone).abs().max() > 0.1, impl
