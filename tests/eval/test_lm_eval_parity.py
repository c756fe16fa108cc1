"""tnlg's LAMBADA evaluation against lm-evaluation-harness itself, run in process on the same saved model
through scripts/evaluate.py's harness path: the same context and target strings, the same greedy verdict
and log-likelihood passage for passage, the same accuracy and perplexity (within 1e-4).

The model is the debug preset trained for a few seconds on some of the passages, so that it predicts
their last words and misses the others' (both sides must score some 1s and some 0s, or agreeing would
prove little); its tokenizer is a byte-level BPE trained on the passages, so that words are one token
or several. The passages include a double space and a line break before the last space (whitespace
that moves from the context to the target) and one longer than the model's 128 positions (truncated
from the left)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from tests.support.lm_eval_tasks import TASK_YAML
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.data.tokenizer import train_byte_level_bpe
from tnlg.eval.harness import run_lm_eval, task_manager
from tnlg.eval.lambada import encode_passage, score_passage, split_last_word
from tnlg.eval.suite import evaluate_lambada, evaluate_perplexity
from tnlg.inference.generation import load_model_and_tokenizer

TASK = "lambada_local"
LEARNT = [
    "the keeper of the lighthouse climbed the stairs to light the lamp",
    "she opened the old wooden chest and found a silver key",
    "after the long winter the farmers planted barley",
    "the children ran down to the river to watch the boats",
    "he poured the tea and passed her the cup with a\nsmile",  # the last "word" is "a\nsmile"
    "at dawn the fishermen pulled in their  nets",  # a double space: one space moves to the target
]
PASSAGES = [
    *LEARNT,
    "the keeper of the lighthouse climbed the stairs to light the candle",  # contexts learnt, words not
    "she opened the old wooden chest and found a golden crown",
    "after the long winter the farmers planted potatoes",
    "the children ran down to the river to watch the\n swans",  # the line break moves to the target
    " ".join(["the boats came home"] * 40) + " at last",  # longer than the 128 positions
]


@pytest.fixture(scope="module")
def lm_eval():
    return pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness (pip install lm-eval)")


@pytest.fixture(scope="module")
def files(lm_eval, tmp_path_factory):
    """(model directory, passages jsonl, task directory): a trained debug model saved with its tokenizer."""
    root = tmp_path_factory.mktemp("lm-eval-parity")
    tokenizer = train_byte_level_bpe(PASSAGES * 4, vocab_size=320)
    torch.manual_seed(0)
    config = TNLGConfig.from_preset(
        "debug", bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    model = TNLGForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [torch.tensor([tokenizer(text)["input_ids"]]) for text in LEARNT]
    for _ in range(40):
        loss = sum(model(input_ids=ids, labels=ids).loss for ids in batches)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    data = root / "passages.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in PASSAGES))
    (root / "tasks").mkdir()
    (root / "tasks" / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data, cache=root / "cache"))
    return root / "model", data, root / "tasks"


def test_lambada_scores_equal_lm_eval_passage_for_passage(files):
    model_dir, data, tasks = files
    model, tokenizer = load_model_and_tokenizer(model_dir)
    positions = model.config.max_position_embeddings
    ours = [score_passage(model, *encode_passage(tokenizer, p), max_length=positions) for p in PASSAGES]
    output = run_lm_eval(model, tokenizer, task_manager([TASK], tasks), [TASK], log_samples=True)
    samples = sorted(output["samples"][TASK], key=lambda sample: sample["doc_id"])
    assert [sample["doc"]["text"] for sample in samples] == PASSAGES
    for passage, score, sample in zip(PASSAGES, ours, samples, strict=True):
        assert tuple(sample["arguments"][0]) == split_last_word(passage)  # the same strings
        assert score.greedy == bool(sample["acc"]), passage
        assert score.loglikelihood == pytest.approx(sample["perplexity"], rel=1e-6, abs=1e-5), passage
    greedy = [score.greedy for score in ours]
    assert any(greedy) and not all(greedy), greedy  # some last words predicted, some not

    whole = evaluate_lambada(model, tokenizer, data, max_length=positions)
    metrics = output["results"][TASK]
    assert whole["total"] == len(PASSAGES)
    assert whole["accuracy"] / 100 == pytest.approx(metrics["acc,none"], abs=1e-12)
    assert whole["perplexity"] == pytest.approx(metrics["perplexity,none"], rel=1e-4)


@pytest.mark.parametrize("max_length", [16, 128])  # many windows, with a short last one; one window
def test_perplexity_scores_every_token_as_lm_eval_rolling_loglikelihood(lm_eval, files, tmp_path, max_length):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model_dir, _, _ = files
    model, tokenizer = load_model_and_tokenizer(model_dir)
    text = "\n\n".join(PASSAGES[:4])
    path = tmp_path / "text.txt"
    path.write_text(text)
    ours = evaluate_perplexity(model, tokenizer, path, max_length=max_length, stride=None)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", max_length=max_length)
    request = Instance("loglikelihood_rolling", {}, (text,), 0)
    (loglikelihood,) = lm.loglikelihood_rolling([request], disable_tqdm=True)
    assert ours["tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])  # every one
    assert ours["nll_per_token"] * ours["tokens"] == pytest.approx(-loglikelihood, rel=1e-5)
    # lm-eval's bits_per_byte (wikitext): the same log-likelihood over the text's UTF-8 bytes
    assert ours["bits_per_byte"] == pytest.approx(-loglikelihood / math.log(2) / len(text.encode()), rel=1e-5)


def test_evaluate_script_runs_lm_eval_beside_its_own_lambada(lm_eval, files, capsys):
    from scripts.evaluate import main

    model_dir, data, tasks = files
    arguments = ["--model", str(model_dir), "--lambada", str(data), "--harness", "lm-eval"]
    results = main([*arguments, "--tasks", TASK, "--include-path", str(tasks)])
    ours, theirs = results["lambada:passages.jsonl"], results[f"lm-eval:{TASK}"]
    assert theirs["harness"] == f"lm-eval {lm_eval.__version__}" and theirs["samples"] == len(PASSAGES)
    assert 0 < theirs["acc"] < 1
    assert ours["accuracy"] / 100 == pytest.approx(theirs["acc"], abs=1e-12)
    assert ours["perplexity"] == pytest.approx(theirs["perplexity"], rel=1e-4)
    saved = json.loads((model_dir / "eval_results.json").read_text())
    measured_on = saved[f"lm-eval:{TASK}"].pop("measured_on")
    assert measured_on == theirs.pop("measured_on") == {"num_fewshot": None, "limit": None}
    assert saved[f"lm-eval:{TASK}"] == pytest.approx(theirs) and saved["lambada:passages.jsonl"] == ours
    printed = capsys.readouterr().out
    assert f"lm-eval:{TASK}" in printed and "perplexity" in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--harness lm-eval needs --tasks"),
        (["--tasks", TASK, "--include-path", "{missing}"], "no such directory of task YAML files"),
        (["--tasks", TASK, "--zero-stage", "3"], "runs the whole model in one process"),
    ],
)
def test_bad_harness_arguments_exit_2_naming_the_problem(tmp_path, capsys, extra, message):
    from scripts.evaluate import main

    extra = [argument.format(missing=tmp_path / "missing") for argument in extra]
    with pytest.raises(SystemExit) as stopped:
        main(["--model", "debug", "--harness", "lm-eval", *extra])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_harness_options_without_harness_are_refused(capsys):
    from scripts.evaluate import main

    with pytest.raises(SystemExit) as stopped:
        main(["--model", "debug", "--lambada", "x.jsonl", "--tasks", TASK])
    assert stopped.value.code == 2
    assert "--tasks: only with --harness lm-eval" in capsys.readouterr().err


@pytest.mark.slow  # the full index of lm-eval's ~15,000 built-in task files: about 10 s
def test_an_unknown_task_is_named(files):
    _, _, tasks = files
    with pytest.raises(
        ValueError, match=r"unknown lm-eval task\(s\) no_such_task: not in lm-eval's tasks or those of"
    ):
        task_manager([TASK, "no_such_task"], tasks)


def test_a_missing_lm_eval_is_named_with_the_install_command(monkeypatch, capsys):
    from scripts.evaluate import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an environment without it imports
    with pytest.raises(SystemExit) as stopped:
        main(["--model", "debug", "--harness", "lm-eval", "--tasks", TASK])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "--harness lm-eval needs lm-evaluation-harness" in error and 'pip install "tnlg[eval]"' in error
