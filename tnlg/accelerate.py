"""`ZeroAccelerator`: an `accelerate.Accelerator` whose model and optimizer are sharded by tnlg's ZeRO engine.

The standard Accelerate loop runs unchanged:

    acc = ZeroAccelerator(zero_config=ZeroConfig(stage=3), mixed_precision="bf16", gradient_accumulation_steps=4)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

`prepare` hands the model and its optimizer to `tnlg.sharding.initialize` (no DDP wrapper) and
returns the engine as the model; the optimizer comes back wrapped so that it steps only at
accumulation boundaries, and data loaders and schedulers go through Accelerate as usual.
Mixed precision is the engine's (16-bit parameters, fp32 master weights, its own loss scaling),
not autocast and a GradScaler layered on top: `mixed_precision` is read as Accelerate reads it (the
keyword, else `ACCELERATE_MIXED_PRECISION` from `accelerate launch` / `accelerate config`), and a
`GradScalerKwargs` handler sets the engine's fp16 loss scaler (init_scale, growth_interval).
`clip_grad_norm_` follows [Note: one clipping value] in tnlg/sharding/optimizer.py: a configured
`gradient_clipping` governs, and a call with another finite max_norm is an error.

Selecting the engine from a launch: without `zero_config`, the environment decides:
`TNLG_ZERO_CONFIG` (a DeepSpeed-style JSON or a ZeroConfig JSON), else `TNLG_ZERO_STAGE` (with
optional `TNLG_ZERO_GRADIENT_CLIPPING`, `TNLG_ZERO_OVERLAP_COMM`, and `TNLG_ZERO_OFFLOAD_OPTIMIZER` /
`TNLG_ZERO_OFFLOAD_PARAM` set to `cpu` for ZeRO-Offload). With neither, it is exactly an `Accelerator`.

A DeepSpeed JSON's training keys, as Accelerate's own DeepSpeed integration treats them: the
Accelerator drives gradient accumulation (`accumulate()`, `no_sync`, an optimizer wrapper that steps
at boundaries), so it adopts the JSON's `gradient_accumulation_steps` when it was given none, refuses
a different one, and the engine accumulates nothing itself; the batch keys are checked against the
data-parallel size (`data_parallel_size`: replicas, not tensor slices or pipeline stages), as DeepSpeed
multiplies them; an `optimizer` section, or a `scheduler` section next to a scheduler passed to `prepare`,
is an error naming both (the objects passed to `prepare` are the ones trained with). A `scheduler`
section alone is built by the engine over your optimizer and stepped with it.

Checkpoints (`save_state`) and saved models (`save_model`) go to storage every node shares:
`ProjectConfiguration(save_on_each_node=True)` with processes on more than one node is refused (see
tnlg/shared_storage.py); on one node it changes nothing and is accepted.

torch.compile: Accelerate's `dynamo_backend` / `dynamo_plugin` (or `accelerate launch --dynamo_backend
inductor`) compiles each block of the model inside the engine, never the whole model (see [Note:
compiled blocks] in tnlg/sharding/compile.py); `compile_config=CompileConfig(...)` says the same
directly, with a cache directory besides.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import TorchDynamoPlugin, recursively_apply
from torch import nn

from tnlg.checkpoint_naming import checkpoints_root, newest_checkpoint, next_checkpoint, remove_beyond_limit
from tnlg.launch_settings import (
    accelerate_parallelism_hidden,
    accumulation_taken_over,
    compile_config_for,
    from_environment,
    given_accumulation,
    launch_mixed_precision,
    parallel_dims_for,
    refuse_another_state_precision,
    refuse_environment_beside,
    settings_from_environment,
    with_grad_scaler_kwargs,
    zero_config_from_environment,
)
from tnlg.modeling.loading import write_checksums
from tnlg.sharding import CompileConfig, DeepSpeedConfig, ParallelDims, ZeroConfig, ZeroEngine, initialize
from tnlg.sharding.checkpoint import CheckpointError, engine_directory, read_on_every_rank
from tnlg.sharding.collectives import Collectives
from tnlg.sharding.consolidate import write_shards
from tnlg.sharding.deepspeed import engine_settings
from tnlg.sharding.parallel import build_groups
from tnlg.shared_storage import count_nodes, refuse_node_local_saves
from tnlg.state_files import (
    custom_state_files,
    dataloader_state_files,
    rank_state_file,
    read_custom_states,
    read_dataloader_states,
    read_rank_state,
    read_scheduler_states,
    restore_dataloaders,
    restore_rng,
    scheduler_state_files,
    stateful_dataloaders,
    write_rank_state,
    write_state_files,
)

__all__ = ["AcceleratedEngineOptimizer", "EngineOptimizer", "ZeroAccelerator", "zero_config_from_environment"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer face of a `ZeroEngine`: `step` runs the sharded step, `zero_grad` the engine's.

    `param_groups` are the user's optimizer's own (rebuilt over the shards), so learning-rate
    schedulers and logging read and turn the real knobs.
    """

    def __init__(self, engine: ZeroEngine):
        self.engine = engine
        self.optimizer = engine.base_optimizer
        self.defaults = self.optimizer.defaults

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        if closure is not None:
            raise ValueError(
                "the ZeRO engine's step takes no closure: compute the loss before calling step()"
            )
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        # The engine shards, reduces and zeroes the groups it was built with; a group added afterwards
        # would be stepped by the optimizer but never reduced or zeroed (its .grad grew step after step).
        raise RuntimeError(
            "add_param_group on an optimizer the ZeRO engine shards: the engine reduces and zeroes only the "
            "groups it was built with; give the optimizer every group before accelerator.prepare(), or make "
            "the tensor a parameter of the model"
        )

    @property
    def step_was_skipped(self) -> bool:
        return self.engine.step_was_skipped

    def state_dict(self) -> dict:
        raise RuntimeError("the optimizer state is sharded: save it with accelerator.save_state()")

    def load_state_dict(self, state_dict: dict) -> None:
        raise RuntimeError("the optimizer state is sharded: load it with accelerator.load_state()")


class AcceleratedEngineOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper (steps only at accumulation boundaries) that reports the
    engine's overflow skips, so `accelerator.optimizer_step_was_skipped` holds the scheduler back."""

    @property
    def step_was_skipped(self) -> bool:
        return self.optimizer.step_was_skipped


def _log_fused_kernels_under_compile(model: nn.Module) -> None:
    """Say once that a TNLG model's fused Triton kernels give way to inductor inside compiled blocks."""
    choice = getattr(getattr(model, "config", None), "fused_kernels", "none")
    if choice != "none":
        logger.info(
            "compile: inside the compiled blocks inductor fuses torch's ops itself, so fused_kernels=%r "
            "applies outside them only (the output layer and loss; see tnlg.modeling.fused_ops.use_block_kernel)",
            choice,
        )


class ZeroAccelerator(Accelerator):
    """An `Accelerator` that shards the prepared model and optimizer with tnlg's ZeRO engine."""

    def __init__(
        self,
        *args: Any,
        zero_config: ZeroConfig | DeepSpeedConfig | Mapping | str | Path | None = None,
        parallel: ParallelDims | None = None,
        compile_config: CompileConfig | None = None,
        **kwargs: Any,
    ):
        given = inspect.signature(Accelerator.__init__).bind_partial(None, *args, **kwargs).arguments
        mixed_precision, named = launch_mixed_precision(given)
        accumulation = given_accumulation(given)
        auto = {"mixed_precision": mixed_precision} if mixed_precision else {}
        if accumulation is not None:
            auto["gradient_accumulation_steps"] = accumulation
        if zero_config is not None and not from_environment(zero_config):  # ZeroTrainer passes those on
            refuse_environment_beside(
                "ZeroAccelerator(zero_config=...)", "leave zero_config out to take the variable's"
            )
        settings = (
            settings_from_environment(auto) if zero_config is None else engine_settings(zero_config, **auto)
        )
        # The engine settings (with a DeepSpeed JSON's training part) and their ZeroConfig.
        self.zero_settings = (
            with_grad_scaler_kwargs(
                settings.with_mixed_precision(mixed_precision, named), given
            ).with_checked_dtypes()
            if settings is not None
            else None
        )
        self.zero_config = self.zero_settings.zero if self.zero_settings is not None else None
        if self.zero_config is not None and not torch.cuda.is_available():
            kwargs.setdefault("cpu", True)  # CPU processes on gloo
        # Accelerate's ParallelismConfig (or its launcher's environment) is the engine's to apply: Accelerate
        # itself takes one only with FSDP or DeepSpeed, and would refuse it on CPU processes.
        self.parallel_dims = None
        if self.zero_config is not None:
            self.parallel_dims = parallel_dims_for(parallel, kwargs.pop("parallelism_config", None))
        elif parallel is not None:
            raise ValueError("parallel= needs the ZeRO engine on (zero_config or TNLG_ZERO_* settings)")
        with accelerate_parallelism_hidden(self.parallel_dims is not None):
            super().__init__(*args, **kwargs)
        self.num_nodes = 1  # the machines the processes are on (their host names)
        if self.zero_config is not None:
            refuse_another_state_precision(self.mixed_precision, mixed_precision)
            self.num_nodes = count_nodes()  # collective: every rank, before any group is built
            self._refuse_node_local_saves()
        self.parallel_groups = None
        if self.parallel_dims is not None:
            # The data degree, known before any group is built: the batch keys below are checked against it,
            # and a refusal must come before a collective (a rank that raises mid-build strands the others).
            self.parallel_dims = self.parallel_dims.resolve(self.num_processes)
        if self.zero_settings is not None:
            self.scaler = (
                None  # the engine scales fp16 losses itself; a GradScaler on top would be dead state
            )
            # DeepSpeed's train_batch_size counts data-parallel replicas, not tensor slices or stages.
            self.zero_settings, self.gradient_accumulation_steps = accumulation_taken_over(
                self.zero_settings, accumulation, self.gradient_accumulation_steps, self.data_parallel_size
            )
        if self.parallel_dims is not None:
            # The (pipeline, data, tensor) grid, under Accelerate's mesh names: its data loaders then give a
            # tensor group the same batches (see [Note: parallel layout] in sharding/parallel.py).
            self.parallel_groups = build_groups(self.parallel_dims, self.device.type)
            self.parallel_dims = self.parallel_groups.dims
            self.state.device_mesh = self.parallel_groups.mesh
        self.engines: list[ZeroEngine] = []
        # The engine compiles the blocks itself: prepare() never reaches Accelerate's whole-model compile.
        self.compile_config = None
        if self.zero_config is not None:
            self.compile_config = compile_config_for(compile_config, self.state.dynamo_plugin)
            # Taken over: Accelerate's own prepare_model (which the Trainer calls for an evaluation
            # before training, say) must not compile the whole model around the engine's blocks.
            self.state.dynamo_plugin = TorchDynamoPlugin(backend="no")
        elif compile_config is not None:
            raise ValueError("compile_config= needs the ZeRO engine on (zero_config or TNLG_ZERO_* settings)")

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        if self.zero_config is None:
            return super().prepare(*args, device_placement=device_placement)
        self._refuse_a_second_scheduler(args)
        models = [i for i, a in enumerate(args) if isinstance(a, nn.Module)]
        optimizers = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
        if not models and not optimizers:  # data loaders, schedulers: Accelerate's own handling
            return super().prepare(*args, device_placement=device_placement)
        spec = self.zero_settings.training.optimizer
        if spec is not None:
            passed = f"a {type(args[optimizers[0]]).__name__}" if optimizers else "none"
            raise ValueError(
                f"{self.zero_settings.source} has an optimizer section ({spec.type}) and prepare() takes the "
                f"optimizer as an object (it was given {passed}): remove the section and pass your optimizer, or "
                "train with tnlg.sharding.initialize(model, None, config), which builds it"
            )
        if len(models) != 1 or len(optimizers) != 1:
            raise ValueError(
                f"ZeroAccelerator.prepare shards one model with its optimizer: got {len(models)} models and "
                f"{len(optimizers)} optimizers"
            )
        engine, wrapped_optimizer = self.prepare_engine(args[models[0]], args[optimizers[0]])
        prepared: list[Any] = list(args)
        prepared[models[0]], prepared[optimizers[0]] = engine, wrapped_optimizer
        rest = [i for i in range(len(args)) if i not in (models[0], optimizers[0])]
        if rest:
            others = super().prepare(*(args[i] for i in rest))
            others = others if isinstance(others, tuple) else (others,)
            for i, obj in zip(rest, others, strict=True):
                prepared[i] = obj
        return tuple(prepared) if len(prepared) > 1 else prepared[0]

    def prepare_engine(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        init_seed: int = 0,
        pretrained: str | Path | None = None,
    ) -> tuple[ZeroEngine, AcceleratedOptimizer]:
        """`prepare(model, optimizer)` with the engine's own choices spelled out: a meta-device `model` is
        materialized shard by shard from `pretrained` (a Transformers checkpoint directory; each rank
        reads only its slices) or else from the seeded initialization `init_seed` (see
        tnlg.sharding.initialize). Returns the engine (the prepared model) and its optimizer."""
        if self.zero_config is None:
            raise RuntimeError(
                "prepare_engine needs the ZeRO engine on (zero_config or TNLG_ZERO_* settings)"
            )
        open_engines = [engine for engine in self.engines if not engine.closed]
        self.engines = open_engines  # a closed one (engine.close() by hand) must not stay the first
        if open_engines:
            # backward, clipping and save_state act on the one engine: a second would train unclipped and
            # go unsaved. Accelerate under DeepSpeed refuses a second model alike.
            raise RuntimeError(
                "ZeroAccelerator trains one model with the ZeRO engine at a time, and one is prepared already: "
                "call accelerator.free_memory() (which closes its engine) before preparing another model"
            )
        if not any(p.is_meta for p in model.parameters()):
            model = model.to(self.device)
        engine = initialize(
            model,
            optimizer,
            self.zero_settings,
            init_seed=init_seed,
            pretrained=pretrained,
            parallel=self.parallel_groups,  # the grid built at __init__: no second set of groups
            compile_config=self.compile_config,
        )
        if self.compile_config is not None:
            _log_fused_kernels_under_compile(model)
        self.engines.append(engine)
        self._models.append(engine)
        wrapped_optimizer = AcceleratedEngineOptimizer(
            EngineOptimizer(engine), device_placement=False, scaler=None
        )
        self._optimizers.append(wrapped_optimizer)
        return engine, wrapped_optimizer

    def free_memory(self, *objects: Any):
        """Accelerate's, with the engines closed and dropped first (as Accelerate destroys its DeepSpeed
        engine): their buffers are freed, using them afterwards raises, and the next prepare() builds a
        new engine. (Kept, backward, clipping and save_state went on acting on the first one.)"""
        for engine in self.engines:
            engine.close()
        self.engines = []
        return super().free_memory(*objects)

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        """Accelerate's for an evaluation-only model (the Trainer's, before training); a model to train goes
        through prepare(model, optimizer), which shards it: here it would be wrapped in DDP unsharded."""
        if self.zero_config is not None and not evaluation_mode:
            raise RuntimeError(
                "prepare_model trains a model under DDP, not the ZeRO engine: call "
                "accelerator.prepare(model, optimizer), which shards both (evaluation_mode=True is taken)"
            )
        return super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        if self.zero_config is not None:
            raise RuntimeError(
                "prepare_optimizer would step an unsharded optimizer beside the ZeRO engine: call "
                "accelerator.prepare(model, optimizer), which shards both"
            )
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel rank: which share of the data it reads (the process index
        without tensor slicing or pipeline stages, whose ranks read the same data)."""
        return self.parallel_groups.rank("data") if self.parallel_groups is not None else self.process_index

    @property
    def data_parallel_size(self) -> int:
        """How many shares the data is cut into (the number of processes without tensor slicing or
        pipeline stages)."""
        return self.parallel_dims.data if self.parallel_dims is not None else self.num_processes

    def prepare_data_loader(
        self, data_loader: torch.utils.data.DataLoader, device_placement=None, slice_fn_for_dispatch=None
    ):
        """Accelerate's, except under pipeline stages: Accelerate shards a loader by its mesh's tensor and data
        dimensions only, which would give the ranks of a later stage shares past the last data rank. There the
        loader is sharded by data rank, so that a pipeline group (and each tensor group in it) reads the
        same batches."""
        if self.parallel_dims is None or self.parallel_dims.pipeline == 1:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        if self.dispatch_batches:
            raise ValueError(
                "dispatch_batches=True sends process 0's batches to every process, but under pipeline stages the "
                "batches are shared by data rank: leave dispatch_batches unset (each data rank reads its share)"
            )
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.data_parallel_size,
            process_index=self.data_parallel_rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=False,
            even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
        )
        self._dataloaders.append(prepared)
        return prepared

    @property
    def engine(self) -> ZeroEngine:
        """The engine `prepare` built (one model per accelerator under ZeRO)."""
        if not self.engines:
            raise RuntimeError("no model has been prepared with the ZeRO engine yet")
        return self.engines[0]

    def _refuse_a_second_scheduler(self, args: tuple[Any, ...]) -> None:
        section = self.zero_settings.training.scheduler
        passed = [a for a in args if isinstance(a, torch.optim.lr_scheduler.LRScheduler)]
        if section is not None and passed:
            raise ValueError(
                f"{self.zero_settings.source} has a scheduler section ({section.type}) and prepare() was given "
                f"a {type(passed[0]).__name__}: keep one of them"
            )

    def _engine_of(self, model: Any) -> ZeroEngine | None:
        if isinstance(model, ZeroEngine):
            return model
        return next((e for e in self.engines if e.module is model), None)

    # ------------------------------------------------------------------ training loop
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if not self.engines:
            return super().backward(loss, **kwargs)
        # The engine's backward takes the loss alone: it scales it (fp16) and its hooks reduce each gradient
        # as the pass produces it, so a retained graph, higher-order gradients or a partial backward
        # (`inputs`) cannot go through it. Refused by name rather than dropped (the default values pass).
        given = [name for name, value in kwargs.items() if value is not None and value is not False]
        if given:
            raise ValueError(
                f"ZeroAccelerator.backward(loss, {', '.join(f'{name}=...' for name in given)}): the ZeRO engine's "
                "backward takes the loss alone and cannot pass "
                f"{', '.join(given)} on; call accelerator.backward(loss) (for a second backward, run the forward again)"
            )
        self.engines[0].backward(loss / self.gradient_accumulation_steps)

    @contextlib.contextmanager
    def no_sync(self, model):
        engine = self._engine_of(model)
        if engine is None:
            with super().no_sync(model):
                yield
            return
        with engine.no_sync():
            yield

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Accelerate's, except that under tensor slicing or pipeline stages it gathers over the data-parallel
        group only: the ranks of a tensor (or pipeline) group read the same samples, so gathering over
        every process would return each sample once per such rank."""
        if self.parallel_groups is None or self.data_parallel_size == self.num_processes:
            return super().gather_for_metrics(input_data, use_gather_object)
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        except TypeError:  # not all tensors: gathered as objects, as Accelerate does
            use_gather_object = True
        data = _gather_over(self.parallel_groups.data, input_data, use_gather_object)
        # Accelerate's rule for the last batch: the samples the sampler repeated to even it out are dropped
        # (remainder: the dataset's length modulo the batch over the data-parallel ranks).
        remainder = self.gradient_state.remainder
        if not self.gradient_state.end_of_dataloader or remainder <= 0:
            return data
        if use_gather_object:
            return data[:remainder]
        return recursively_apply(lambda tensor: tensor[:remainder], data)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        if not self.engines:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if norm_type != 2:
            raise ValueError(f"the ZeRO engine clips the L2 norm; norm_type={norm_type} is not supported")
        return torch.tensor(self.engines[0].clip_grad_norm_(max_norm))

    # ------------------------------------------------------------------ models and state
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        engine = self._engine_of(model)
        if engine is not None:
            return engine.module
        return super().unwrap_model(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )

    def get_state_dict(self, model, unwrap: bool = True):
        """The consolidated state dict on the main process (every process must call it); an empty one
        there is an error, so that nothing built on it writes a model without weights."""
        engine = self._engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap=unwrap)
        state = engine.full_state_dict()
        if self.is_main_process and not state:
            raise RuntimeError(
                "the consolidated state dict is empty: refusing to write a model without weights"
            )
        return state

    def save_state(
        self, output_dir: str | Path | None = None, safe_serialization: bool = True, **kwargs: Any
    ):
        """Every rank writes its engine shard, its rank state (RNG states, `accelerator.step`) and its
        state of each stateful data loader (`use_stateful_dataloader`); the main process the schedulers
        and the objects registered with `register_for_checkpointing` (tensors in safetensors, the rest
        JSON: no pickles). The layout of a run checkpoint (see tnlg.state_files). Without `output_dir`,
        Accelerate's automatic checkpoint naming places it (see tnlg.checkpoint_naming).
        `register_save_state_pre_hook` hooks run first, given the prepared models and, as under
        Accelerate's DeepSpeed, no weights: the engine writes its own shards."""
        if not self.engines:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        self._refuse_node_local_saves()
        naming = self.project_configuration.automatic_checkpoint_naming
        if naming and output_dir is not None:
            raise ValueError(
                f"save_state({str(output_dir)!r}) with automatic_checkpoint_naming on: the checkpoint goes to "
                "project_dir/checkpoints/checkpoint_<iteration>; call save_state() without a directory, or "
                "turn automatic_checkpoint_naming off to name it"
            )
        if not naming and output_dir is None:
            raise ValueError(
                "ZeroAccelerator.save_state needs an output_dir (or automatic_checkpoint_naming)"
            )
        root = checkpoints_root(self.project_dir) if naming else None
        # Every rank agrees on the folder before any creates it: one seeing another's new folder as an
        # existing checkpoint would refuse alone and leave the others waiting.
        directory = (
            self._on_every_rank(lambda: next_checkpoint(root, self.save_iteration))
            if naming
            else Path(output_dir)
        )
        try:
            self._save_engine_state(directory)
        except Exception:
            # A refused or failed save (agreed on every rank) leaves no checkpoint_N behind that the next
            # save would call existing, load_state() the newest, or total_limit a checkpoint.
            if naming and self.is_main_process:
                shutil.rmtree(directory, ignore_errors=True)
            raise
        if naming and self.is_main_process:
            remove_beyond_limit(root, self.project_configuration.total_limit, directory)
        self.project_configuration.iteration += 1  # as Accelerate counts its saves, named or not
        return str(directory)

    def _save_engine_state(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)

        def prepare() -> dict[str, bytes]:
            for hook in self._save_model_state_pre_hook.values():
                hook(self._models, [], str(directory))
            files = dataloader_state_files(stateful_dataloaders(self._dataloaders), self.process_index)
            if self.is_main_process:
                files.update(
                    {**scheduler_state_files(self._schedulers), **custom_state_files(self._custom_objects)}
                )
            return files

        # Everything that can fail on one process alone (a hook, a state_dict that JSON and safetensors
        # cannot hold) fails on every process before the engine writes a byte; the writes after it agree too.
        files = self._on_every_rank(prepare)
        self.engines[0].save_checkpoint(engine_directory(directory))  # collective

        def write() -> None:
            write_rank_state(directory, self.process_index, accelerator_step=self.step)
            write_state_files(directory, files)

        self._on_every_rank(write)

    def load_state(self, input_dir: str | Path | None = None, **kwargs: Any) -> None:
        """What `save_state` wrote, restored: the engine's shards, the schedulers, the registered objects,
        this rank's RNG states, `accelerator.step` and its stateful data loaders' positions. Without
        `input_dir`, automatic checkpoint naming's newest checkpoint, after which the iteration continues
        (see tnlg.checkpoint_naming). `register_load_state_pre_hook` hooks run first, given (as under
        Accelerate's DeepSpeed) no models to load: the engine loads its own shards."""
        if not self.engines:
            return super().load_state(input_dir, **kwargs)
        if input_dir is not None:
            directory, iteration = Path(input_dir), None
        elif self.project_configuration.automatic_checkpoint_naming:
            iteration, directory = self._newest_checkpoint_everywhere(checkpoints_root(self.project_dir))
        else:
            raise ValueError("ZeroAccelerator.load_state needs an input_dir (or automatic_checkpoint_naming)")
        loaders = stateful_dataloaders(self._dataloaders)

        def read_states() -> tuple[list[dict], list[Any], dict[str, Any], dict[int, Any]]:
            for hook in self._load_model_state_pre_hook.values():
                hook([], str(directory))
            schedulers = read_scheduler_states(directory, len(self._schedulers))
            customs = read_custom_states(directory, len(self._custom_objects))
            own = read_rank_state(directory, self.process_index)
            return (
                schedulers,
                customs,
                own,
                read_dataloader_states(directory, list(loaders), self.process_index),
            )

        # As a run checkpoint's resume: every file is read, and every rank agrees it could be, before
        # anything is restored (no rank left waiting in the engine's load for one that failed).
        schedulers, customs, own, loader_states = self._on_every_rank(read_states)
        self.engines[0].load_checkpoint(engine_directory(directory))
        for scheduler, state in zip(self._schedulers, schedulers, strict=True):
            scheduler.load_state_dict(state)
        for obj, state in zip(self._custom_objects, customs, strict=True):
            obj.load_state_dict(state)
        restore_dataloaders(loaders, loader_states, directory)
        restore_rng(own["rng"])
        self._restore_step(own, rank_state_file(directory, self.process_index))
        if iteration is not None:
            self.project_configuration.iteration = iteration + 1

    def _newest_checkpoint_everywhere(self, root: Path) -> tuple[int, Path]:
        """The newest checkpoint_<N> in `root`, the same on every rank: ranks that see different newest
        folders (a store not shared between nodes, a save still being pruned) would load different states."""
        iteration, directory = self._on_every_rank(lambda: newest_checkpoint(root))
        seen = sorted({int(n) for n in Collectives().all_gather_object(iteration)})
        if len(seen) > 1:
            raise CheckpointError(
                f"the ranks see different newest checkpoints in {root} (checkpoint_{seen[0]} ... "
                f"checkpoint_{seen[-1]}): give load_state the directory to load"
            )
        return iteration, directory

    def _restore_step(self, own: Mapping[str, Any], path: Path) -> None:
        """`accelerator.step` (the accumulation counter) as saved; a file from before it was saved has none."""
        if "accelerator_step" in own:
            self.step = int(own["accelerator_step"])
        else:
            logger.warning(
                "%s holds no accelerator step (saved before save_state kept it): accelerator.step stays %d",
                path,
                self.step,
            )

    def _refuse_node_local_saves(self) -> None:
        """Accelerate's save_on_each_node asks each node's first process to write the shared files to storage
        only that node reads, which tnlg's checkpoints do not implement (see tnlg/shared_storage.py)."""
        if self.project_configuration.save_on_each_node:
            refuse_node_local_saves("ProjectConfiguration(save_on_each_node=True)", self.num_nodes)

    def _on_every_rank(self, work: Callable[[], T]) -> T:
        """`work()` on this process, then every process agrees it succeeded everywhere (over the world, not
        the engine's data group): a failure on one (a user's hook or state_dict included) raises on all, so
        none is left waiting in a collective."""
        return read_on_every_rank(Collectives(), work)

    def save_model(
        self,
        model,
        save_directory: str | Path,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """A Transformers-style sharded safetensors model (shards of at most `max_shard_size` with their index,
        or one model.safetensors) written by the main process. Safetensors only: safe_serialization=False,
        Accelerate's pickled .bin files, is refused rather than ignored."""
        engine = self._engine_of(model)
        if engine is None:
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        self._refuse_node_local_saves()
        if not safe_serialization:
            raise ValueError(
                "save_model(safe_serialization=False) asks for pickled .bin files: a ZeRO engine's model is "
                "saved as safetensors only (no pickles); leave safe_serialization at True"
            )
        state = self.get_state_dict(engine)  # collective: every rank takes part
        if self.is_main_process:
            module = engine.module
            if hasattr(module, "save_pretrained"):
                module.save_pretrained(save_directory, state_dict=state, max_shard_size=max_shard_size)
            else:
                directory = Path(save_directory)
                sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in state.items()}
                written = write_shards(directory, list(state), state.__getitem__, sizes, max_shard_size)
                write_checksums(directory, [path.name for path in written if path.suffix == ".safetensors"])
        self.wait_for_everyone()


def _gather_over(group: dist.ProcessGroup, data: Any, as_objects: bool) -> Any:
    """`data` from every rank of `group`, concatenated along the first dimension (tensors; equal shapes,
    as Accelerate's gather needs) or as one flat list (objects, as Accelerate's gather_object)."""
    size = dist.get_world_size(group)
    if as_objects:
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, data, group=group)
        return [item for part in parts for item in part]

    def gather_one(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.reshape(1) if tensor.ndim == 0 else tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(pieces, tensor, group=group)
        return torch.cat(pieces)

    return recursively_apply(gather_one, data, error_on_other_type=True)
