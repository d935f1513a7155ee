"""``"npu_fsdp"``: the Trainer and Fabric adapters over one implementation of FSDP2 (``fully_shard``) with tensor,
context and expert parallelism (``lightning_npu.parallel`` applies them on one mesh), activation checkpointing,
mixed precision, CPU offload, hybrid sharding and torch distributed checkpoints.

torch_npu supports FSDP2 and DCP on Atlas A2/A3 but documents FSDP1's full-state APIs as unsupported,
so this builds on Lightning's FSDP2 ``ModelParallelStrategy`` rather than its ``FSDPStrategy``.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Mapping, Optional, Union

import torch
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.core.module import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_npu import compat
from lightning_npu.facts.options import (
    FSDPOptions,
    MeshLayout,
    check_option_names,
    constructor_signature,
    options_docstring,
)
from lightning_npu.parallel.fsdp import STEP_METHODS, reshard
from lightning_npu.parallel.mesh import ParallelMesh
from lightning_npu.parallel.parallelize import check_pipeline, parallelize
from lightning_npu.parallel.handle import ParallelModel, StateLayout
from lightning_npu.parallel.protocol import plan_of, resolve_parallel_plan
from lightning_npu.parallel.tensor import loss_parallel_if
from lightning_npu.precision import precision_name
from lightning_npu.strategies import initial_state
from lightning_npu.strategies.backward_sync import RestoresBackwardSync, gradients_unsynced
from lightning_npu.strategies.checkpoints.layout import directory_error, is_sharded_checkpoint
from lightning_npu.strategies.checkpoints.load import load_into, load_local_model_state
from lightning_npu.strategies.checkpoints.pipeline_state import full_model_state
from lightning_npu.strategies.checkpoints.save import (
    CheckpointWriter,
    optimizer_state_dict,
    split_fabric_state,
    trainer_tensors,
)
from lightning_npu.strategies.clean_exit import destroy_at_exit
from lightning_npu.strategies.common import BackendFromRuntime, as_timedelta, with_host_backend
from lightning_npu.strategies.fsdp1 import fsdp1_wrap_reported, refuse_fsdp1_apis, refuse_fsdp1_units
from lightning_npu.strategies.grad_norm import clip_grad_norm_, use_for_trainer_clipping
from lightning_npu.strategies.rebind import ReplacedParameters
from lightning_npu.strategies.sync_batchnorm import host_sync_batchnorm
from lightning_npu.strategies.user_parallelize import check_parallelize_fn, parallelize_with

# Lightning warns that any strategy overriding model_sharded_context cannot support `trainer.init_module()`;
# npu_fsdp shards and initialises models built there like any other (tests/strategies/test_compatibility.py).
warnings.filterwarnings("ignore", message=r"`trainer.init_module` cannot fully support .* `NPUFSDPStrategy`")


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
        with sharded_parameter_errors_explained(), loss_parallel_if(self._runs_loss_parallel):
            return getattr(super(NPUFSDPStrategy, self), name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


class _FSDPStrategyBase(BackendFromRuntime):
    """What the Trainer and Fabric FSDP strategies share: options, the mesh (``parallel_mesh``; ``device_mesh`` is
    its Lightning view), the sampler split, sharding a model.

    The constructor takes the options ``FSDPOptions`` declares (its signature and ``Args`` are generated from it).
    """

    options: FSDPOptions
    parallel_mesh: Optional[ParallelMesh] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_option_names(kwargs, type(self).__name__)
        self.options = FSDPOptions(*args, **kwargs)
        check_parallelize_fn(self.options)
        self._plan_function = resolve_parallel_plan(self.options.parallel_plan)
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
        # The model as parallelize left it (its parts, the pipeline's schedule, its state's layout); none yet.
        self._parallel = ParallelModel((), None, StateLayout(()))

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
        # Each data-parallel replica draws its own batches; the ranks of a tensor-, context- or pipeline-parallel
        # group share one.
        layout = self.layout
        return {"num_replicas": layout.data_parallel_size, "rank": layout.data_parallel_rank(self.global_rank)}

    @property
    def _runs_loss_parallel(self) -> bool:
        """Whether the steps run inside torch's ``loss_parallel()`` (vocabulary-split logits under tensor
        parallelism with ``loss_parallel=True``)."""
        return self.options.loss_parallel and self.layout.tp > 1

    @override
    def _configure_launcher(self) -> None:
        # Every process (the launching one first) passes here before any worker or process group starts: sizes the
        # devices cannot form fail here, with the numbers and the fix.
        layout = self.options.layout(self.num_nodes, self.num_processes)
        if self.options.sharding == "hybrid" and layout.cp > 1:  # ParallelMesh.fsdp joins two views
            compat.check_mesh_join("sharding='hybrid' with context_parallel_size")
        super()._configure_launcher()

    @property
    def _stages_group(self) -> Optional[Any]:
        """The pipeline's ranks, each holding other parameters (gradient clipping takes the norm over them); None
        without pipeline parallelism."""
        return None if self.parallel_mesh.pp is None else self.parallel_mesh.pp.get_group()

    def _reduce_group(self, group: Optional[Any]) -> Optional[Any]:
        """The group a reduction without one runs over: the ranks whose values differ (every rank, or outside a
        tensor-parallel group, whose members hold the same values)."""
        return group if group is not None else self.parallel_mesh.loss_group

    def _get_process_group_backend(self) -> str:
        backend = super()._get_process_group_backend()
        return with_host_backend(backend, self.root_device.type) if self.options.cpu_offload else backend

    def _setup_sharded_environment(self) -> None:
        self.accelerator.setup_device(self.root_device)
        _set_memory_fraction(self.options.memory_fraction, self.accelerator, self.root_device)
        compat.setup_distributed(self)
        self.parallel_mesh = ParallelMesh(self.root_device.type, self.layout, sharding=self.options.sharding,
                                          expert_parallel_size=self.options.expert_parallel_size)
        compat.set_device_mesh(self, self.parallel_mesh.lightning)
        destroy_at_exit(self.parallel_mesh.root)

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
            refuse_fsdp1_units(model)
            refuse_fsdp1_apis()
            if self.options.parallelize_fn is not None:  # the user's function shards (user_parallelize)
                order = tuple(name for name, _ in model.named_parameters())  # before its wrappers rename them
                parallelize_with(self.options.parallelize_fn, model, self.parallel_mesh.lightning, state)
                self._parallel = ParallelModel((model,), None, StateLayout(order, device=self.root_device))
            else:
                self._parallel = parallelize(model, self.parallel_mesh, self.options, precision_name(precision_plugin),
                                             plan_of(model, self._plan_function), step_methods, self.root_device)
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
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.options.pipeline_parallel_size > 1:
            compat.check_before_launch(self, self._check_split)

    def _check_split(self, module: Any) -> None:
        """A model that cannot be split into the pipeline's stages, refused before the other ranks start (each would
        fail alike, later). One built in ``configure_model`` does not exist yet: the same check runs on every rank
        when it is sharded."""
        if not is_overridden("configure_model", module, LightningModule):
            check_pipeline(module, self.options, plan_of(module, self._plan_function))

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
            if self.global_rank != 0 and self.parallel_mesh.tp is None:
                with torch.device("meta"):
                    yield
                return
            with initial_state.recording_built_parameters() as self._built_in_configure_model:
                yield

    @override
    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        check_callbacks(trainer.callbacks)
        # FSDP2's unshard on a one-rank shard group (pipeline or tensor parallelism without data parallelism, one
        # device) fails when the first forward runs under inference_mode: the all-gather output it allocates there
        # is an inference tensor, whose version counter it then preserves ("Inference tensors do not track version
        # counter"). Lightning evaluates under inference_mode on every backend but gloo, so on HCCL that would be
        # trainer.validate / test / predict from a checkpoint; no_grad costs nothing here.
        compat.evaluate_without_inference_mode(trainer)
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
        # Gradient clipping over parameters on several meshes (experts, tensor-parallel splits) and stages: grad_norm.
        use_for_trainer_clipping(self.precision_plugin, self._stages_group)

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

        if self._parallel.layout.split and not compat.saves_distributed_checkpoint(self):
            return full_model_state(self.model, self._parallel.layout)  # every stage's, onto global rank 0
        return get_model_state_dict(self.model, options=self._state_dict_options())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # A sharded checkpoint keys the state by parameter name (DCP matches names); a full one numbers the
        # parameters as optimizer.state_dict() does, as Lightning's FSDP strategies write it (without FSDP1 APIs).
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        reshard(self.model)  # after an evaluation forward the root holds gathered parameters, not the optimizer's
        return optimizer_state_dict(self.model, optimizer, self._state_dict_options(), self._parallel.layout)

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
        reshard(self.model)
        # Lightning restores optimizer states only to fit; evaluation needs the weights alone (which is all a
        # weights-only checkpoint holds).
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self.optimizers if fitting else []
        state = {"state_dict": self.model, **{f"optimizer_{i}": opt for i, opt in enumerate(optimizers)}}
        return load_into(path, state, strict=self.lightning_module.strict_loading, optimizer_states_from_list=True,
                         weights_only=weights_only, layout=self._parallel.layout)

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
        return clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite,
                               stages_group=self._stages_group)

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
        tensors, metadata = split_fabric_state(state, options.full_state_dict, filter, options.cpu_offload,
                                               layout=self._parallel.layout)
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
                reshard(item)
        if isinstance(state, nn.Module) and is_sharded_checkpoint(path):
            raise directory_error(path, "loading into a bare module (fabric.load_raw)")
        if isinstance(state, nn.Module) and self._parallel.layout.split:
            # Lightning's raw load broadcasts rank 0's tensors, which under a pipeline are its stages' only: each
            # rank takes its own stages' share of the file instead.
            load_local_model_state(state, torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only),
                                   strict=strict)
            return {}
        if not state and is_sharded_checkpoint(path):
            raise directory_error(path, "fabric.load(path) without a state to load into")
        if not isinstance(state, dict) or not state:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        return load_into(path, state, strict=strict, weights_only=weights_only, layout=self._parallel.layout)


def _set_memory_fraction(fraction: Optional[float], accelerator: Any, device: torch.device) -> None:
    """Cap this process's share of the device's memory (the ``memory_fraction`` option)."""
    if fraction is None:
        return
    runtime = getattr(accelerator, "runtime", None)
    if runtime is None:
        raise ValueError("memory_fraction needs accelerator='npu'")
    runtime.set_memory_fraction(fraction, device)


def _offload_parameters(model: nn.Module) -> None:
    """Move the sharded parameters to the host (CPU offload); buffers stay on the device, where forward runs."""
    buffers = [(module, name, buffer.device) for module in model.modules()
               for name, buffer in module.named_buffers(recurse=False)]
    model.to("cpu")
    for module, name, device in buffers:
        setattr(module, name, getattr(module, name).to(device))  # assigning a registered buffer keeps it one


__all__ = ["NPUFSDPStrategy", "NPUFabricFSDPStrategy"]
