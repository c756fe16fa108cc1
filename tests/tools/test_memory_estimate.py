"""The ZeRO memory estimator: the paper's formulas, offload placement, activations, the CLI."""

from __future__ import annotations

import math

import pytest

from tests.support import REPO
from tnlg.modeling import TNLGConfig
from tnlg.modeling.pipeline import stage_layers
from tnlg.sharding import ZeroConfig
from tnlg.tools.memory import (
    GB,
    _layer_tensor_sizes,
    _root_tensor_sizes,
    activation_bytes,
    estimate_memory,
    format_table,
    model_state_estimate,
    parse_bytes,
    smallest_world_size,
    tensor_rank_parameters,
)


@pytest.fixture(scope="module")
def tnlg_17b() -> TNLGConfig:
    return TNLGConfig.from_preset("tnlg-17b")


def paper_bytes(psi: int, n: int, stage: int) -> int:
    """The ZeRO paper's per-rank model states (section 5), with K = 12 and ceil(Ψ/N) elements a shard."""
    shard = math.ceil(psi / n)
    return {0: 16 * psi, 1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}[stage]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 8, 64, 512])
def test_model_states_match_the_paper_for_a_preset(tnlg_17b, stage, world_size):
    estimate = estimate_memory(tnlg_17b, world_size=world_size, stage=stage)
    psi = tnlg_17b.num_parameters()
    assert estimate.num_parameters == psi
    assert estimate.model_states == paper_bytes(psi, world_size, stage)


def test_the_papers_7_5b_example():
    # ZeRO paper, figure 1: Ψ = 7.5B, N = 64, K = 12.
    figures = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, expected_gb in figures.items():
        estimate = model_state_estimate(7_500_000_000, world_size=64, stage=stage)
        assert round(estimate.model_states / GB, 1) == expected_gb


def test_full_precision_keeps_a_separate_master_copy():
    psi, n = 1_000_000, 8
    per_element = {0: 4 + 4 + 4 + 8, 3: (4 + 4 + 4 + 8) / n}
    for stage, factor in per_element.items():
        estimate = model_state_estimate(psi, world_size=n, stage=stage, mixed_precision="no")
        assert estimate.model_states == factor * psi
    stage2 = model_state_estimate(psi, world_size=n, stage=2, mixed_precision="no")
    assert (stage2.params, stage2.grads, stage2.master) == (4 * psi, 4 * psi // n, 4 * psi // n)


def test_offload_moves_bytes_to_cpu(tnlg_17b):
    base = estimate_memory(tnlg_17b, world_size=8, stage=3)
    optimizer_off = estimate_memory(tnlg_17b, world_size=8, stage=3, offload_optimizer="cpu")
    both_off = estimate_memory(tnlg_17b, world_size=8, stage=3, offload_optimizer="cpu", offload_param="cpu")
    assert base.cpu_bytes == 0
    # the engine's placement: master, Adam's moments and the gradient shard (fp32 on the host, where
    # the 16-bit device shard held 2 bytes) move; Adam's step keeps a bf16 copy of the shard there
    shard = math.ceil(tnlg_17b.num_parameters() / 8)
    assert optimizer_off.grads == 2 * base.grads == 4 * shard
    assert optimizer_off.offload_copy == 2 * shard
    assert optimizer_off.cpu_bytes == base.master + base.optimizer_state + 4 * shard + 2 * shard
    # with the parameters offloaded too, the step writes the host parameter shard itself: no copy
    assert both_off.offload_copy == 0
    assert both_off.cpu_bytes == base.master + base.optimizer_state + 4 * shard + base.params
    assert optimizer_off.device_bytes == base.device_bytes - base.master - base.optimizer_state - base.grads
    assert both_off.device_bytes == optimizer_off.device_bytes - base.params
    # Stage 1: full gradients stay on the device; the step copies the shard into a host buffer, fp32
    # for SGD (it steps the fp32 master), and SGD writes no 16-bit copy.
    stage1 = estimate_memory(tnlg_17b, world_size=8, stage=1, offload_optimizer="cpu", optimizer="sgd")
    assert stage1.cpu_bytes == stage1.master + stage1.optimizer_state + 4 * shard
    assert stage1.grads == 2 * tnlg_17b.num_parameters() + 4 * shard


@pytest.mark.parametrize(
    ("precision", "optimizer", "step_grad", "copy"),
    [("bf16", "adamw", 2, 2), ("bf16", "sgd", 4, 0), ("no", "adamw", 4, 0), ("no", "sgd", 4, 0)],
)
def test_stage_1_offload_keeps_a_host_buffer_for_the_steps_gradient_shard(
    precision, optimizer, step_grad, copy
):
    # The engine's FlatGroup.host_step_grad: CPUAdam reads the shard in the compute dtype, another
    # optimizer in fp32; only CPUAdam over 16-bit parameters writes a 16-bit host copy.
    psi, n = 1_000_000, 8
    shard = psi // n
    kept = model_state_estimate(psi, world_size=n, stage=1, mixed_precision=precision, optimizer=optimizer)
    offloaded = model_state_estimate(
        psi, world_size=n, stage=1, mixed_precision=precision, optimizer=optimizer, offload_optimizer="cpu"
    )
    assert offloaded.grads == kept.grads + step_grad * shard
    assert offloaded.offload_copy == copy * shard
    assert offloaded.cpu_bytes == kept.master + kept.optimizer_state + (step_grad + copy) * shard
    assert offloaded.device_bytes == kept.device_bytes - kept.master - kept.optimizer_state


@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_offload_writes_no_16bit_copy(stage):
    psi, n = 1_000_000, 8
    estimate = model_state_estimate(
        psi, world_size=n, stage=stage, mixed_precision="no", offload_optimizer="cpu"
    )
    assert estimate.offload_copy == 0
    assert estimate.cpu_bytes == (4 + 4 + 8) * psi // n  # the fp32 gradient shard, master and moments


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_non_increasing_in_world_size(tnlg_17b, stage):
    sizes = [
        estimate_memory(tnlg_17b, world_size=n, stage=stage).device_bytes for n in (1, 2, 8, 64, 512, 4096)
    ]
    assert sizes == sorted(sizes, reverse=True)
    assert (sizes[0] == sizes[-1]) == (stage == 0)  # stage 0 replicates everything


def test_stages_save_memory_in_order(tnlg_17b):
    sizes = [estimate_memory(tnlg_17b, world_size=64, stage=stage).model_states for stage in (0, 1, 2, 3)]
    assert sizes == sorted(sizes, reverse=True)


def test_activation_checkpointing_reduces_activations(tnlg_17b):
    kept = estimate_memory(tnlg_17b, world_size=8, stage=1, activation_checkpointing=True).activations
    full = estimate_memory(tnlg_17b, world_size=8, stage=1, activation_checkpointing=False).activations
    assert 0 < kept < full


def test_activations_follow_korthikanti_eq_1():
    # With dropout on, I = 4h and 16-bit activations a layer keeps exactly 34sbh + 5as²b bytes.
    config = TNLGConfig.from_preset(
        "debug", num_hidden_layers=3, attention_dropout=0.1, hidden_dropout=0.1, embedding_dropout=0.1
    )
    s, b, h, a, v, layers = 128, 2, 64, 4, 512, 3  # the debug shape
    head = 2 * 2 * s * b * h + 4 * s * b * v + s * b * h
    full = activation_bytes(config, micro_batch_size=b, activation_checkpointing=False)
    assert full == layers * (34 * s * b * h + 5 * a * s * s * b) + head
    kept = activation_bytes(config, micro_batch_size=b, activation_checkpointing=True)
    assert kept == layers * 2 * s * b * h + (34 * s * b * h + 5 * a * s * s * b) + head


def test_activations_scale_with_batch_and_dtype(tnlg_17b):
    one = activation_bytes(tnlg_17b, micro_batch_size=1, activation_checkpointing=False)
    assert activation_bytes(tnlg_17b, micro_batch_size=4, activation_checkpointing=False) == 4 * one
    fp32 = activation_bytes(tnlg_17b, compute_bytes=4, activation_checkpointing=False)
    assert one < fp32 < 2 * one  # the fp32 logits and dropout masks do not grow


def test_layer_and_root_sizes_add_up_to_the_parameter_count():
    for name in ("debug", "tnlg-17b", "mt-nlg-530b"):
        for tied in (True, False):
            config = TNLGConfig.from_preset(name, tie_word_embeddings=tied)
            counted = config.num_hidden_layers * sum(_layer_tensor_sizes(config)) + sum(
                _root_tensor_sizes(config)
            )
            assert counted == config.num_parameters()


def test_stage_3_gathers_one_layer_and_the_root(tnlg_17b):
    h, v, p = tnlg_17b.hidden_size, tnlg_17b.vocab_size, tnlg_17b.max_position_embeddings
    estimate = estimate_memory(tnlg_17b, world_size=64, stage=3, param_persistence_threshold=0)
    assert estimate.gathered == 2 * 2 * (sum(_layer_tensor_sizes(tnlg_17b)) + (v + p) * h + 2 * h)
    assert estimate_memory(tnlg_17b, world_size=64, stage=2).gathered == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_smallest_world_size_is_the_first_power_of_two_that_fits(tnlg_17b, stage):
    budget = 80 * GB
    found = smallest_world_size(tnlg_17b, device_memory_bytes=budget, stage=stage)
    assert found is not None and found & (found - 1) == 0
    assert estimate_memory(tnlg_17b, world_size=found, stage=stage).device_bytes <= budget
    if found > 1:
        assert estimate_memory(tnlg_17b, world_size=found // 2, stage=stage).device_bytes > budget


def test_smallest_world_size_none_when_nothing_fits(tnlg_17b):
    assert smallest_world_size(tnlg_17b, device_memory_bytes=80 * GB, stage=0) is None
    assert smallest_world_size(tnlg_17b, device_memory_bytes=1 * GB, stage=3) is None  # activations alone
    fits = smallest_world_size(tnlg_17b, device_memory_bytes=300 * GB, stage=0)
    assert fits == 1


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2.0}, "world_size"),
        ({"stage": 4}, "stage"),
        ({"mixed_precision": "fp8"}, "mixed_precision"),
        ({"offload_optimizer": "nvme"}, "offload_optimizer"),
        ({"stage": 0, "offload_optimizer": "cpu"}, "offload_optimizer"),
        ({"stage": 2, "offload_param": "cpu"}, "offload_param"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"seq_len": 4096}, "seq_len"),
        ({"activation_checkpointing": "yes"}, "activation_checkpointing"),
        ({"optimizer": "lamb"}, "optimizer"),
        ({"param_persistence_threshold": -1}, "param_persistence_threshold"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(tnlg_17b, kwargs, name):
    arguments = {"world_size": 8, "stage": 3, **kwargs}
    with pytest.raises(ValueError, match=name):
        estimate_memory(tnlg_17b, **arguments)


@pytest.mark.parametrize(
    "settings",
    [
        {"stage": 4},
        {"stage": 2.0},
        {"stage": 3, "mixed_precision": "fp8"},
        {"stage": 0, "offload_optimizer": "cpu"},
        {"stage": 2, "offload_param": "cpu"},
        {"stage": 3, "param_persistence_threshold": -1},
    ],
)
def test_zero_settings_are_refused_with_the_engines_own_message(tnlg_17b, settings):
    with pytest.raises(ValueError) as engine:
        ZeroConfig(**settings)
    with pytest.raises(ValueError) as estimator:
        estimate_memory(tnlg_17b, world_size=8, **settings)
    assert str(estimator.value) == str(engine.value)


def test_other_bad_inputs_raise():
    with pytest.raises(ValueError, match="config"):
        estimate_memory({"hidden_size": 8}, world_size=8, stage=3)
    with pytest.raises(ValueError, match="num_parameters"):
        model_state_estimate(0, world_size=8, stage=3)
    with pytest.raises(ValueError, match="device_memory_bytes"):
        smallest_world_size(TNLGConfig.from_preset("debug"), device_memory_bytes=0, stage=3)
    for text in ("80", "80GB", "80 GiB", "1.5tb"):
        assert parse_bytes(text) > 0
    assert parse_bytes("80GiB") == 80 * 2**30
    for text in ("", "GB", "80 parsecs", "-1GB", "0GB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(text)


def test_format_table_has_a_line_per_row(tnlg_17b):
    rows = [estimate_memory(tnlg_17b, world_size=n, stage=3, offload_optimizer="cpu") for n in (8, 64)]
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert "device" in lines[0] and "opt" in lines[2]
    assert f"{rows[0].device_bytes / GB:.2f}" in lines[2]


def test_script_prints_both_presets(capsys):
    from scripts.estimate_memory import main

    main([])
    out = capsys.readouterr().out
    assert "tnlg-17b" in out and "mt-nlg-530b" in out
    assert out.count("stage  ranks") == 2


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--virtual-stages", "2"], "--virtual-stages 2 needs --pipeline-parallel 2 or more"),
        (["--offload-activations", "--no-activation-checkpointing"], "drop --no-activation-checkpointing"),
    ],
)
def test_script_names_flags_that_cannot_go_together(capsys, flags, named):
    # the errors named ParallelDims.virtual_stages and offload_activations, fields the user never typed
    from scripts.estimate_memory import main

    with pytest.raises(SystemExit) as exited:
        main(flags)
    assert exited.value.code == 2 and named in capsys.readouterr().err


def test_script_prints_smallest_world_sizes(capsys):
    from scripts.estimate_memory import main

    main(
        [
            "--preset",
            "tnlg-17b",
            "--stages",
            "1,3",
            "--world-sizes",
            "8",
            "--offload",
            "--device-memory",
            "80GB",
        ]
    )
    out = capsys.readouterr().out
    assert "smallest world size fitting 80.0 GB" in out and "stage 3:" in out
    assert "mt-nlg-530b" not in out


RUN_CONFIGS = REPO / "configs" / "pretrain"


def test_script_takes_a_run_configs_settings(capsys, tmp_path):
    from scripts.estimate_memory import main

    def activations(checkpointing: str) -> float:
        path = tmp_path / f"run-{checkpointing}.yaml"
        path.write_text(
            "model: {preset: tnlg-17b, activation_checkpointing: {enabled: " + checkpointing + "}}\n"
            "data: {seq_len: 512}\nzero: {stage: 3}\ntrain: {micro_batch_size: 2, mixed_precision: bf16}\n"
        )
        main(["--config", str(path), "--world-sizes", "16"])
        out = capsys.readouterr().out
        assert "micro batch 2 x 512 tokens" in out
        assert f"activation checkpointing {'on' if checkpointing == 'true' else 'off'}" in out
        (row,) = [line.split() for line in out.splitlines() if line.split()[:2] == ["3", "16"]]
        return float(row[-3])  # the activations column

    tnlg_17b = TNLGConfig.from_preset("tnlg-17b")
    for checkpointing, flag in (("true", True), ("false", False)):
        expected = activation_bytes(tnlg_17b, micro_batch_size=2, seq_len=512, activation_checkpointing=flag)
        assert activations(checkpointing) == pytest.approx(expected / GB, abs=0.005)


def test_script_estimates_at_the_precision_a_runs_deepspeed_json_enables(capsys, tmp_path):
    # train.mixed_precision "no" takes the JSON's bf16 (as the run does): estimated as a bf16 run, not fp32
    from scripts.estimate_memory import main

    (tmp_path / "ds.json").write_text('{"bf16": {"enabled": true}}')
    runs = {
        "json": "zero: {stage: 3, deepspeed: "
        + str(tmp_path / "ds.json")
        + "}\ntrain: {mixed_precision: 'no'}\n",
        "train": "zero: {stage: 3}\ntrain: {mixed_precision: bf16}\n",
    }
    tables = {}
    for name, settings in runs.items():
        (tmp_path / f"{name}.yaml").write_text("model: {preset: tnlg-1.3b}\n" + settings)
        main(["--config", str(tmp_path / f"{name}.yaml"), "--world-sizes", "8"])
        tables[name] = [line for line in capsys.readouterr().out.splitlines() if str(tmp_path) not in line]
    assert tables["json"] == tables["train"] and any("bf16" in line for line in tables["json"])


def test_script_refuses_a_run_starting_from_another_models_checkpoint(tmp_path):
    # a GPT-2 directory's config.json was read as the default TNLG architecture: figures of another model
    from scripts.estimate_memory import main

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 32}')
    (tmp_path / "run.yaml").write_text(f"model: {{init_from: {tmp_path / 'gpt2'}}}\n")
    with pytest.raises(ValueError, match="holds a 'gpt2' model, not a 'tnlg' one"):
        main(["--config", str(tmp_path / "run.yaml"), "--world-sizes", "8"])


def test_script_refuses_settings_a_run_config_decides(capsys):
    from scripts.estimate_memory import main

    with pytest.raises(SystemExit):
        main(["--config", str(RUN_CONFIGS / "tnlg-17b.yaml"), "--no-activation-checkpointing"])
    assert "--config decides --no-activation-checkpointing" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "stage", "ranks"), [("tnlg-17b", "1", "32"), ("mt-nlg-530b", "1", "2240")])
def test_the_big_run_configs_fit_80_gb_with_their_checkpointing(capsys, name, stage, ranks):
    from scripts.estimate_memory import main

    main(["--config", str(RUN_CONFIGS / f"{name}.yaml"), "--world-sizes", ranks, "--device-memory", "80GB"])
    out = capsys.readouterr().out
    assert "activation checkpointing on" in out
    (row,) = [line.split() for line in out.splitlines() if line.split()[:2] == [stage, ranks]]
    assert float(row[-2]) < 80  # the device column, in GB


def test_offloaded_activations_move_all_block_inputs_but_one_to_the_host(tnlg_17b):
    kept = estimate_memory(tnlg_17b, world_size=8, stage=3, micro_batch_size=2, seq_len=512)
    offloaded = estimate_memory(
        tnlg_17b, world_size=8, stage=3, micro_batch_size=2, seq_len=512, offload_activations=True
    )
    block_input = 2 * 2 * 512 * tnlg_17b.hidden_size  # bf16 (B, T, H)
    moved = (tnlg_17b.num_hidden_layers - 1) * block_input
    assert offloaded.activations == kept.activations  # still kept, elsewhere
    assert (offloaded.cpu_bytes, kept.cpu_bytes) == (moved, 0)
    assert offloaded.device_bytes == kept.device_bytes - moved
    assert "act" in format_table([offloaded]).splitlines()[2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload_activations": "yes"}, "offload_activations must be True or False"),
        ({"offload_activations": True, "activation_checkpointing": False}, "needs activation_checkpointing"),
    ],
)
def test_bad_activation_offload_is_refused(tnlg_17b, kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(tnlg_17b, world_size=8, stage=3, **kwargs)


def test_script_takes_a_run_configs_activation_offload(capsys, tmp_path):
    from scripts.estimate_memory import main

    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {preset: tnlg-17b, activation_checkpointing: {enabled: true, cpu_offload: true}}\n"
        "data: {seq_len: 256}\nzero: {stage: 3}\ntrain: {micro_batch_size: 2, mixed_precision: bf16}\n"
    )
    main(["--config", str(path), "--world-sizes", "8"])
    out = capsys.readouterr().out
    assert "activation checkpointing on, its block inputs offloaded" in out
    (row,) = [line.split() for line in out.splitlines() if line.split()[:2] == ["3", "8"]]
    expected = estimate_memory(
        TNLGConfig.from_preset("tnlg-17b"),
        world_size=8,
        stage=3,
        micro_batch_size=2,
        seq_len=256,
        offload_activations=True,
    )
    assert row[2] == "act" and float(row[-1]) == pytest.approx(expected.cpu_bytes / GB, abs=0.005)


def test_tensor_slicing_follows_korthikanti_eq_2():
    # eq. 2 (no sequence parallelism), dropout on, I = 4h, 16-bit: a layer keeps sbh(10 + 24/t + 5as/(ht)).
    config = TNLGConfig.from_preset(
        "debug", num_hidden_layers=3, attention_dropout=0.1, hidden_dropout=0.1, embedding_dropout=0.1
    )
    s, b, h, a, v, layers, t = 128, 2, 64, 4, 512, 3, 4  # the debug shape
    head = 2 * 2 * s * b * h + 4 * s * b * v // t + s * b * h
    full = activation_bytes(config, micro_batch_size=b, activation_checkpointing=False, tensor_parallel=t)
    assert full == layers * s * b * h * (10 + 24 // t) + layers * 5 * a * s * s * b // t + head


def test_tensor_slicing_cuts_the_matrices_and_keeps_norms_whole():
    config = TNLGConfig.from_preset("tnlg-17b")
    h, layers = config.hidden_size, config.num_hidden_layers
    whole_per_layer = 4 * h + 2 * h  # two LayerNorms, the attention output and fc_out biases
    sliced = config.num_parameters() - layers * whole_per_layer - config.max_position_embeddings * h - 2 * h
    expected = sliced // 4 + layers * whole_per_layer + config.max_position_embeddings * h + 2 * h
    assert tensor_rank_parameters(config, 4) == expected
    four = estimate_memory(config, world_size=32, stage=3, tensor_parallel=4)
    one = estimate_memory(config, world_size=32, stage=3)
    assert four.world_size == 32
    # ZeRO over 8 data ranks of a quarter of the model: about the same model states as 32 of all of it.
    assert four.model_states == pytest.approx(one.model_states, rel=0.01)
    assert four.activations < one.activations


def test_tensor_degrees_that_cut_heads_are_named_with_the_valid_ones():
    config = TNLGConfig.from_preset("tnlg-17b")
    with pytest.raises(
        ValueError, match=r"does not divide num_attention_heads \(28\): valid degrees are 1, 2, 4, 7, 14, 28"
    ):
        estimate_memory(config, world_size=24, stage=3, tensor_parallel=3)
    with pytest.raises(ValueError, match=r"degree 7 does not divide vocab_size \(50304\)"):
        estimate_memory(config, world_size=28, stage=3, tensor_parallel=7)
    with pytest.raises(ValueError, match="tensor_parallel=4 does not divide world_size=6"):
        estimate_memory(config, world_size=6, stage=3, tensor_parallel=4)


def test_pipeline_ranks_hold_their_stages_layers_and_the_tied_embedding_twice():
    config = TNLGConfig.from_preset("tnlg-17b")  # 78 layers: stages of 19, 20, 20, 19
    h, v, t, p = config.hidden_size, config.vocab_size, 4, 4
    layer = sum(_layer_tensor_sizes(config, t))
    held = [tensor_rank_parameters(config, t, pipeline_parallel=p, pipeline_rank=rank) for rank in range(p)]
    sizes = [len(run) for run in stage_layers(config.num_hidden_layers, p)]
    embeddings = v * h // t + config.max_position_embeddings * h
    assert held[0] == sizes[0] * layer + embeddings
    assert held[1:3] == [sizes[1] * layer, sizes[2] * layer]
    assert held[3] == sizes[3] * layer + 2 * h + v * h // t  # final LayerNorm, the tied output layer
    assert sum(held) == tensor_rank_parameters(config, t) + v * h // t
    untied = TNLGConfig.from_preset("tnlg-17b", tie_word_embeddings=False)
    assert sum(
        tensor_rank_parameters(untied, t, pipeline_parallel=p, pipeline_rank=rank) for rank in range(p)
    ) == tensor_rank_parameters(untied, t)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_shards_a_pipeline_ranks_parameters_over_the_data_degree(tnlg_17b, stage):
    for rank in range(4):
        estimate = estimate_memory(
            tnlg_17b, world_size=64, stage=stage, tensor_parallel=4, pipeline_parallel=4, pipeline_rank=rank
        )
        psi = tensor_rank_parameters(tnlg_17b, 4, pipeline_parallel=4, pipeline_rank=rank)
        assert estimate.model_states == paper_bytes(psi, 64 // 16, stage)
        assert (estimate.pipeline_rank, estimate.pipeline_parallel, estimate.world_size) == (rank, 4, 64)


def _no_dropout(layers: int) -> TNLGConfig:
    return TNLGConfig.from_preset(
        "debug", num_hidden_layers=layers, attention_dropout=0.0, hidden_dropout=0.0
    )


def test_1f1b_keeps_p_minus_i_micro_batches_on_stage_i():
    config, p = _no_dropout(8), 4  # 2 layers a stage
    per_layer = activation_bytes(config, activation_checkpointing=False) - activation_bytes(
        _no_dropout(7), activation_checkpointing=False
    )
    whole = {flag: activation_bytes(config, activation_checkpointing=flag) for flag in (True, False)}
    stages = {
        flag: [
            activation_bytes(config, activation_checkpointing=flag, pipeline_parallel=p, pipeline_rank=r)
            for r in range(p)
        ]
        for flag in (True, False)
    }
    layers = config.num_hidden_layers // p
    head = whole[False] - config.num_hidden_layers * per_layer  # the embedding mask, final LN, logits
    for rank, kept in enumerate(stages[False]):
        assert kept == (p - rank) * layers * per_layer + (head if rank == p - 1 else 0)
    # Checkpointed: the first stage keeps p x L/p = L layer inputs and recomputes one layer, as one
    # process does, without the head; the last keeps L/p inputs, one layer, and the head.
    layer_input = 2 * 128 * config.hidden_size  # bf16 (s, b, h) of the debug shape
    first, last = stages[True][0], stages[True][-1]
    assert first == whole[True] - head
    assert last == layers * layer_input + (whole[True] - config.num_hidden_layers * layer_input)
    before_last = stages[True][:-1]
    assert before_last == sorted(set(before_last), reverse=True)  # fewer in flight down the pipeline


def test_interleaving_keeps_narayanans_factor_more_on_the_first_stage():
    config, p, v = _no_dropout(24), 4, 2  # 8 stages of 3 layers, rank 0 holds stages 0 and 4
    per_layer = activation_bytes(config, activation_checkpointing=False) - activation_bytes(
        _no_dropout(23), activation_checkpointing=False
    )
    first = activation_bytes(
        config, activation_checkpointing=False, pipeline_parallel=p, virtual_stages=v, pipeline_rank=0
    )
    # Narayanan et al. 2021: L(1 + (p - 1)/(p v)) layers' worth, here 24 x 11/8 = 33.
    assert first == config.num_hidden_layers * (p * v + p - 1) // (p * v) * per_layer
    assert first > activation_bytes(config, activation_checkpointing=False, pipeline_parallel=p)


def test_the_worst_pipeline_rank_is_estimated_by_default(tnlg_17b):
    options = {"world_size": 64, "stage": 1, "tensor_parallel": 4, "pipeline_parallel": 4}
    ranks = [estimate_memory(tnlg_17b, **options, pipeline_rank=r) for r in range(4)]
    worst = estimate_memory(tnlg_17b, **options)
    assert worst == max(ranks, key=lambda estimate: estimate.device_bytes)
    assert worst.pipeline_rank == 0  # 1F1B: the first stage keeps the most micro-batches
    assert "pipe rank" in format_table([worst]) and "0/4" in format_table([worst])
    assert "pipe rank" not in format_table([estimate_memory(tnlg_17b, world_size=64, stage=1)])


def test_smallest_world_size_counts_whole_pipelines(tnlg_17b):
    options = {"stage": 1, "tensor_parallel": 4, "pipeline_parallel": 4}
    found = smallest_world_size(tnlg_17b, device_memory_bytes=40 * GB, **options)
    assert found is not None and found % 16 == 0 and (found // 16) & (found // 16 - 1) == 0
    assert estimate_memory(tnlg_17b, world_size=found, **options).device_bytes <= 40 * GB


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 24, "pipeline_parallel": 16}, "tensor 1 x pipeline 16 = 16 does not divide"),
        ({"world_size": 158, "pipeline_parallel": 79}, "79 pipeline stages need at least one layer each"),
        (
            {"world_size": 8, "pipeline_parallel": 4, "pipeline_rank": 4},
            r"pipeline_rank must be an integer in \[0, 3\]",
        ),
        ({"world_size": 8, "virtual_stages": 2}, "virtual_stages=2 needs pipeline stages"),
    ],
)
def test_bad_pipeline_layouts_are_named(tnlg_17b, kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(tnlg_17b, stage=1, **kwargs)


def test_script_takes_pipeline_stages(capsys):
    from scripts.estimate_memory import main

    main(["--preset", "tnlg-17b", "--stages", "1", "--world-sizes", "64", "--tensor-parallel", "4", "--pipeline-parallel", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert "4 pipeline stages (1F1B)" in out
    (row,) = [line.split() for line in out.splitlines() if line.split()[:2] == ["1", "64"]]
    expected = estimate_memory(
        TNLGConfig.from_preset("tnlg-17b"), world_size=64, stage=1, tensor_parallel=4, pipeline_parallel=4
    )
    assert row[3] == "0/4" and float(row[-2]) == pytest.approx(expected.device_bytes / GB, abs=0.005)
