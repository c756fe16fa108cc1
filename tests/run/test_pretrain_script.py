"""The main job for real: `accelerate launch` with 2 processes runs scripts/pretrain.py.

Its per-step losses are compared with a committed baseline (tests/assets), so a change that alters
the numerics of the model, the engine or the data pipeline shows up here; a run stopped at a
checkpoint and resumed continues with exactly the same losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import REPO
from tnlg import TNLGForCausalLM

BASELINE = REPO / "tests" / "assets" / "pretrain_debug_losses.json"
STEPS = 8


def launch_command(output: Path, launch_flags: list[str], *overrides: str, processes: int = 2) -> list[str]:
    # One CPU process is --cpu; several are --multi_gpu (Accelerate's --cpu starts only one).
    spread = (
        ["--multi_gpu", "--num_processes", str(processes)]
        if processes > 1
        else ["--cpu", "--num_processes", "1"]
    )
    return [
        sys.executable, "-m", "accelerate.commands.launch", *spread,
        "--mixed_precision", "no", "--dynamo_backend", "no", *launch_flags,
        str(REPO / "scripts" / "pretrain.py"),
        "--train.max_steps", str(STEPS), "--train.eval_every", "4", "--train.save_every", "4",
        "--train.output_dir", str(output), *overrides,
    ]  # fmt: skip


def launch(output: Path, cache: Path, *overrides: str) -> list[float]:
    return launched(output, cache, *overrides)[0]


def launched(output: Path, cache: Path, *overrides: str) -> tuple[list[float], str]:
    """The run's losses and what its processes wrote to stderr (the log)."""
    environment = {**os.environ, "TNLG_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    command = launch_command(output, ["--num_machines", "1"], *overrides)
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((output / "loss_curve.json").read_text())["losses"], result.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache):
    output = tmp_path_factory.mktemp("run")
    return output, launch(output, cache)


@pytest.mark.slow
def test_losses_match_the_committed_baseline(run):
    _, losses = run
    baseline = json.loads(BASELINE.read_text())
    assert losses == pytest.approx(baseline["losses"], rel=1e-4)
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_an_offloaded_run_matches_the_same_baseline(cache, tmp_path):
    """ZeRO-Offload selected from the run config: master weights and AdamW state on the CPU, the step
    in CPUAdam; the losses are the committed (non-offloaded) baseline's."""
    losses = launch(tmp_path / "offload", cache, "--zero.offload_optimizer", "cpu", "--train.save_every", "0")
    assert losses == pytest.approx(json.loads(BASELINE.read_text())["losses"], rel=1e-4)


@pytest.mark.slow
def test_the_run_leaves_a_loadable_model_a_curve_and_checkpoints(run):
    output, _ = run
    model = TNLGForCausalLM.from_pretrained(output / "model")
    assert model.config.vocab_size == 2048
    assert (output / "model" / "tokenizer.json").is_file()
    assert (output / "loss_curve.png").stat().st_size > 1000
    assert json.loads((output / "checkpoints" / "latest").read_text()) == {"checkpoint": "step-00000008"}


@pytest.mark.slow
def test_a_run_starts_from_a_saved_model_read_shard_by_shard(run, cache, tmp_path):
    """model.init_from at stage 3: with a learning rate of 0 the model saved at the end must be the
    starting checkpoint exactly, and the first loss is the trained model's, well below a fresh one's."""
    output, losses = run
    started = launch(
        tmp_path, cache, "--model.init_from", str(output / "model"), "--zero.stage", "3",
        "--optimizer.lr", "0", "--train.max_steps", "2",
    )  # fmt: skip
    assert started[0] < losses[0] - 0.3  # 8 steps took the loss from about 7.7 to 7.0
    saved = TNLGForCausalLM.from_pretrained(output / "model").state_dict()
    again = TNLGForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    assert saved.keys() == again.keys()
    for name, tensor in saved.items():
        assert torch.equal(again[name], tensor), name


@pytest.mark.slow
def test_a_run_with_export_gpt2_leaves_a_gpt2_twin_of_its_model(cache, tmp_path):
    """train.export_gpt2: model-gpt2/ is a plain GPT2LMHeadModel computing what model/ computes."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    launch(
        tmp_path, cache, "--train.max_steps", "2", "--train.save_every", "0", "--train.export_gpt2", "true"
    )
    model = TNLGForCausalLM.from_pretrained(tmp_path / "model").eval()
    gpt2 = GPT2LMHeadModel.from_pretrained(tmp_path / "model-gpt2").eval()
    ids = AutoTokenizer.from_pretrained(tmp_path / "model-gpt2")("The pile is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (model(ids).logits - gpt2(ids).logits).abs().max().item() <= 1e-5
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **settings), gpt2.generate(ids, **settings))


@pytest.mark.slow
def test_a_resumed_run_continues_with_the_same_losses(run, cache, tmp_path):
    _, losses = run
    launch(tmp_path, cache, "--train.max_steps", "4")
    # A resume may give the collectives another timeout: the launch's process group, made by Accelerate
    # from the run's setting, has it (read back from the group and logged; gloo's default is 30 minutes).
    resumed, log = launched(tmp_path, cache, "--resume", "latest", "--train.collective_timeout_minutes", "7")
    assert resumed == pytest.approx(losses, rel=1e-6)  # the curve covers the whole run, steps 1-4 restored
    assert log.count("a collective waits up to 7 minutes on every process group") == 2  # each rank


@pytest.mark.slow
def test_two_single_process_nodes_train_like_one_two_process_launch(run, tmp_path, cache):
    """The multi-node path on one machine: two launches as two "nodes" (c10d rendezvous on
    127.0.0.1, one process each) give the single-launch 2-process baseline's losses."""
    from tnlg.tools.spawn import free_port

    port = free_port()
    environment = {**os.environ, "TNLG_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    nodes, logs = [], []
    try:
        for node in (0, 1):
            node_flags = [
                "--num_machines",
                "2",
                "--machine_rank",
                str(node),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                "--rdzv_backend",
                "c10d",
            ]
            # Output goes to files: a pipe nobody reads while waiting for the other node could fill and block.
            log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 (closed below, once the node exits)
            command = launch_command(tmp_path / "run", node_flags)
            nodes.append(
                subprocess.Popen(command, cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT)
            )
            logs.append(log)
            if node == 0:
                # On one machine both nodes look local to the c10d rendezvous, and whichever binds the
                # port first hosts it: let node 0 (the one Accelerate expects to host) bind it first.
                _wait_for_listener(port, nodes[0])
        for node in nodes:
            node.wait(timeout=300)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        for log in logs:
            log.close()
    for node, log in zip(nodes, logs, strict=True):
        assert node.returncode == 0, Path(log.name).read_text()[-3000:]
    losses = json.loads((tmp_path / "run" / "loss_curve.json").read_text())["losses"]
    assert losses == pytest.approx(json.loads(BASELINE.read_text())["losses"], rel=1e-4)


def _wait_for_listener(port: int, process: subprocess.Popen, timeout: float = 120.0) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "node 0 exited before its rendezvous was up"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listened on port {port} within {timeout:.0f}s")


@pytest.mark.slow
def test_the_run_is_recorded_in_tensorboard(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output, losses = run
    events = EventAccumulator(str(output / "logs" / "pretrain-debug"))
    events.Reload()
    logged = events.Scalars("loss")
    assert [e.step for e in logged] == list(range(1, STEPS + 1))
    assert [e.value for e in logged] == pytest.approx(losses, rel=1e-6)
    assert [e.step for e in events.Scalars("eval_perplexity")] == [4, 8]
    assert {"lr", "tokens_per_s", "grad_norm", "memory_mb"} <= set(events.Tags()["scalars"])
