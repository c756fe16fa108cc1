"""What each rank runs in the compiled-block tests (module-level so that spawned processes import it).

Every layout trains the tiny TNLG model twice in one process, eager and with its blocks compiled, on the
same data; the compiled run records Dynamo's own counters: graph breaks by reason, and the frames it
compiled after each step (a frame compiled again is a recompilation).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from tests.support.parallel_cases import tnlg_batches, tnlg_optimizer
from tests.support.tensor_parallel_cases import make_model as make_tnlg
from tnlg.run.activations import enable_activation_checkpointing
from tnlg.sharding import CompileConfig, ParallelDims, ZeroConfig, initialize


@dataclass(frozen=True)
class Layout:
    stage: int
    tensor: int = 1
    pipeline: int = 1
    checkpointing: bool = False
    precision: str = "no"
    offload: bool = False

    @property
    def name(self) -> str:
        parts = [f"stage{self.stage}", f"tp{self.tensor}", f"pp{self.pipeline}", self.precision]
        parts += ["checkpointing"] * self.checkpointing + ["offload"] * self.offload
        return "-".join(parts)


def _engine(layout: Layout, compile_config: CompileConfig | None):
    model = make_tnlg(num_hidden_layers=2)
    if layout.checkpointing:
        enable_activation_checkpointing(model)
    offload = "cpu" if layout.offload else "none"
    config = ZeroConfig(
        stage=layout.stage,
        reduce_bucket_size=500,
        param_persistence_threshold=40,
        mixed_precision=layout.precision,
        offload_optimizer=offload,
        offload_param=offload if layout.stage == 3 else "none",
    )
    dims = ParallelDims(tensor=layout.tensor, pipeline=layout.pipeline)
    return initialize(model, tnlg_optimizer(model), config, parallel=dims, compile_config=compile_config)


def train(layout: Layout, compile_config: CompileConfig | None) -> dict:
    """Four steps of train_batch (one micro-batch per sequence of this data rank's share), an evaluation
    after the second; the losses, the final parameters and, compiled, Dynamo's counts."""
    torch._dynamo.reset()
    counters.clear()
    engine = _engine(layout, compile_config)
    data_rank, data_size = engine.parallel.rank("data"), engine.parallel.dims.data
    losses, frames = [], []
    for step, (ids, labels) in enumerate(tnlg_batches()):
        share = slice(data_rank * len(ids) // data_size, (data_rank + 1) * len(ids) // data_size)
        micro = [
            {"input_ids": i[None], "labels": t[None]} for i, t in zip(ids[share], labels[share], strict=True)
        ]
        losses.append(engine.train_batch(micro).item())
        if step == 1:
            losses.append(engine.eval_batch(micro).item())  # a forward in eval mode, without gradients
        frames.append(counters["frames"]["total"])
    state = engine.full_state_dict()
    result = {
        "losses": losses,
        "state": state,
        "frames_after_each_step": frames,
        "graph_breaks": dict(counters["graph_break"]),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "compile_stats": engine.compile_stats(),
        "compiled_blocks": list(engine.compiled_blocks),
    }
    engine.close()
    return result


def eager_and_compiled(rank: int, world_size: int, layouts: list[dict], cache_dir: str) -> dict:
    """For each layout, its eager run and its compiled run (inductor, graphs cached in `cache_dir`)."""
    compiled = CompileConfig(backend="inductor", cache_dir=cache_dir)
    results = {}
    for fields in layouts:
        layout = Layout(**fields)
        results[layout.name] = {"eager": train(layout, None), "compiled": train(layout, compiled)}
    return results


def layouts(*items: Layout) -> list[dict]:
    """Layouts as plain dicts, to pass to spawned processes."""
    return [asdict(item) for item in items]


def fresh_compile_counts(rank: int, world_size: int, cache_dir: str) -> dict:
    """The stage-2 layout trained compiled (as `train`), inductor's graphs cached in `cache_dir`: inductor's
    cache hits and misses (a second process with the same directory should only hit)."""
    compiled = CompileConfig(backend="inductor", cache_dir=cache_dir)
    result = train(Layout(2), compiled)
    return {
        "hits": counters["inductor"]["fxgraph_cache_hit"],
        "misses": counters["inductor"]["fxgraph_cache_miss"],
        "compiles": result["compile_stats"]["compiles"],
    }


def accelerate_dynamo(rank: int, world_size: int, backend: str, use_dynamic: str | None = None) -> dict:
    """Accelerate's own `dynamo_backend` on a ZeroAccelerator (stage 3): three steps of the standard loop;
    the losses, the frames Dynamo compiled after each step, which blocks the engine compiled (and how
    often torch compiled), the model class the Accelerator hands back, and what its prepare_model makes
    of another model. `use_dynamic`: ACCELERATE_DYNAMO_USE_DYNAMIC as `accelerate launch` exports it
    (up to Accelerate 1.15 "False" when --dynamo_use_dynamic is not given; from 1.16 unset: None)."""
    from tests.support.zero_tnlg_cases import debug_model
    from tnlg.accelerate import ZeroAccelerator

    os.environ.pop("ACCELERATE_DYNAMO_USE_DYNAMIC", None)
    if use_dynamic is not None:
        os.environ["ACCELERATE_DYNAMO_USE_DYNAMIC"] = use_dynamic
    torch._dynamo.reset()
    counters.clear()
    accelerator = ZeroAccelerator(zero_config=ZeroConfig(stage=3), dynamo_backend=backend)
    model = debug_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(7 + rank)
    losses, frames = [], []
    for _ in range(3):
        ids = torch.randint(0, 512, (2, 24), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        frames.append(counters["frames"]["total"])
    # Accelerate's own prepare_model (the Trainer's, for an evaluation before training) must not compile
    # the whole model around the engine's blocks.
    other = accelerator.prepare_model(debug_model(), evaluation_mode=True)
    result = {
        "losses": losses,
        "frames_after_each_step": frames,
        "dynamic": accelerator.compile_config.dynamic if accelerator.compile_config else None,
        "compiled_blocks": list(engine.compiled_blocks),
        "compile_stats": engine.compile_stats(),
        "graph_breaks": dict(counters["graph_break"]),
        "unwrapped": type(accelerator.unwrap_model(engine)).__name__,
        "prepare_model": type(other).__name__,
    }
    engine.close()
    return result


def compiled_debug_run(rank: int, world_size: int, cache: str, output: str, overrides: list[str]) -> dict:
    """configs/pretrain/debug.yaml for 3 steps with `overrides`: each step's metrics and the files in the
    run's compile cache."""
    from pathlib import Path

    from tests.support.run_cases import build_debug_run
    from tnlg.run.loop import train_step

    run = build_debug_run(cache, ["--train.output_dir", output, *overrides])
    batches = iter(run.stream)
    steps = [train_step(run, batches, step) for step in range(3)]
    run.engine.close()
    cache_dir = Path(output) / "compile_cache"
    return {"steps": steps, "cached_files": sum(1 for p in cache_dir.rglob("*") if p.is_file())}


def vocab_parallel_loss(rank: int, world_size: int) -> dict:
    """The loss of a head cut over the tensor group, eager and compiled whole (`fullgraph`: the
    all-reduces inside it traced, no graph break): the loss and the gradients of the hidden state and of
    this rank's rows of the head."""
    from tnlg.modeling.tensor_parallel import apply_tensor_parallel, vocab_parallel_causal_lm_loss

    model = make_tnlg()
    apply_tensor_parallel(model, torch.distributed.group.WORLD)
    generator = torch.Generator().manual_seed(0)  # the same input on every tensor rank
    hidden = torch.randn(2, 8, model.config.hidden_size, generator=generator)
    labels = torch.randint(0, model.config.vocab_size, (2, 8), generator=generator)
    labels[0, 3] = -100  # an ignored token

    def loss(hidden_states: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_causal_lm_loss(model.lm_head, hidden_states, labels)

    torch._dynamo.reset()
    results = {}
    for name, function in (
        ("eager", loss),
        ("compiled", torch.compile(loss, backend="aot_eager", fullgraph=True)),
    ):
        leaf = hidden.clone().requires_grad_()
        value = function(leaf)
        value.backward()
        results[name] = {
            "loss": value.detach(),
            "hidden": leaf.grad,
            "head": model.lm_head.weight.grad.clone(),
        }
        model.lm_head.weight.grad = None
    return results
