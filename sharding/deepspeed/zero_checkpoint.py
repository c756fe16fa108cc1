"""DeepSpeed ZeRO checkpoints, as DeepSpeed's `engine.save_checkpoint` writes them, read into whole
tensors by parameter name: the fp32 masters, Adam's moments and step, the loss scale and the step count.

[Note: DeepSpeed ZeRO checkpoint layout] (DeepSpeed 0.19; what the fixtures in tests/assets/deepspeed show)
    DIR/latest                                   the tag, as plain text (e.g. `global_step3`)
    DIR/<tag>/mp_rank_00_model_states.pt         stage 1-2: the module's 16-bit (or fp32) weights,
                                                 `param_shapes` (one ordered {name: shape} per param
                                                 group), `shared_params` (tied aliases), `global_steps`,
                                                 `dp_world_size`, `lr_scheduler`, `ds_config`
    DIR/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: the same, one per rank, weights empty
    DIR/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   rank R's `optimizer_state_dict`: a
                                                 ZeRO optimizer's (with its `zero_stage`), or at stage 1
                                                 in bf16 with fp32 gradient accumulation BF16_Optimizer's
                                                 (no `zero_stage`, no loss scaler; ZeRO-1's partitions)
The Transformers Trainer's DeepSpeed integration passes its `checkpoint-N/` as DIR, so its layout is
`checkpoint-N/latest` and `checkpoint-N/global_stepN/`: the same files one level down. Saved without
ZeRO (stage 0, fp32 or fp16), mp_rank_00_model_states.pt holds the optimizer itself, `param_shapes` is
None and there are no optim_states files: not read (`_refuse_without_zero`).

How a rank's flat fp32 partition maps to parameters (the same for Adam's moments, which follow it):
- stage 1-2: each param group's parameters, in `param_shapes` order, are one flat buffer cut into
  `dp_world_size` equal partitions, padded at the end (`single_partition_of_fp32_groups[g]` is rank
  R's); the whole group is the ranks' partitions end to end.
- stage 3: every parameter is cut on its own into `dp_world_size` pieces of ceil(numel / world)
  elements (the last padded), and rank R's `fp32_flat_groups` hold its piece of each parameter in
  `param_shapes` order: parameter p's rank-R piece starts where the earlier parameters' pieces end.

Files are read with `torch.load(weights_only=True)`: DeepSpeed's own classes in them (`ZeroStageEnum`,
`LossScaler`, `fragment_address`) are rebuilt as inert records (`inert_globals`), DeepSpeed is never
imported, and any other class is refused by name. Every rank reads every optimizer file (as
DeepSpeed's zero_to_fp32 does): host memory holds the whole fp32 state once per reading process.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tnlg.modeling.loading import inert_globals

from ..checkpoint import ENGINE_DIRECTORY
from ..checkpoint_files import MANIFEST, CheckpointError

LATEST = "latest"
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
PIPELINE_LAYER = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")  # DeepSpeed's pipeline engine
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class DeepSpeedZeroState:
    """A whole DeepSpeed ZeRO checkpoint: every tensor whole, by the module's parameter names."""

    directory: Path  # the tag directory the files are in
    stage: int
    world_size: int
    global_steps: int
    group_names: list[list[str]]  # param group -> its parameters, in DeepSpeed's order
    masters: dict[str, torch.Tensor]  # fp32
    moments: dict[str, dict[str, torch.Tensor]]  # "exp_avg" / "exp_avg_sq" -> name -> fp32 tensor
    adam_steps: list[int]  # per param group
    param_groups: list[dict[str, Any]]  # the base optimizer's hyperparameters per group
    shared: dict[str, str] = field(default_factory=dict)  # a tied alias -> the parameter it is
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_scale: float = 1.0
    # Whether DeepSpeed's fp16 loss scaler was dynamic; None: not an fp16 run (bf16 or fp32)
    loss_scale_dynamic: bool | None = None
    # A dynamic scaler's position, as tnlg's LossScaler counts it (see `_loss_scaler`); None: not saved
    loss_scale_clean_steps: int | None = None
    loss_scale_overflows_left: int | None = None
    lr_scheduler: dict[str, Any] | None = None


def deepspeed_tag_directory(path: str | Path) -> Path | None:
    """The directory holding a DeepSpeed checkpoint's rank files, from the save directory (its `latest`
    names the tag) or the tag directory itself; None when `path` is neither."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / LATEST).is_file():
        tag = (path / LATEST).read_text().strip()
        if tag.startswith("{"):  # a tnlg run's own `latest` pointer (JSON), not DeepSpeed's plain tag
            return None
        if not tag or "/" in tag or "\\" in tag:
            raise CheckpointError(f"{path / LATEST} should name a DeepSpeed checkpoint tag, got {tag!r}")
        tagged = path / tag
        if not tagged.is_dir():
            raise CheckpointError(f"{path / LATEST} names tag {tag!r}, but {tagged} is not a directory")
        return tagged
    names = [entry.name for entry in path.iterdir()]
    return path if any(OPTIM_STATES.match(name) or MODEL_STATES.match(name) for name in names) else None


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a DeepSpeed checkpoint's save or tag directory (one whose `latest` names a tag
    that is not there is still DeepSpeed's, unless the directory holds engine checkpoints: then its
    `latest` is a damaged tnlg pointer), for errors where a tnlg checkpoint was expected."""
    try:
        return deepspeed_tag_directory(path) is not None
    except CheckpointError:
        return not _holds_engine_checkpoints(Path(path))


def _holds_engine_checkpoints(path: Path) -> bool:
    """Whether `path` holds tnlg engine checkpoints (a run's `step-N/engine/manifest.json`)."""
    return any(child.is_dir() and (child / ENGINE_DIRECTORY / MANIFEST).is_file() for child in path.iterdir())


def _is_tnlg_pointer(path: Path) -> bool:
    """Whether `path/latest` is a tnlg run's pointer (JSON), not DeepSpeed's plain tag."""
    pointer = path / LATEST
    return pointer.is_file() and pointer.read_text().strip().startswith("{")


def read_deepspeed_checkpoint(path: str | Path) -> DeepSpeedZeroState:
    """Read a DeepSpeed ZeRO stage 1, 2 or 3 checkpoint (`path`: the save directory or the tag
    directory) into whole tensors. A checkpoint this cannot read faithfully is refused by name."""
    directory = deepspeed_tag_directory(path)
    if directory is None:
        if Path(path).is_dir() and _is_tnlg_pointer(Path(path)):
            raise CheckpointError(
                f"{path} is a tnlg run's checkpoints (its `{LATEST}` is tnlg's pointer), not a DeepSpeed "
                "checkpoint: convert it with --from zero"
            )
        raise CheckpointError(
            f"{path} is not a DeepSpeed checkpoint: no `{LATEST}` file and no *_model_states.pt"
        )
    names = sorted(entry.name for entry in directory.iterdir())
    if any(PIPELINE_LAYER.match(name) for name in names):
        raise CheckpointError(
            f"{directory} was written by DeepSpeed's pipeline engine (layer_*-model_states.pt): only ZeRO "
            "data-parallel checkpoints are read; consolidate it with DeepSpeed first"
        )
    model_files = {name: MODEL_STATES.match(name) for name in names if MODEL_STATES.match(name)}
    if any(int(match.group(2)) != 0 for match in model_files.values()):
        raise CheckpointError(
            f"{directory} holds several model-parallel ranks (mp_rank_01 ...): DeepSpeed checkpoints with "
            "tensor parallelism are not read; only ZeRO data-parallel ones"
        )
    first = next((name for name in model_files if name.startswith("zero_pp_rank_0_")), None)
    first = first or ("mp_rank_00_model_states.pt" if "mp_rank_00_model_states.pt" in model_files else None)
    if first is None:
        raise CheckpointError(f"{directory} has no mp_rank_00_model_states.pt (nor rank 0's zero_pp one)")
    model = _load(directory / first)
    world = _integer(model, "dp_world_size", directory / first)
    _refuse_without_zero(directory / first, model, names)
    optimizer_files = _optimizer_files(directory, names, world)
    states = [_load(directory / name).get("optimizer_state_dict") for name in optimizer_files]
    for name, state in zip(optimizer_files, states, strict=True):
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{directory / name} has no optimizer_state_dict: not a ZeRO optimizer file"
            )
    stage = _saved_stage(states[0], directory / optimizer_files[0])
    shapes = model.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(group, dict) for group in shapes):
        raise CheckpointError(f"{directory / first} has no param_shapes list: not a ZeRO model-states file")
    if model.get("frozen_param_shapes"):
        raise CheckpointError(
            f"{directory / first} has frozen parameters {sorted(model['frozen_param_shapes'])[:5]}: "
            "checkpoints of partly frozen models are not read"
        )
    group_names = [list(group) for group in shapes]
    shape_of = {name: tuple(int(n) for n in shape) for group in shapes for name, shape in group.items()}
    sizes = {name: math.prod(shape) for name, shape in shape_of.items()}
    if stage == 3:
        masters, moments, base = _stage3(states, group_names, sizes, world, directory)
    else:
        masters, moments, base = _stage1_2(states, group_names, sizes, directory)
    masters = {name: tensor.reshape(shape_of[name]) for name, tensor in masters.items()}
    moments = {
        key: {name: tensor.reshape(masters[name].shape) for name, tensor in by_name.items()}
        for key, by_name in moments.items()
    }
    module = model.get("module") or {}
    return DeepSpeedZeroState(
        directory=directory, stage=stage, world_size=world,
        global_steps=_integer(model, "global_steps", directory / first), group_names=group_names,
        masters=masters, moments=moments, adam_steps=base["steps"], param_groups=base["param_groups"],
        shared=dict(model.get("shared_params") or {}),
        buffers={name: module[name] for name in model.get("buffer_names") or [] if name in module},
        **_loss_scaler(states[0].get("loss_scaler"), _fp16_run(model, optimizer_files[0])),
        lr_scheduler=model.get("lr_scheduler"),
    )  # fmt: skip


# ---------------------------------------------------------------------------- the two layouts
def _stage1_2(states, group_names, sizes, directory):
    """Stage 1-2: a group is its ranks' partitions end to end, its parameters consecutive in it."""
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {key: {} for key in ADAM_KEYS}
    bases = [_base_optimizer(state, directory) for state in states]
    unstepped = _unstepped(bases, directory)
    partitions = [_list(state, "single_partition_of_fp32_groups", directory) for state in states]
    for group_index, names in enumerate(group_names):
        paddings = [
            state.get("param_alignment_paddings", [[]] * len(group_names))[group_index] for state in states
        ]
        if any(any(int(p) for p in padding) for padding in paddings):
            raise CheckpointError(
                f"{directory}: param group {group_index} pads between parameters (param_alignment_paddings): "
                "that layout is not read"
            )
        if any(group_index >= len(groups) for groups in partitions):
            raise CheckpointError(
                f"{directory}: single_partition_of_fp32_groups has fewer groups than the model states' "
                f"{len(group_names)}"
            )
        flat = torch.cat([groups[group_index] for groups in partitions])
        group_moments = {
            key: torch.zeros_like(flat)
            if unstepped
            else torch.cat([_moment(base["state"], group_index, key, directory) for base in bases])
            for key in ADAM_KEYS
        }
        offset = 0
        for name in names:
            size = sizes[name]
            if offset + size > flat.numel():
                raise CheckpointError(
                    f"{directory}: param group {group_index} holds {flat.numel()} elements, fewer than its "
                    "parameters need: the optimizer files do not match the model states"
                )
            masters[name] = flat[offset : offset + size].clone()
            for key in ADAM_KEYS:
                moments[key][name] = group_moments[key][offset : offset + size].clone()
            offset += size
    return masters, moments, _steps_and_groups(bases[0])


def _stage3(states, group_names, sizes, world, directory):
    """Stage 3: each parameter cut on its own into `world` pieces of ceil(numel / world) elements."""
    flats = [torch.cat(_list(state, "fp32_flat_groups", directory)) for state in states]
    bases = [_base_optimizer(state, directory) for state in states]
    unstepped = _unstepped(bases, directory)
    rank_moments = [
        {
            key: torch.zeros_like(flat)
            if unstepped
            else torch.cat([_moment(base["state"], index, key, directory) for index in sorted(base["state"])])
            for key in ADAM_KEYS
        }
        for flat, base in zip(flats, bases, strict=True)
    ]
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {key: {} for key in ADAM_KEYS}
    offset = 0
    for name in (name for names in group_names for name in names):
        size = sizes[name]
        piece = -(-size // world)
        if any(offset + piece > flat.numel() for flat in flats):
            raise CheckpointError(
                f"{directory}: a rank's fp32_flat_groups end before {name}'s piece: the optimizer files do "
                "not match the model states"
            )
        masters[name] = torch.cat([flat[offset : offset + piece] for flat in flats])[:size].clone()
        for key in ADAM_KEYS:
            moments[key][name] = torch.cat([m[key][offset : offset + piece] for m in rank_moments])[
                :size
            ].clone()
        offset += piece
    return masters, moments, _steps_and_groups(bases[0])


# ---------------------------------------------------------------------------- the files' parts
def _load(path: Path) -> dict[str, Any]:
    safe = inert_globals(path, lambda name: name.startswith("deepspeed."))
    try:
        with torch.serialization.safe_globals(safe):
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"{path} cannot be read safely with torch.load(weights_only=True) (only tensors, plain "
            f"containers and DeepSpeed's own records are allowed): {error}"
        ) from error
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a DeepSpeed state dict")
    return loaded


def _refuse_without_zero(model_file: Path, model: dict[str, Any], names: list[str]) -> None:
    """Name a checkpoint DeepSpeed saved without ZeRO as such: it has no optimizer files by design, and
    "no optimizer file for rank(s) ..." would send its owner looking for files that never existed."""
    if model.get("param_shapes") is not None or any(OPTIM_STATES.match(name) for name in names):
        return
    raise CheckpointError(
        f"{model_file.parent} is not a ZeRO checkpoint: DeepSpeed saved it without ZeRO (stage 0; its "
        f"optimizer is inside {model_file.name}, param_shapes is None, there is no *_optim_states.pt). Only "
        "ZeRO stage 1-3 checkpoints are read, from their fp32 masters; reading or converting a stage-0 one "
        f"is not supported (its module's weights, in the training dtype, are the `module` entry of "
        f"{model_file.name})"
    )


def _optimizer_files(directory: Path, names: list[str], world: int) -> list[str]:
    by_rank: dict[int, str] = {}
    for name in names:
        match = OPTIM_STATES.match(name)
        if match:
            by_rank[int(match.group(1))] = name
    missing = [rank for rank in range(world) if rank not in by_rank]
    if missing:
        raise CheckpointError(
            f"{directory} was saved by {world} data-parallel ranks but has no optimizer file for rank(s) "
            f"{missing} (zero_pp_rank_R_mp_rank_00_optim_states.pt)"
        )
    extra = sorted(rank for rank in by_rank if rank >= world)
    if extra:
        raise CheckpointError(
            f"{directory} has optimizer files for ranks {extra} beyond its dp_world_size {world}"
        )
    return [by_rank[rank] for rank in range(world)]


# What DeepSpeed's BF16_Optimizer saves instead of a ZeRO optimizer's zero_stage and loss scaler.
_BF16_OPTIMIZER_KEYS = frozenset(
    (
        "clip_grad",
        "base_optimizer_state",
        "single_partition_of_fp32_groups",
        "group_paddings",
        "partition_count",
    )
)


def _saved_stage(state: dict[str, Any], path: Path) -> int:
    """The ZeRO stage an optimizer file was saved at: its `zero_stage`, or 1 for DeepSpeed's BF16_Optimizer,
    which saves none. DeepSpeed takes that optimizer for bf16 at ZeRO stage 1 with fp32 gradient
    accumulation (`data_types.grad_accum_dtype`); its fp32 partitions are laid out as ZeRO-1's."""
    if "zero_stage" not in state and state.keys() >= _BF16_OPTIMIZER_KEYS:
        return 1
    return _stage(state.get("zero_stage"), path)


def _stage(value: Any, path: Path) -> int:
    """`zero_stage`: DeepSpeed's ZeroStageEnum (an IntEnum, rebuilt inert with its value as args[0])."""
    stage = value.args[0] if hasattr(value, "args") and value.args else value
    if not isinstance(stage, int) or stage not in (1, 2, 3):
        raise CheckpointError(f"{path}: zero_stage {stage!r} is not a ZeRO stage 1, 2 or 3")
    return stage


def _fp16_run(model: dict[str, Any], optimizer_file: str) -> bool:
    """Whether the run trained in fp16: not when its files are named bf16_* (DeepSpeed's mark of a bf16
    run), else as the ds_config saved in the model states says; a checkpoint without one counts as fp16
    where it saved a loss scaler (`_loss_scaler` then reads the scaler as it is)."""
    config = model.get("ds_config")
    if optimizer_file.startswith("bf16_"):
        return False
    if not isinstance(config, dict):
        return True
    fp16 = config.get("fp16")
    return isinstance(fp16, dict) and fp16.get("enabled") is True


def _loss_scaler(value: Any, fp16: bool) -> dict[str, Any]:
    """DeepSpeed's saved fp16 scaler as `loss_scale` and `loss_scale_dynamic` (its `dynamic`: True for
    DynamicLossScaler, False for the static one), and a dynamic one's position on its path as tnlg's
    LossScaler counts it (`loss_scale_clean_steps`, `loss_scale_overflows_left`), so that the resumed
    scale grows and halves at the steps DeepSpeed's would (see [Note: DeepSpeed's scaler position]);
    bf16 and fp32 runs save a static scale of 1 that scales nothing: scale 1, None."""
    state = getattr(value, "state", None)
    if not fp16 or not (isinstance(state, dict) and "cur_scale" in state):
        return {"loss_scale": 1.0, "loss_scale_dynamic": None}
    scaler = {
        "loss_scale": float(state["cur_scale"]),
        "loss_scale_dynamic": bool(state.get("dynamic", True)),
    }
    keys = ("cur_iter", "last_overflow_iter", "scale_window", "cur_hysteresis")
    counters = [state.get(key) for key in keys]
    if scaler["loss_scale_dynamic"] and all(isinstance(n, int) for n in counters):
        updates, last_overflow, window, hysteresis_left = counters
        clean = updates - last_overflow - 1
        if clean < 0 or window < 1 or hysteresis_left < 1:
            return scaler  # not a position DeepSpeed's update reaches: the engine's fresh one is kept
        # [Note: DeepSpeed's scaler position]
        # DeepSpeed counts the updates since the last overflow (`clean`, none at the start: its last
        # overflow is -1) and doubles at the clean update after `window`, 2 `window`, ... of them.
        # tnlg's LossScaler doubles once its clean_steps reach its window and starts again from 0.
        # With clean_steps `(clean - 1) % window` (-1 before any clean update) its next doubling
        # falls on DeepSpeed's next; the hysteresis left is the same count on both sides. Under
        # loss_scale_counting "deepspeed" (a DeepSpeed JSON's) the later ones do too: its count
        # restarts at -1 after an overflow, as this one does here ([Note: loss-scale counting]).
        scaler["loss_scale_clean_steps"] = (clean - 1) % window if clean else -1
        scaler["loss_scale_overflows_left"] = hysteresis_left
    return scaler


def _base_optimizer(state: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The wrapped optimizer's torch state dict (stage 1-2: `base_optimizer_state`, stage 3:
    `optimizer_state_dict`); DeepSpeed before the dict form saved stage 1-2's as a list of per-group states."""
    base = state.get("base_optimizer_state", state.get("optimizer_state_dict"))
    if isinstance(base, list):
        base = {"state": dict(enumerate(base)), "param_groups": []}
    if not isinstance(base, dict) or not isinstance(base.get("state"), dict):
        raise CheckpointError(f"{directory}: an optimizer file holds no base optimizer state")
    for index, entry in base["state"].items():
        unknown = sorted(set(entry) - {"step", *ADAM_KEYS})
        if unknown or not all(key in entry for key in ADAM_KEYS):
            raise CheckpointError(
                f"{directory}: optimizer state {index} has keys {sorted(entry)}: only Adam's (step, exp_avg, "
                "exp_avg_sq) are read"
            )
    return base


def _unstepped(bases: list[dict[str, Any]], directory: Path) -> bool:
    """Whether Adam has not stepped yet: no rank holds any optimizer state. An fp16 run whose every
    step so far overflowed saves it so (torch's Adam makes its state at the first step it applies), and
    its moments and step are a fresh Adam's, zeros. Some ranks with state and others without is a
    damaged checkpoint."""
    empty = [rank for rank, base in enumerate(bases) if not base["state"]]
    if empty and len(empty) < len(bases):
        raise CheckpointError(
            f"{directory}: the optimizer files of ranks {empty} hold no Adam state and the others' do: "
            "the rank files are not of one save"
        )
    return bool(empty)


def _moment(state: dict[Any, Any], index: int, key: str, directory: Path) -> torch.Tensor:
    entry = state.get(index)
    if entry is None:
        raise CheckpointError(f"{directory}: no optimizer state for flat group {index}")
    return entry[key].reshape(-1).float()


def _list(state: dict[str, Any], key: str, directory: Path) -> list[torch.Tensor]:
    value = state.get(key)
    if not isinstance(value, list) or not all(isinstance(t, torch.Tensor) for t in value):
        raise CheckpointError(f"{directory}: an optimizer file has no {key} list of tensors")
    return [t.reshape(-1).float() for t in value]


def _steps_and_groups(base: dict[str, Any]) -> dict[str, Any]:
    """Adam's step per flat group, and the param groups' hyperparameters (their `params` dropped)."""
    steps = []
    for index in sorted(base["state"]):
        step = base["state"][index].get("step", 0)
        steps.append(int(step.item() if isinstance(step, torch.Tensor) else step))
    param_groups = [
        {k: v for k, v in group.items() if k != "params"} for group in base.get("param_groups") or []
    ]
    return {"steps": steps, "param_groups": param_groups}


def _integer(state: dict[str, Any], key: str, path: Path) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{path}: {key} should be a non-negative integer, got {value!r}")
    return value
