"""Tensor slicing of TNLG: the slice arithmetic, the declared plan, tnlg's own application (training)
and Transformers' `from_pretrained(tp_plan="auto")` (inference), each against one process."""

from __future__ import annotations

import pytest
import torch

from tests.support import tensor_parallel_cases as cases
from tnlg.modeling import TNLGConfig, TNLGForCausalLM
from tnlg.modeling.tensor_parallel import TensorSlice, apply_tensor_parallel, declared_plan, plan_slices
from tnlg.tools.spawn import run_distributed

ATOL = 1e-5


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_slices_reassemble_to_the_full_tensor(dim: int, parts: int) -> None:
    full = torch.randn(12, 6) if dim == 0 else torch.randn(6, 12)
    slices = [TensorSlice(dim=dim, parts=parts, degree=2, rank=r) for r in range(2)]
    local = [s.local(full) for s in slices]
    assert all(t.is_contiguous() and t.shape[dim] == 6 for t in local)
    assert slices[0].full_shape(local[0].shape) == tuple(full.shape)
    torch.testing.assert_close(slices[0].assemble(local), full, rtol=0, atol=0)


def test_packed_slice_takes_the_same_heads_of_q_k_and_v() -> None:
    rows = torch.arange(12.0)  # [q0 q1 q2 q3 | k0 .. | v0 ..], 4 heads of width 1
    assert TensorSlice(dim=0, parts=3, degree=2, rank=1).local(rows).tolist() == [2, 3, 6, 7, 10, 11]


def test_slice_refuses_a_size_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="does not split"):
        TensorSlice(dim=0, parts=3, degree=2, rank=0).local(torch.zeros(9))


def test_head_count_error_lists_the_valid_degrees() -> None:
    config = TNLGConfig.from_preset("tnlg-17b")
    with pytest.raises(ValueError, match="valid degrees are 1, 2, 4, 7, 14, 28"):
        config.check_tensor_parallel(8)
    config.check_tensor_parallel(4)  # T-NLG's own layout


def test_vocab_error_names_the_padding() -> None:
    with pytest.raises(ValueError, match=r"pad the vocabulary .* 50432"):
        TNLGConfig(vocab_size=50257).check_tensor_parallel(2)


def test_plan_names_modules_that_exist() -> None:
    model = TNLGForCausalLM(cases.make_config())
    plan = declared_plan(model)
    assert plan["model.layers.*.self_attn.qkv_proj"] == "packed_colwise_qkv"
    assert plan["lm_head"] == "colwise_gather_output"
    names = {n for n, _ in model.named_modules()}
    for pattern in plan:
        assert pattern.replace("*", "0") in names, pattern
    assert "base_model_tp_plan" not in model.config.to_dict()  # a class attribute, never saved


def _assemble(results: list[dict], key: str, name: str) -> torch.Tensor:
    slices = results[0]["slices"]
    if name not in slices:  # replicated: identical on every rank
        for other in results[1:]:
            torch.testing.assert_close(other[key][name], results[0][key][name], rtol=0, atol=0)
        return results[0][key][name]
    dim, parts, degree, _ = slices[name]
    return TensorSlice(dim, parts, degree, 0).assemble([r[key][name] for r in results])


@pytest.mark.slow
def test_two_ranks_train_like_one() -> None:
    results = run_distributed(cases.train_case, 2, timeout=180)
    first = results[0]
    assert first["same_params"] and first["recorded"]
    assert "already" in first["twice"]
    assert first["slices"]["model.layers.0.self_attn.qkv_proj.bias"][:2] == (0, 3)
    assert first["slices"]["model.layers.0.mlp.fc_out.weight"][:2] == (1, 1)
    assert "model.layers.0.mlp.fc_out.bias" not in first["slices"]  # row-parallel bias: replicated
    assert first["logits_with_labels"] is None  # the vocabulary-parallel loss never gathers them
    for r in results:
        torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=0, atol=ATOL)
        torch.testing.assert_close(r["counted"], r["ref_counted"], rtol=0, atol=ATOL)
        torch.testing.assert_close(r["stepped"], r["ref_stepped"], rtol=0, atol=ATOL)
        torch.testing.assert_close(r["logits"], r["ref_logits"], rtol=0, atol=ATOL)
        assert r["generated"].tolist() == r["ref_generated"].tolist()
    assert first["shapes"]["model.embed_tokens.weight"] == (cases.VOCAB // 2, 32)
    _assert_grads_match(results)
    _assert_grads_match(results, "logit_grads", "ref_logit_grads")


@pytest.mark.slow
def test_apply_refuses_a_degree_that_cuts_heads() -> None:
    messages = run_distributed(cases.apply_error_case, 2, 24, 3, timeout=120)
    assert all("valid degrees are 1, 3" in m for m in messages)


def _assert_grads_match(results: list[dict], key: str = "grads", ref_key: str = "ref_grads") -> None:
    first = results[0]
    assert set(first[key]) == set(first[ref_key])
    for name in first[key]:
        full = _assemble(results, key, name)
        torch.testing.assert_close(full, first[ref_key][name], rtol=0, atol=ATOL, msg=f"{key} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("seed_by_rank", [False, True])
def test_dropout_under_slicing(seed_by_rank: bool) -> None:
    """Embedding and residual dropout (replicated regions) draw from the default generator, alike on
    every tensor rank: from the same seed the cut model drops exactly what one process drops. The
    attention dropout (sliced: each rank its own heads) draws from a stream of its own per rank."""
    results = run_distributed(cases.dropout_rates_case, 2, seed_by_rank, timeout=180)
    if seed_by_rank:  # replicated activations would differ across ranks: refused
        assert all("same state on every rank" in r["residual"]["error"] for r in results)
        return
    residual = [r["residual"] for r in results]
    for r in residual:
        torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=0, atol=ATOL)
    _assert_grads_match(residual)
    attention = [r["attention"] for r in results]
    torch.testing.assert_close(attention[0]["after"], attention[1]["after"], rtol=0, atol=0)
    assert not torch.equal(attention[0]["sliced"], attention[1]["sliced"])
    assert torch.isfinite(attention[0]["loss"])
    # replicated parameters got identical gradients on both ranks (_assemble checks it) even though
    # each rank dropped its own heads' attention probabilities
    for name in attention[0]["grads"]:
        _assemble(attention, "grads", name)
    assert attention[0]["loss"] != attention[0]["ref_loss"]  # the masks of sliced heads are not one process's


def test_from_pretrained_refuses_a_degree_that_cuts_heads(tmp_path) -> None:
    cases.make_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="valid degrees are 1, 2, 4"):
        TNLGForCausalLM.from_pretrained(tmp_path, tp_plan="auto", tp_size=3)


@pytest.mark.slow
def test_from_pretrained_tp_plan_auto_matches_one_process(tmp_path) -> None:
    cases.make_model().save_pretrained(tmp_path)
    reference = TNLGForCausalLM.from_pretrained(tmp_path).eval()
    ids, labels = cases.batch()
    with torch.no_grad():
        expected = reference(ids, labels=labels)
    generated = reference.generate(ids[:1, :6], max_new_tokens=6, do_sample=False, pad_token_id=0)
    for result in run_distributed(cases.pretrained_case, 2, str(tmp_path), timeout=180):
        torch.testing.assert_close(result["logits"], expected.logits, rtol=0, atol=ATOL)
        torch.testing.assert_close(result["loss"], expected.loss, rtol=0, atol=ATOL)
        assert result["generated"].tolist() == generated.tolist()
        assert result["local_rows"] == [3 * 32 // 2] * 2  # each rank holds half of q, k and v


@pytest.mark.slow
def test_activation_checkpointing_recomputes_the_same_masks() -> None:
    for result in run_distributed(cases.checkpointed_dropout_case, 2, timeout=120):
        torch.testing.assert_close(result["losses"][0], result["losses"][1], rtol=0, atol=0)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(result["checkpointed"][name], grad, rtol=0, atol=ATOL, msg=name)


def test_apply_refuses_a_module_without_a_plan() -> None:
    with pytest.raises(ValueError, match="no module of this model matches"):
        apply_tensor_parallel(torch.nn.Linear(4, 4), group=None)


@pytest.mark.slow
def test_ids_and_labels_outside_the_vocabulary_raise_as_unsliced() -> None:
    """The unsliced embedding and cross-entropy raise on an id or a label outside [0, vocab) (other than
    the ignored -100); so do the cut ones, eager and compiled whole, instead of a zero vector and a
    silent loss on the wrong logit."""
    reference = cases.make_model()
    for bad in (cases.VOCAB, -1):
        with pytest.raises(IndexError):
            reference(torch.tensor([[1, 2, bad, 4]]))
        with pytest.raises((IndexError, RuntimeError)):
            reference(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, bad, 4]]))
    for result in run_distributed(cases.out_of_range_case, 2, timeout=180):
        eager_loss, compiled_loss, eager_embed, compiled_embed = result.pop("valid")
        assert len(result) == 10  # ids and labels 64 and -1: eager and compiled (and labels via the model)
        for case, message in result.items():
            assert f"outside the vocabulary of {cases.VOCAB}" in message, (case, message)
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=ATOL)
        torch.testing.assert_close(compiled_embed, eager_embed, rtol=0, atol=0)


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def test_a_tied_embedding_the_plan_leaves_whole_is_refused() -> None:
    # Llama declares only its head: tied, the embedding kept the head's half-height rows and looked ids up
    # in them as if they were the whole vocabulary (wrong losses, or an IndexError mid-forward).
    message = "model.embed_tokens.weight is the parameter the plan cuts for 'lm_head'"
    with pytest.raises(ValueError, match=message):
        plan_slices(_llama(tied=True), 2)
    assert "lm_head.weight" in plan_slices(_llama(tied=False), 2)  # untied: the head alone is cut


@pytest.mark.slow
def test_attention_heads_that_do_not_divide_are_refused_before_cutting() -> None:
    for message in run_distributed(cases.transformers_heads_case, 2, timeout=120):
        assert "num_key_value_heads = 1 does not divide into 2 tensor slices" in message
