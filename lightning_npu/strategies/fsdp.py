"""``"npu_fsdp"``: FSDP2 (``fully_shard``) applied by policy, with tensor and context parallelism, activation checkpointing,
mixed precision, CPU offload, hybrid sharding and torch distributed checkpoints, on one device mesh (``mesh``).

torch_npu supports FSDP2 and DCP on Atlas A2/A3 but documents FSDP1's full-state APIs as unsupported,
so this builds on Lightning's FSDP2 ``ModelParallelStrategy`` rather than its ``FSDPStrategy``.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Mapping, Optional, Union

import torch
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_npu import compat
from lightning_npu.facts.options import (
    FSDPChoices,
    MeshLayout,
    check_option_names,
    constructor_signature,
    options_docstring,
)
from lightning_npu.precision import mixed_precision_policy, precision_name
from lightning_npu.strategies import initial_state
from lightning_npu.strategies.backward_sync import RestoresBackwardSync, gradients_unsynced
from lightning_npu.strategies.checkpoints.layout import directory_error, is_sharded_checkpoint
from lightning_npu.strategies.checkpoints.load import load_into
from lightning_npu.strategies.checkpoints.save import (
    CheckpointWriter,
    optimizer_state_dict,
    split_fabric_state,
    trainer_tensors,
)
from lightning_npu.strategies.clean_exit import destroy_at_exit
from lightning_npu.strategies.common import BackendFromRuntime, as_timedelta, with_host_backend
from lightning_npu.strategies.fsdp1 import fsdp1_wrap_reported, refuse_fsdp1_units
from lightning_npu.strategies.expert_parallel import apply_expert_parallel, shard_experts
from lightning_npu.strategies.grad_norm import clip_grad_norm_, use_for_trainer_clipping
from lightning_npu.strategies.mesh import build_expert_mesh, build_mesh, fsdp_mesh
from lightning_npu.strategies.parallelize import (
    STEP_METHODS,
    apply_activation_checkpointing,
    apply_context_parallel,
    apply_fsdp,
    apply_tensor_parallel,
    fully_shard_options,
    import_tensor_parallel_plan,
    repeated_block_class,
    resolve_module_classes,
    resolve_tensor_parallel_plan,
    tensor_parallel_parameters,
)
from lightning_npu.strategies.rebind import ReplacedParameters
from lightning_npu.strategies.sync_batchnorm import host_sync_batchnorm

# Lightning warns that any strategy overriding model_sharded_context cannot support `trainer.init_module()`;
# npu_fsdp shards and initialises models built there like any other (tests/test_compatibility.py).
warnings.filterwarnings("ignore", message=r"`trainer.init_module` cannot fully support .* `NPUFSDPStrategy`")


@dataclass(frozen=True)
class FSDPOptions(FSDPChoices):
    """The options both FSDP strategies accept (``FSDPChoices`` declares them, the planner shares them), with the
    check that needs torch: a ``tensor_parallel_plan`` must import."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tensor_parallel_plan is not None:
            import_tensor_parallel_plan(self.tensor_parallel_plan)

    def parallelize(self, model: nn.Module, mesh: Any, precision: Optional[str], step_methods: Iterable[str] = (),
                    expert_mesh: Any = None) -> None:
        """Split ``model`` over the tensor-parallel ranks (by the plan), give its context-parallel modules the cp
        group, split its experts over the expert-parallel ranks (``expert_mesh``), checkpoint activations, then
        shard it: the experts, blocks by policy, then ``model`` as the root unit."""
        refuse_fsdp1_units(model)
        if self.tensor_parallel_size > 1:
            self._apply_tensor_parallel(model, mesh["tp"])
        if self.context_parallel_size > 1:
            self._apply_context_parallel(model, mesh["cp"])
        if self.expert_parallel_size > 1:
            split = apply_expert_parallel(model, expert_mesh["ep"])
            rank_zero_info(f"npu_fsdp: expert parallelism over {self.expert_parallel_size} ranks: the experts of"
                           f" {len(split)} modules split")
        ac_classes = resolve_module_classes(self.activation_checkpointing_policy, model, "activation_checkpointing_policy")
        checkpointed = apply_activation_checkpointing(model, ac_classes, float(self.activation_checkpointing_ratio))
        wrap_classes, chosen_by = self.wrap_classes(model)
        if self.expert_parallel_size > 1:
            shard_experts(model, expert_mesh["dp_shard_mod_ep"], expert_mesh.size(),
                          reshard_after_forward=self.reshard_after_forward,
                          **fully_shard_options(mesh, mixed_precision_policy(precision), self.cpu_offload))
        sharded = apply_fsdp(
            model,
            fsdp_mesh(mesh, self.sharding),
            wrap_classes=wrap_classes,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=mixed_precision_policy(precision),
            cpu_offload=self.cpu_offload,
            step_methods=step_methods,
        )
        rank_zero_info(
            f"npu_fsdp: {len(sharded)} FSDP units ({chosen_by}; zero_stage={self.zero_stage},"
            f" sharding={self.sharding!r}), activation checkpointing on {len(checkpointed)} modules"
        )

    def _apply_tensor_parallel(self, model: nn.Module, tp_mesh: Any) -> None:
        plan = resolve_tensor_parallel_plan(self.tensor_parallel_plan, model)
        planned = []
        if plan is not None:
            planned = apply_tensor_parallel(model, tp_mesh, plan, sequence_parallel=self.sequence_parallel,
                                            loss_parallel=self.loss_parallel)
        split = tensor_parallel_parameters(model)
        if not split:
            rank_zero_warn(
                f"npu_fsdp: tensor_parallel_size={self.tensor_parallel_size}, but no parameter is split over the"
                " tensor-parallel ranks, so each group of them computes the whole model on the same batch (correct"
                " results, no memory saved). Give tensor_parallel_plan (an import path), a tensor_parallel_plan(mesh,"
                " *, sequence_parallel, loss_parallel) method on the model, or shard it with parallelize_module on"
                " self.device_mesh['tensor_parallel'] in configure_model."
            )
        rank_zero_info(f"npu_fsdp: tensor parallelism over {tp_mesh.size()} ranks: {len(split)} parameters split"
                       f"{' (plan: ' + ', '.join(planned) + ')' if planned else ''}")

    def _apply_context_parallel(self, model: nn.Module, cp_mesh: Any) -> None:
        from lightning_npu.kernels.context_parallel import ContextParallel

        given = apply_context_parallel(model, ContextParallel(cp_mesh.get_group(), self.context_parallel_algo))
        if not given:
            rank_zero_warn(
                f"npu_fsdp: context_parallel_size={self.context_parallel_size}, but no module of the model declares a"
                " context_parallel attribute, so nothing splits the sequence: each group of context-parallel ranks"
                " computes the whole sequence of the same batch (correct results, no memory saved). Declare"
                " `context_parallel = None` on the modules that shard the batch (context_parallel.shard) and run"
                " attention (context_parallel.attention); see lightning_npu.kernels.context_parallel."
            )
        rank_zero_info(f"npu_fsdp: context parallelism ({self.context_parallel_algo}) over {cp_mesh.size()} ranks:"
                       f" {len(given)} modules split the sequence")

    def wrap_classes(self, model: nn.Module) -> tuple[tuple[type, ...], str]:
        """The block classes that become FSDP units, and how they were chosen (for the log).

        Without a policy, the repeated block (the class with several instances holding the most parameters);
        an explicit empty policy means a single unit."""
        if self.auto_wrap_policy is not None:
            classes = resolve_module_classes(self.auto_wrap_policy, model, "auto_wrap_policy")
            return classes, f"auto_wrap_policy={[cls.__name__ for cls in classes]}"
        block = repeated_block_class(model)
        if block is None:
            return (), "no repeated block found, so one unit; set auto_wrap_policy to choose blocks"
        return (block,), f"auto_wrap_policy chosen: {block.__name__}, the repeated block; pass auto_wrap_policy=[] for one unit"

    def set_memory_fraction(self, accelerator: Any, device: torch.device) -> None:
        if self.memory_fraction is None:
            return
        runtime = getattr(accelerator, "runtime", None)
        if runtime is None:
            raise ValueError("memory_fraction needs accelerator='npu'")
        runtime.set_memory_fraction(self.memory_fraction, device)


#: Set on a model this strategy has sharded.
_SHARDED_HERE = "_lightning_npu_sharded"

#: Callbacks that cannot work on sharded parameters, and what to do instead.
_UNSUPPORTED_CALLBACKS = {
    StochasticWeightAveraging: "it copies whole parameters between the model and an unsharded average",
    WeightAveraging: "it keeps an unsharded copy of the model (torch.optim.swa_utils.AveragedModel) and copies"
    " whole parameters between the two",
}


def check_callbacks(callbacks: Iterable[Any]) -> None:
    """Refuse, before training starts, callbacks that would fail on sharded (DTensor) parameters mid-run."""
    for callback in callbacks:
        for cls, reason in _UNSUPPORTED_CALLBACKS.items():
            if isinstance(callback, cls):
                raise ValueError(
                    f"{type(callback).__name__} cannot run under strategy='npu_fsdp': {reason}, and npu_fsdp's"
                    " parameters are sharded DTensors. Use strategy='npu_ddp' for weight averaging, or remove the"
                    " callback."
                )


@contextmanager
def sharded_parameter_errors_explained() -> Generator[None, None, None]:
    """Make code that mixes gathered and sharded parameters fail with the reason and the fix.

    Inside a step, the root unit's parameters are gathered (plain tensors) while every other unit's are sharded
    DTensors outside that unit's forward; code that combines them (an L2 penalty over ``self.parameters()``)
    fails deep in DTensor dispatch, in the step or in its backward.
    """
    try:
        yield
    except RuntimeError as error:
        if "mixed torch.Tensor and DTensor" not in str(error):
            raise
        raise RuntimeError(
            "the step combined parameters of different FSDP units: under strategy='npu_fsdp', parameters outside"
            " the running unit's forward are sharded DTensors (e.g. an L2 penalty summed over self.parameters()"
            " in training_step). Use the optimizer's weight_decay instead of an explicit penalty, compute it inside"
            f" the module's forward, or use strategy='npu_ddp'. The original error: {error}"
        ) from error


def _explained(name: str) -> Any:
    """A Trainer strategy method that runs Lightning's ``name`` with sharded-parameter errors explained (and inside
    ``loss_parallel()`` under tensor parallelism)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with sharded_parameter_errors_explained(), self._loss_parallel():
            return getattr(super(NPUFSDPStrategy, self), name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


class _FSDPStrategyBase(BackendFromRuntime):
    """What the Trainer and Fabric FSDP strategies share: options, mesh, sampler split, parameter device.

    The constructor takes the options ``FSDPChoices`` declares (its signature and ``Args`` are generated from it).
    """

    options: FSDPOptions
    device_mesh: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_option_names(kwargs, type(self).__name__)
        self.options = FSDPOptions(*args, **kwargs)
        timeout = as_timedelta(self.options.timeout)
        super().__init__(
            save_distributed_checkpoint=self.options.state_dict_type == "sharded",
            process_group_backend=self.options.process_group_backend,
            timeout=timeout,
            **self._base_kwargs(),
        )
        self._checkpoints = CheckpointWriter(self.options.async_save, timeout)
        # What rank 0's configure_model built (Trainer), and which parameters sharding replaced (Fabric).
        self._built_in_configure_model: Optional[initial_state.BuiltParameters] = None
        self._replaced = ReplacedParameters()
        self._expert_mesh: Optional[Any] = None  # the experts' mesh under expert parallelism (mesh.build_expert_mesh)

    __init__.__signature__ = constructor_signature()  # type: ignore[attr-defined]  # what LightningCLI reads
    __init__.__doc__ = options_docstring()

    def _base_kwargs(self) -> dict[str, Any]:
        return {}

    @property
    def layout(self) -> MeshLayout:
        """The sizes of this run's mesh dimensions (ValueError with the fix if the devices cannot form it)."""
        return self.options.layout(self.num_nodes, self.num_processes)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Each data-parallel replica draws its own batches; the ranks of a tensor- or context-parallel group share one.
        # Under plain sharding every rank is its own replica (ModelParallelStrategy's mesh would say otherwise).
        layout = self.layout
        if not layout.model_parallel:
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return {"num_replicas": layout.data_parallel_size, "rank": layout.data_parallel_rank(self.global_rank)}

    @override
    def _configure_launcher(self) -> None:
        # Every process (the launching one first) passes here before any worker or process group starts: sizes the
        # devices cannot form fail here, with the numbers and the fix.
        layout = self.options.layout(self.num_nodes, self.num_processes)
        if layout.model_parallel and self.options.expert_parallel_size > 1:  # mesh.build_expert_mesh unflattens
            compat.check_mesh_unflatten("expert_parallel_size with context_parallel_size")
        super()._configure_launcher()

    def _reduce_group(self, group: Optional[Any]) -> Optional[Any]:
        """The group a reduction without one runs over: every rank, or under tensor parallelism the ranks outside a
        tensor-parallel group (``dp x cp``), whose members hold the same values."""
        if group is None and self.layout.model_parallel:
            return self.device_mesh["data_parallel"].get_group()
        return group

    @contextmanager
    def _loss_parallel(self) -> Generator[None, None, None]:
        """torch's ``loss_parallel()`` under tensor parallelism with ``loss_parallel=True`` (a cross entropy of
        vocabulary-sharded logits, and its backward); nothing otherwise."""
        if self.options.tensor_parallel_size > 1 and self.options.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                yield
        else:
            yield

    def _get_process_group_backend(self) -> str:
        backend = super()._get_process_group_backend()
        return with_host_backend(backend, self.root_device.type) if self.options.cpu_offload else backend

    def _setup_sharded_environment(self) -> None:
        self.accelerator.setup_device(self.root_device)
        self.options.set_memory_fraction(self.accelerator, self.root_device)
        compat.setup_distributed(self)
        mesh = build_mesh(self.root_device.type, self.layout, self.options.sharding)
        compat.set_device_mesh(self, mesh)
        destroy_at_exit(mesh)
        if self.options.expert_parallel_size > 1:
            self._expert_mesh = build_expert_mesh(mesh, self.layout, self.options.expert_parallel_size)
            destroy_at_exit(self._expert_mesh)

    def _shard(self, model: nn.Module, precision_plugin: Any, step_methods: Iterable[str] = ()) -> None:
        """Shard ``model`` and give it the first values the user's code made (see ``initial_state``), once: a
        later stage of the same Trainer (``validate`` after ``fit``) finds it sharded and trained already."""
        if getattr(model, _SHARDED_HERE, False):
            return
        # The caller may be inside torch.inference_mode() (trainer.test from an evaluation script): the sharded
        # parameters made there would be inference tensors, which no checkpoint can be loaded into.
        with torch.inference_mode(False):
            host_sync_batchnorm(model, self.root_device)
            state = initial_state.capture(model, self._built_in_configure_model)
            self._built_in_configure_model = None
            self.options.parallelize(model, self.device_mesh, precision_name(precision_plugin), step_methods,
                                     self._expert_mesh)
            # Initialised on the mesh's device, whose generator DTensor offsets per rank, then offloaded.
            initial_state.apply(model, state, self.root_device)
            if self.options.cpu_offload:
                _offload_parameters(model)
        setattr(model, _SHARDED_HERE, True)

    # ---- checkpoints (lightning_npu.strategies.checkpoints does the work) ----

    def _state_dict_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # An async save copies the shards to host memory itself: offloading here first would copy them twice.
        offload = not (self._checkpoints.async_save and compat.saves_distributed_checkpoint(self))
        return StateDictOptions(full_state_dict=not compat.saves_distributed_checkpoint(self), cpu_offload=offload)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint (global rank 0), never before a save in flight has completed."""
        if self.global_rank == 0:
            self._checkpoints.remove(Path(filepath))

    def wait_for_checkpoint(self) -> None:
        """Block until the asynchronous save in flight is complete and visible; raises if it failed."""
        self._checkpoints.wait()

    def teardown(self) -> None:
        self._checkpoints.close()
        super().teardown()


class NPUFSDPStrategy(_FSDPStrategyBase, ModelParallelStrategy):
    """Trainer FSDP2 on NPUs. Every option is an explicit argument, so LightningCLI YAML can set it."""

    strategy_name = "npu_fsdp"

    @override
    def setup_environment(self) -> None:
        self._setup_sharded_environment()
        compat.set_device_mesh(self.lightning_module, self.device_mesh)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # configure_model builds the model for real on rank 0 only; the other ranks build it on the meta device
        # and receive rank 0's values after sharding, so one host copy exists and every rank starts alike.
        # (The meta device everywhere, and reset_parameters() after sharding, is the model's own opt-in.)
        # Under tensor parallelism every rank builds for real: parallelize_module in configure_model scatters rank
        # 0's values and needs every rank to take part (a rank on the meta device would leave rank 0 waiting).
        # Rank 0 remembers what it built, for modules the user shards there (see initial_state). FSDP1's wrap()
        # there is reported: it does nothing under FSDP2.
        with fsdp1_wrap_reported("configure_model"):
            if self.global_rank != 0 and not self.layout.model_parallel:
                with torch.device("meta"):
                    yield
                return
            with initial_state.recording_built_parameters() as self._built_in_configure_model:
                yield

    @override
    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        check_callbacks(trainer.callbacks)
        layer_sync = compat.layer_sync(self)
        if layer_sync is not None and not getattr(self.model, _SHARDED_HERE, False):
            # sync_batchnorm=True: before sharding, so FSDP shards the SyncBatchNorm modules; in whichever stage
            # shards first (a sharded model cannot be converted later; Lightning's strategies convert when fitting).
            self.model = layer_sync.apply(self.model)
        # Cast before sharding: a dtype cast of sharded parameters has no DTensor rule on NPU.
        self.model = self.precision_plugin.convert_module(self.model)
        self._shard(self.model, self.precision_plugin, STEP_METHODS)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Gradient clipping over parameters on several meshes (experts, tensor-parallel splits): see grad_norm.
        use_for_trainer_clipping(self.precision_plugin)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Gradient accumulation: reduce only in the micro-batch that steps (Lightning's base handles DDP only).
        with gradients_unsynced(self.model):
            yield

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return super().reduce(tensor, self._reduce_group(group), reduce_op)

    # Lightning's step and backward methods, with sharded-parameter errors explained.
    training_step = _explained("training_step")
    validation_step = _explained("validation_step")
    test_step = _explained("test_step")
    predict_step = _explained("predict_step")
    backward = _explained("backward")

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=self._state_dict_options())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # A sharded checkpoint keys the state by parameter name (DCP matches names); a full one numbers the
        # parameters as optimizer.state_dict() does, as Lightning's FSDP strategies write it (without FSDP1 APIs).
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        _reshard(self.model)  # after an evaluation forward the root holds gathered parameters, not the optimizer's
        return optimizer_state_dict(self.model, optimizer, self._state_dict_options())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (it uses no CheckpointIO)")
        path = Path(self.broadcast(filepath))
        if compat.saves_distributed_checkpoint(self):
            self._checkpoints.save_sharded(self, path, trainer_tensors(checkpoint), checkpoint)
        else:
            self._checkpoints.save_full(self, path, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        self._checkpoints.recover_path(self, path)
        _reshard(self.model)
        # Lightning restores optimizer states only to fit; evaluation needs the weights alone (which is all a
        # weights-only checkpoint holds).
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self.optimizers if fitting else []
        state = {"state_dict": self.model, **{f"optimizer_{i}": opt for i, opt in enumerate(optimizers)}}
        return load_into(path, state, strict=self.lightning_module.strict_loading, optimizer_states_from_list=True,
                         weights_only=weights_only)

    @override
    def on_train_end(self) -> None:
        # The last save of the run is complete and visible before fit() returns.
        self._checkpoints.wait()
        self.barrier()


class NPUFabricFSDPStrategy(_FSDPStrategyBase, RestoresBackwardSync, FabricModelParallelStrategy):
    """Fabric FSDP2 on NPUs; same options as :class:`NPUFSDPStrategy`. ``fabric.setup(model)`` shards ``model``."""

    def _base_kwargs(self) -> dict[str, Any]:
        # Fabric's ModelParallelStrategy requires a parallelize function; setup_module below does the work.
        return {"parallelize_fn": lambda module, mesh: module}

    @override
    def setup_environment(self) -> None:
        self._setup_sharded_environment()

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> Any:
        stack = super().module_init_context(empty_init)
        stack.enter_context(fsdp1_wrap_reported("fabric.init_module()"))
        return stack

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if not compat.has_device_mesh(self):
            # A Fabric made in a process another Fabric launched (`fabric._launched = True`, as Lightning's own FSDP
            # tests do) never ran setup_environment: the process group exists, this strategy's mesh does not.
            self._setup_sharded_environment()
        before = ReplacedParameters.before(module)
        self._shard(module, self.precision)
        self._replaced.record(module, before)
        return module

    @override
    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return super().all_reduce(tensor, self._reduce_group(group), reduce_op)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        # Fabric's calls torch's clip_grad_norm_, which fails for parameters on several meshes (see grad_norm).
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # An optimizer made from the unsharded model (fabric.setup(model, optimizer)) steps the sharded parameters.
        self._replaced.rebind(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (it uses no CheckpointIO)")
        if filter is not None and compat.saves_distributed_checkpoint(self):
            raise NotImplementedError(
                f"fabric.save(..., filter=...) cannot write a sharded checkpoint (nothing was written to {path}): npu_fsdp"
                " reads sharded checkpoints back whole, as a resumable state. For a filtered file, use"
                " NPUFabricFSDPStrategy(state_dict_type='full') (rank 0 writes one file with the kept entries); or save"
                " without filter= and keep what you need afterwards: `lightning-npu consolidate DIR FILE` writes one"
                " file to filter, and fabric.load(DIR, state) restores only the objects named in state."
            )
        path = Path(self.broadcast(path))
        options = self._state_dict_options()
        tensors, metadata = split_fabric_state(state, options.full_state_dict, filter, options.cpu_offload)
        if compat.saves_distributed_checkpoint(self):
            self._checkpoints.save_sharded(self, path, tensors, metadata)
        else:
            self._checkpoints.save_full(self, path, {**tensors, **metadata})

    @override
    def load_checkpoint(
        self, path: Any, state: Optional[Union[nn.Module, Optimizer, Mapping[str, Any]]] = None, strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        path = Path(self.broadcast(path))
        self._checkpoints.recover_path(self, path)
        for item in (state.values() if isinstance(state, Mapping) else [state]):
            if isinstance(item, nn.Module):
                _reshard(item)
        if isinstance(state, nn.Module) and is_sharded_checkpoint(path):
            raise directory_error(path, "loading into a bare module (fabric.load_raw)")
        if not state and is_sharded_checkpoint(path):
            raise directory_error(path, "fabric.load(path) without a state to load into")
        if not isinstance(state, dict) or not state:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        return load_into(path, state, strict=strict, weights_only=weights_only)


def _reshard(model: nn.Module) -> None:
    """Register every FSDP unit's sharded parameters again: the root unit keeps its parameters gathered after an
    evaluation forward (no backward reshards them), and a checkpoint must load into the shards."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _offload_parameters(model: nn.Module) -> None:
    """Move the sharded parameters to the host (CPU offload); buffers stay on the device, where forward runs."""
    buffers = [(module, name, buffer.device) for module in model.modules()
               for name, buffer in module.named_buffers(recurse=False)]
    model.to("cpu")
    for module, name, device in buffers:
        setattr(module, name, getattr(module, name).to(device))  # assigning a registered buffer keeps it one


__all__ = ["FSDPOptions", "NPUFSDPStrategy", "NPUFabricFSDPStrategy"]
