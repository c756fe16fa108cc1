"""Compiled blocks through the engine ([Note: compiled blocks] in sharding/compile.py): compiled = eager at
every ZeRO stage and layout, no graph break inside a block, no recompilation from step to step, the
settings refused where they cannot apply, and inductor's cache reused by a later process."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from accelerate.utils import TorchDynamoPlugin
from torch._dynamo.utils import counters

from tests.sharding.test_zero_equivalence import assert_states_close
from tests.support.compile_cases import (
    Layout,
    accelerate_dynamo,
    eager_and_compiled,
    fresh_compile_counts,
    layouts,
    vocab_parallel_loss,
)
from tests.support.tensor_parallel_cases import make_model as make_tnlg
from tnlg.launch_settings import compile_config_for
from tnlg.modeling import fused_ops
from tnlg.run.activations import enable_activation_checkpointing
from tnlg.sharding import CompileConfig, ZeroConfig
from tnlg.sharding.compile import CompileClock, check_compile_fits, compile_blocks
from tnlg.tools.spawn import run_distributed

FP32 = [Layout(0), Layout(1), Layout(2), Layout(3), Layout(3, checkpointing=True)]
MIXED = [Layout(3, precision="bf16", offload=True), Layout(2, precision="fp16")]
GRIDS = [Layout(2, tensor=2), Layout(3, pipeline=2), Layout(1, tensor=2, checkpointing=True)]


# A backend (CompileConfig takes a registered name) that keeps the graphs Dynamo hands it and runs them as
# traced.
RECORDING_BACKEND = "tnlg_tests_record_graphs"
RECORDED_GRAPHS: list[torch.fx.GraphModule] = []
if RECORDING_BACKEND not in torch.compiler.list_backends(exclude_tags=()):

    @torch._dynamo.register_backend(name=RECORDING_BACKEND)
    def _record_graphs(graph_module, example_inputs):
        RECORDED_GRAPHS.append(graph_module)
        return graph_module.forward


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> str:
    """One inductor cache for the module: the layouts compile the same block graphs."""
    return str(tmp_path_factory.mktemp("inductor"))


@pytest.fixture(scope="module")
def two_ranks(inductor_cache) -> dict:
    return run_distributed(eager_and_compiled, 2, layouts(*FP32, *MIXED), inductor_cache, timeout=900)[0]


@pytest.fixture(scope="module")
def four_ranks(inductor_cache) -> list[dict]:
    return run_distributed(eager_and_compiled, 4, layouts(*GRIDS), inductor_cache, timeout=900)


def assert_compiled_equals_eager(result: dict) -> None:
    eager, compiled = result["eager"], result["compiled"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert_states_close(compiled["state"], {k: v.float() for k, v in eager["state"].items()}, atol=1e-5)


def assert_compiled_once(compiled: dict, blocks: list[str]) -> None:
    """Every block of this rank compiled, nothing broke a block's graph, and the frames Dynamo compiled
    stop growing once training and evaluation have each run (the evaluation after step 2)."""
    assert compiled["compiled_blocks"] == blocks
    assert compiled["graph_breaks"] == {}
    frames = compiled["frames_after_each_step"]
    assert frames[0] >= 1  # the blocks did run compiled
    assert frames[1] == frames[2] == frames[3], f"recompiled from step to step: {frames}"
    assert compiled["unique_graphs"] <= 2  # one graph for every block in training, one in evaluation
    assert compiled["compile_stats"]["compiles"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("layout", FP32, ids=lambda layout: layout.name)
def test_compiled_equals_eager_in_fp32_at_zero_0_to_3(two_ranks, layout):
    result = two_ranks[layout.name]
    assert_compiled_equals_eager(result)
    assert_compiled_once(result["compiled"], ["model.layers.0", "model.layers.1"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", MIXED, ids=lambda layout: layout.name)
def test_compiled_trains_like_eager_in_16_bits_and_with_offload(two_ranks, layout):
    """16-bit compute: inductor's fused kernels round differently from eager's op-by-op ones."""
    result = two_ranks[layout.name]
    assert result["compiled"]["losses"] == pytest.approx(result["eager"]["losses"], rel=1e-3)
    assert_compiled_once(result["compiled"], ["model.layers.0", "model.layers.1"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", GRIDS, ids=lambda layout: layout.name)
def test_compiled_equals_eager_under_tensor_and_pipeline_cuts(four_ranks, layout):
    assert_compiled_equals_eager(four_ranks[0][layout.name])  # rank 0 holds the consolidated parameters
    for rank, results in enumerate(four_ranks):
        # Ranks (pipeline, data, tensor), tensor innermost: under 2 pipeline stages ranks 0-1 hold the first
        # layer and ranks 2-3 the second, with the output layer and the loss.
        blocks = (
            [f"model.layers.{rank // 2}"] if layout.pipeline == 2 else ["model.layers.0", "model.layers.1"]
        )
        assert_compiled_once(results[layout.name]["compiled"], blocks)


@pytest.mark.slow
def test_the_vocab_parallel_loss_compiles_whole_and_equals_eager():
    """The head under tensor slicing is left eager (benchmarks/compile_head.py measures whether compiling
    it pays), but compiled it must trace whole, its all-reduces included, and compute the same."""
    for rank in run_distributed(vocab_parallel_loss, 2, timeout=180):
        for key in ("loss", "hidden", "head"):
            torch.testing.assert_close(rank["compiled"][key], rank["eager"][key], rtol=1e-6, atol=1e-7)


def test_deep_models_compile_one_graph_for_every_block():
    """Beyond Dynamo's recompile limit (8), a guard on something that differs per layer would fall back to
    eager silently: twelve layers, two steps, one frame compiled."""
    model = make_tnlg(num_hidden_layers=12)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model, CompileConfig(backend="aot_eager"))
    for _ in range(2):
        model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    assert counters["frames"]["total"] == 1 and counters["stats"]["unique_graphs"] == 1
    assert counters["graph_break"] == {}


def test_generation_runs_the_blocks_eagerly_and_training_compiled():
    """Generation hands every block a KV cache, with an entry of its own and a length that grows a token a
    step: compiled, each layer would compile a frame of its own until Dynamo's recompile limit (eight
    frames on twelve layers, then eager). Given a cache the blocks run eagerly, with the eager model's
    tokens; training, and a loss evaluated in eval mode, still compile the one graph."""
    model = make_tnlg(num_hidden_layers=12).eval()
    prompt = torch.randint(0, 64, (2, 5))
    settings = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    eager_tokens = model.generate(prompt, **settings)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model, CompileConfig(backend="aot_eager"))
    assert torch.equal(model.generate(prompt, **settings), eager_tokens)
    assert counters["frames"]["total"] == 0
    with torch.no_grad():
        model(prompt, labels=prompt)  # eval mode, a loss: no cache, compiled
    model.train()(prompt).logits.sum().backward()  # training without labels: no cache either
    assert counters["frames"]["total"] == 2 and counters["stats"]["unique_graphs"] == 2


def test_a_checkpointed_block_compiles_its_recomputation_into_the_graph():
    """With activation checkpointing the checkpoint is traced into each block's compiled graph, whatever
    Transformers release is installed ([Note: checkpointing the forward] in transformers_compat.py): the
    backward graph recomputes the block, rather than a compiled forward running again inside an eager
    checkpoint."""
    model = make_tnlg().train()
    enable_activation_checkpointing(model)
    torch._dynamo.reset()
    counters.clear()
    RECORDED_GRAPHS.clear()
    compile_blocks(model, CompileConfig(backend=RECORDING_BACKEND))
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    assert len(RECORDED_GRAPHS) == 1 and counters["graph_break"] == {}
    targets = {node.target for node in RECORDED_GRAPHS[0].graph.nodes if node.op == "call_function"}
    assert torch.ops.higher_order.tag_activation_checkpoint in targets


def test_an_engine_without_compiling_runs_the_blocks_eager_again():
    model = make_tnlg()
    compile_blocks(model, CompileConfig(backend="eager"))
    assert "forward" in vars(model.model.layers[0])
    assert compile_blocks(model, None) == []
    assert not any("forward" in vars(block) for block in model.model.layers)


def test_a_model_without_declared_blocks_is_not_compiled_whole():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(
        ValueError, match=r"Sequential declares no repeated blocks to compile \(_no_split_modules"
    ):
        compile_blocks(model, CompileConfig(backend="eager"))


def test_a_graph_break_inside_a_block_is_counted():
    """The count the tests above find empty sees a break when there is one."""
    model = make_tnlg()
    block = model.model.layers[0]
    original = type(block.mlp).forward

    def breaking_forward(self, hidden_states):
        torch._dynamo.graph_break()
        return original(self, hidden_states)

    block.mlp.forward = breaking_forward.__get__(block.mlp)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model, CompileConfig(backend="eager"))
    model(torch.randint(0, 64, (1, 8))).logits.sum().backward()
    assert sum(counters["graph_break"].values()) >= 1


def test_the_fused_kernels_give_way_inside_compiled_code(monkeypatch):
    """Inside compiled code the choice reads nothing but `is_compiling`: the probe for Triton is made
    untraceable here (as `importlib.util.find_spec` is to torch 2.11's Dynamo, a graph break in every
    block on a GPU) and the whole choice must still trace as one graph."""
    x = torch.ones(2)

    def route(tensor):
        return tensor + (1.0 if fused_ops.use_block_kernel("triton", tensor) else 0.0)

    pytest.importorskip("triton")
    assert route(x).tolist() == [2.0, 2.0]
    monkeypatch.setattr(fused_ops, "triton_available", torch.compiler.disable(lambda: True))
    torch._dynamo.reset()
    assert torch.compile(route, backend="eager", fullgraph=True)(x).tolist() == [1.0, 1.0]


def test_blocks_compile_in_place_under_their_own_names():
    model = make_tnlg()
    names = sorted(model.state_dict())
    assert compile_blocks(model, CompileConfig(backend="eager")) == ["model.layers.0", "model.layers.1"]
    assert sorted(model.state_dict()) == names
    assert type(model.model.layers[0]).__name__ == "TNLGBlock"
    assert "forward" not in vars(model.model) and "forward" not in vars(model)  # the root stays eager
    # Compiling again (a second engine over the same model) replaces the first engine's compiled forward.
    first = model.model.layers[0].forward
    compile_blocks(model, CompileConfig(backend="aot_eager"))
    assert model.model.layers[0].forward is not first
    assert model.model.layers[0].forward._tnlg_compiled_block == CompileConfig(backend="aot_eager")


def test_a_forward_set_on_a_block_is_not_compiled_over():
    model = make_tnlg()
    model.model.layers[1].forward = lambda *args, **kwargs: None
    with pytest.raises(ValueError, match=r"block model.layers.1 has a forward set on the instance"):
        compile_blocks(model, CompileConfig(backend="eager"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "inductr"}, r"compile backend 'inductr' is not one torch knows: .*inductor"),
        ({"mode": "fast"}, r"compile mode 'fast' is not one of default, .*reduce-overhead"),
        ({"mode": "max-autotune", "options": {"a": 1}}, r"give compile mode or options, not both"),
        # torch's other backends log "ignoring extra kwargs" and compile without them
        (
            {"backend": "aot_eager", "mode": "reduce-overhead"},
            r"compile mode: backend 'aot_eager' ignores it \(a mode is inductor's\)",
        ),
        (
            {"backend": "eager", "options": {"max_autotune": True}},
            r"compile options: backend 'eager' ignores it",
        ),
        # torch.compile's own checks of the options, made when the setting is given, not at compile time
        (
            {"options": {"triton.cudagraph": True}},
            r"compile options: Unexpected optimization option triton.cudagraph \(did you mean triton.cudagraphs\?",
        ),
        ({"options": {"max_autotune": "yes"}}, r"compile options: Unexpected type of attr max_autotune"),
    ],
)
def test_bad_compile_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        CompileConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"mode": "reduce-overhead"}, "compile mode 'reduce-overhead'"),
        ({"mode": "max-autotune"}, "compile mode 'max-autotune'"),
        ({"options": {"triton.cudagraphs": True}}, "compile option triton.cudagraphs"),
        ({"backend": "cudagraphs"}, "compile backend 'cudagraphs'"),
    ],
)
def test_cuda_graphs_are_refused_where_parameters_move(fields, named):
    with pytest.raises(
        ValueError, match=rf"{named} replays CUDA graphs .* but ZeRO stage 3 frees and regathers"
    ):
        check_compile_fits(CompileConfig(**fields), ZeroConfig(stage=3))
    check_compile_fits(CompileConfig(**fields), ZeroConfig(stage=2))  # parameters stay where they are


@pytest.mark.parametrize(
    "fields",
    [
        {"mode": "max-autotune-no-cudagraphs"},
        {"options": {"triton.cudagraphs": False, "max_autotune": True}},
    ],
)
def test_compiling_without_cuda_graphs_is_taken_at_stage_3(fields):
    assert not CompileConfig(**fields).uses_cuda_graphs
    check_compile_fits(CompileConfig(**fields), ZeroConfig(stage=3))


def test_the_clock_counts_compilations_until_closed():
    torch._dynamo.reset()  # which also drops every compile callback: before the clock, as in an engine
    clock = CompileClock()
    torch.compile(lambda t: t * 2, backend="eager")(torch.ones(3))
    assert clock.compiles == 1 and clock.seconds > 0
    clock.close()
    torch.compile(lambda t: t * 3, backend="eager")(torch.ones(3))
    assert clock.compiles == 1


def test_accelerates_dynamo_settings_become_the_engines():
    plugin = TorchDynamoPlugin(backend="inductor", mode="max-autotune-no-cudagraphs", fullgraph=True)
    assert compile_config_for(None, plugin) == CompileConfig(
        backend="inductor", mode="max-autotune-no-cudagraphs", fullgraph=True
    )
    assert compile_config_for(None, TorchDynamoPlugin(backend="no")) is None
    given = CompileConfig(backend="aot_eager")
    assert compile_config_for(given, TorchDynamoPlugin(backend="no")) is given
    with pytest.raises(ValueError, match=r"compile_config and Accelerate's dynamo_backend='inductor' both"):
        compile_config_for(given, plugin)
    # a launch's settings the backend would ignore are named by where they were set
    ignored = TorchDynamoPlugin(backend="aot_eager", mode="max-autotune")
    with pytest.raises(ValueError, match=r"Accelerate's dynamo settings \(dynamo_backend aot_eager, dynamo_mode "
                       r"max-autotune\): compile mode: backend 'aot_eager' ignores it"):  # fmt: skip
        compile_config_for(None, ignored)


@pytest.fixture(scope="module")
def accelerate_eager() -> dict:
    return run_distributed(accelerate_dynamo, 2, "no")[0]


@pytest.mark.slow
@pytest.mark.parametrize(("use_dynamic", "dynamic"), [(None, None), ("False", False)], ids=["unset", "false"])
def test_accelerates_dynamo_backend_compiles_the_blocks_inside_the_engine(
    accelerate_eager, use_dynamic, dynamic
):
    eager = accelerate_eager
    compiled = run_distributed(accelerate_dynamo, 2, "aot_eager", use_dynamic)[0]
    assert compiled["dynamic"] is dynamic  # the launcher's value reaches the blocks
    frames = compiled["frames_after_each_step"]
    assert frames[0] >= 1 and frames[0] == frames[1] == frames[2], f"recompiled from step to step: {frames}"
    assert eager["compiled_blocks"] == []
    assert compiled["compiled_blocks"] == [
        f"model.layers.{i}" for i in range(len(compiled["compiled_blocks"]))
    ]
    assert compiled["compiled_blocks"] and compiled["graph_breaks"] == {}
    assert compiled["compile_stats"]["compiles"] >= 1  # compiled code ran
    assert compiled["prepare_model"] == eager["prepare_model"] == "TNLGForCausalLM"  # not compiled whole
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert compiled["unwrapped"] == "TNLGForCausalLM"  # never Accelerate's whole-model OptimizedModule


@pytest.mark.slow
def test_a_later_process_reads_the_compiled_graphs_from_the_cache(tmp_path):
    first = run_distributed(fresh_compile_counts, 1, str(tmp_path))[0]
    assert first["misses"] >= 1 and first["compiles"] >= 1
    assert any(path.is_file() for path in tmp_path.rglob("*"))  # the cache is where it was told to be
    again = run_distributed(fresh_compile_counts, 1, str(tmp_path))[0]
    assert again["hits"] >= 1 and again["misses"] == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"backend": "eager", "mode": "default"},  # torch.compile's "no mode"
        {"backend": "tvm", "options": {"scheduler": "default"}},  # tvm reads its options
    ],
)
def test_what_a_backend_reads_is_taken(fields):
    assert CompileConfig(**fields).compile_kwargs()["backend"] == fields["backend"]
