"""What each rank runs in the parallel-layout tests (module-level so that spawned processes import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.tensor_parallel_cases import VOCAB
from tests.support.tensor_parallel_cases import make_model as make_tnlg
from tests.support.traffic import counted_traffic, unit_sizes
from tests.support.zero_cases import SMALL, STEPS
from tests.support.zero_models import batches, local, make_model, make_optimizer, train_one_process
from tnlg.sharding import ParallelDims, ZeroConfig, initialize
from tnlg.sharding.parallel import build_groups


def mesh_coordinates(rank: int, world_size: int, tensor: int, pipeline: int) -> dict:
    """This rank's (pipeline, data, tensor) coordinates and the global ranks of its groups."""
    groups = build_groups(ParallelDims(tensor=tensor, pipeline=pipeline))
    return {
        "coordinates": tuple(groups.rank(d) for d in ("pipeline", "data", "tensor")),
        "tensor_ranks": dist.get_process_group_ranks(groups.tensor),
        "data_ranks": dist.get_process_group_ranks(groups.data),
    }


def train_batches(rank: int, world_size: int, stage: int, micro_batches: int) -> dict:
    """STEPS steps of train_batch on the equivalence model, each global batch split into this rank's
    micro-batches; the losses train_batch returned and the final parameters."""
    model = make_model()
    engine = initialize(
        model, make_optimizer(model), ZeroConfig(**{**SMALL, "stage": stage}), parallel=ParallelDims()
    )
    losses = []
    for batch in batches(STEPS):
        input_ids, labels = local(batch, rank, world_size)
        chunks = zip(input_ids.chunk(micro_batches), labels.chunk(micro_batches), strict=True)
        losses.append(engine.train_batch([tuple(chunk) for chunk in chunks]).item())
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state}


def train_batch_errors(rank: int, world_size: int) -> list[str]:
    model = make_model()
    # A DeepSpeed-style accumulation of 3 per step: two micro-batches disagree with it.
    engine = initialize(
        model,
        make_optimizer(model),
        {
            "zero_optimization": {"stage": 1},
            "gradient_accumulation_steps": 3,
            "train_micro_batch_size_per_gpu": 1,
        },
    )
    ids, labels = local(batches(1)[0], rank, world_size)
    messages = []
    for bad in ([], {"input_ids": ids, "labels": labels}, [(ids, labels)] * 2):
        try:
            engine.train_batch(bad)
        except ValueError as error:
            messages.append(str(error))
    engine.close()
    return messages


# ---------------------------------------------------------------------------- tensor x data (TNLG)
TNLG_STEPS = 4


def tnlg_batches(steps: int = TNLG_STEPS, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches (input_ids, labels) of 4 sequences for the tiny TNLG model, a prompt ignored."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 12), generator=generator)
        labels = ids.clone()
        # The same number ignored in every sequence: then the mean of per-micro-batch means that data
        # parallelism takes is the global token mean one process takes.
        labels[:, :3] = -100
        out.append((ids, labels))
    return out


def tnlg_rows() -> list[dict[str, torch.Tensor]]:
    """The global batches' sequences one by one, as a dataset for a data loader (in order)."""
    return [
        {"input_ids": ids, "labels": labels}
        for batch in tnlg_batches()
        for ids, labels in zip(*batch, strict=True)
    ]


def tnlg_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    # eps 1e-3: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by
    # every key), and Adam with a tiny eps would turn its rounding noise (~1e-9, different in every
    # layout) into full-size steps.
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, eps=1e-3)


def tnlg_reference(clip: float = 0.0, layers: int = 2) -> dict:
    """One process on the global batches: per-step losses and gradient norms, the final parameters."""
    model = make_tnlg(num_hidden_layers=layers)
    loss_of = lambda ids, labels: model(ids, labels=labels).loss  # noqa: E731
    return train_one_process(model, tnlg_optimizer(model), tnlg_batches(), loss_of, clip)


def train_tensor_data(
    rank: int,
    world_size: int,
    tensor: int,
    stage: int,
    clip: float = 0.0,
    pipeline: int = 1,
    virtual_stages: int = 1,
    layers: int = 2,
) -> dict:
    """The tiny TNLG model cut `tensor` ways and into `pipeline` x `virtual_stages` stages, ZeRO `stage`
    over the data ranks, trained with train_batch on each data rank's share of the global batches (one
    micro-batch per sequence)."""
    model = make_tnlg(num_hidden_layers=layers)
    config = ZeroConfig(
        stage=stage, reduce_bucket_size=500, param_persistence_threshold=40, gradient_clipping=clip
    )
    dims = ParallelDims(tensor=tensor, pipeline=pipeline, virtual_stages=virtual_stages)
    engine = initialize(model, tnlg_optimizer(model), config, parallel=dims)
    data_rank, data_size = engine.parallel.rank("data"), engine.parallel.dims.data
    losses, norms = [], []
    for ids, labels in tnlg_batches():
        share = slice(data_rank * len(ids) // data_size, (data_rank + 1) * len(ids) // data_size)
        micro = [
            {"input_ids": i[None], "labels": t[None]} for i, t in zip(ids[share], labels[share], strict=True)
        ]
        losses.append(engine.train_batch(micro).item())
        norms.append(engine.get_global_grad_norm())
    state = engine.full_state_dict()
    comm = engine.comm_stats()
    engine.close()
    return {"losses": losses, "norms": norms, "state": state, "comm": comm}


def accelerate_tensor_data(rank: int, world_size: int, stage: int, source: str) -> dict:
    """The documented Accelerate loop with tensor slicing 2 from Accelerate's own ParallelismConfig
    (`source="config"`) or its launcher's environment (`source="environment"`): losses, the batches
    this rank read, the final consolidated parameters."""
    import os

    from accelerate.parallelism_config import ParallelismConfig

    from tnlg.accelerate import ZeroAccelerator

    options = {}
    if source == "config":
        options["parallelism_config"] = ParallelismConfig(tp_size=2, dp_shard_size=2)
    else:
        os.environ.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_TP_SIZE="2")
    accelerator = ZeroAccelerator(zero_config=ZeroConfig(stage=stage), **options)
    model = make_tnlg()
    loader = torch.utils.data.DataLoader(tnlg_rows(), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, tnlg_optimizer(model), loader)
    losses, seen = [], []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen.append(batch["input_ids"][:, 0].tolist())
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    state = model.full_state_dict()
    return {
        "losses": losses,
        "seen": seen,
        "state": state,
        "data": (accelerator.data_parallel_rank, accelerator.data_parallel_size),
        "sliced": sorted(model.tensor_slices),
    }


def step_traffic(rank: int, world_size: int, stage: int) -> dict:
    """Bytes one train_batch step moves, counted where the engine and the tensor region call into
    torch.distributed, by collective and group (tensor 2 x data 2, fp32, one micro-batch of 2 sequences);
    and the sizes the analytic volumes need."""
    model = make_tnlg()
    config = ZeroConfig(stage=stage, reduce_bucket_size=500, param_persistence_threshold=40)
    engine = initialize(model, tnlg_optimizer(model), config, parallel=ParallelDims(tensor=2))
    ids, labels = tnlg_batches(1)[0]
    share = slice(2 * engine.parallel.rank("data"), 2 * engine.parallel.rank("data") + 2)
    micro = [{"input_ids": ids[share], "labels": labels[share]}]
    engine.train_batch(micro)  # warm-up: nothing left to build in the counted step
    names = {id(engine.parallel.group("tensor")): "tensor", id(engine.parallel.group("data")): "data"}
    with counted_traffic(names) as counted:
        engine.train_batch(micro)
    units = unit_sizes(engine)
    engine.close()
    return {"bytes": counted, "units": units, "tokens": ids[share].numel()}


def meta_tensor_data(rank: int, world_size: int, stage: int) -> dict:
    """The tiny TNLG model built on the meta device and initialized by the engine at tensor 2 x data 2:
    its consolidated state, to compare with the same seeded initialization of a whole model."""
    from tests.support.tensor_parallel_cases import make_config
    from tnlg.modeling import TNLGForCausalLM

    with torch.device("meta"):
        model = TNLGForCausalLM(make_config())
    engine = initialize(
        model, tnlg_optimizer(model), ZeroConfig(stage=stage), parallel=ParallelDims(tensor=2), init_seed=5
    )
    state = engine.full_state_dict()
    engine.close()
    return state
