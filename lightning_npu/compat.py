"""The one module that touches Lightning's and torch's private names.

Lightning 2.6 gives a third-party accelerator its registries and nothing more, so the plugin reads and wraps
a few private connector methods and strategy attributes, and reuses some private checkpoint helpers; torch's
FSDP2 has setters but no getters for its gradient-sync flags. Every such name is listed in ``FENCED`` and
resolved when this module is imported: a Lightning or torch release that renamed one makes ``import`` fail
here with an ImportError naming each missing name, the supported versions and the installed ones, instead of
a bare AttributeError deep inside a run. The rest of the package uses only the names and small accessors
below (``tests/package/test_compat.py`` checks that no other module spells a Lightning or torch private name).

The supported versions are the ``torch`` / ``lightning`` ranges of ``pyproject.toml`` (read from the source
checkout, else from the installed package metadata, which is built from it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import CodeType
from typing import Any, Callable, Iterable, Optional

DISTRIBUTION = "lightning-npu"
#: The distributions whose private names are fenced here, as named in pyproject.toml's dependencies.
FRAMEWORKS = ("torch", "lightning")


@dataclass(frozen=True)
class Fenced:
    """One private name: ``name`` on ``owner`` (a module path, or ``module:Class`` for a class).

    ``instance``: an attribute Lightning's code sets on instances (``self._timeout = ...``), so it is checked
    by looking for it in the class's own code, not on the class. Several ``name`` alternatives (``a|b``) mean
    that torch versions differ and the first one present is used.
    """

    owner: str
    name: str
    instance: bool = False

    @property
    def qualified(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"

    def resolve(self, import_module: Callable[[str], Any] = importlib.import_module) -> Any:
        """The object (or, for an instance attribute, the name present); raises LookupError if it is missing."""
        module_name, _, class_name = self.owner.partition(":")
        try:
            owner = import_module(module_name)
            if class_name:
                owner = getattr(owner, class_name)
        except (ImportError, AttributeError) as error:
            raise LookupError(f"{self.owner.replace(':', '.')} ({error})") from None
        for name in self.name.split("|"):
            if self.instance and name in code_names(owner):
                return name
            if not self.instance and hasattr(owner, name):
                return getattr(owner, name)
        raise LookupError(self.qualified)


def code_names(cls: type) -> set[str]:
    """Every attribute name the code of ``cls`` and its bases reads or assigns (``co_names``, nested code too)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names.update(vars(klass))
        for value in vars(klass).values():
            for function in (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                             getattr(value, "fset", None)):
                stack = [getattr(function, "__code__", None)]
                while stack:
                    code = stack.pop()
                    if isinstance(code, CodeType):
                        names.update(code.co_names)
                        stack.extend(const for const in code.co_consts if isinstance(const, CodeType))
    return names


_TRAINER_CONNECTOR = "lightning.pytorch.trainer.connectors.accelerator_connector:_AcceleratorConnector"
_FABRIC_CONNECTOR = "lightning.fabric.connector:_Connector"
_TRAINER_DDP = "lightning.pytorch.strategies:DDPStrategy"
_FABRIC_DDP = "lightning.fabric.strategies:DDPStrategy"
_TRAINER_FSDP2 = "lightning.pytorch.strategies:ModelParallelStrategy"
_FABRIC_FSDP2 = "lightning.fabric.strategies:ModelParallelStrategy"
_TRAINER_FSDP1 = "lightning.pytorch.strategies:FSDPStrategy"
_FABRIC_FSDP1 = "lightning.fabric.strategies:FSDPStrategy"
_FSDP2_MODULE = "torch.distributed.fsdp:FSDPModule"
_FSDP2_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState"
_FSDP2_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup"
_DEVICE_MESH = "torch.distributed.device_mesh:DeviceMesh"

#: Private names whose values the package uses, by the name it uses them under.
IMPORTED = {
    "TrainerConnector": Fenced("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector"),
    "FabricConnector": Fenced("lightning.fabric.connector", "_Connector"),
    "SignalConnector": Fenced("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector"),
    "CheckpointConnector": Fenced("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector"),
    "TrainingEpochLoop": Fenced("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop"),
    # The launcher that starts a Trainer's other ranks (npu_fsdp checks a pipelined model before it does).
    "SubprocessScriptLauncher": Fenced("lightning.pytorch.strategies.launchers.subprocess_script",
                                       "_SubprocessScriptLauncher"),
    "BackwardSyncControl": Fenced("lightning.fabric.strategies.strategy", "_BackwardSyncControl"),
    "has_dtensor_modules": Fenced("lightning.fabric.strategies.model_parallel", "_has_dtensor_modules"),
    "load_raw_module_state": Fenced("lightning.fabric.strategies.model_parallel", "_load_raw_module_state"),
    "apply_filter": Fenced("lightning.fabric.strategies.strategy", "_apply_filter"),
    "validate_keys_for_strict_loading": Fenced("lightning.fabric.strategies.strategy", "_validate_keys_for_strict_loading"),
    "LIGHTNING_METADATA_FILENAME": Fenced("lightning.fabric.utilities.load", "_METADATA_FILENAME"),
    "move_state_into": Fenced("lightning.fabric.utilities.load", "_move_state_into"),
    "load_distributed_checkpoint": Fenced("lightning.fabric.utilities.load", "_load_distributed_checkpoint"),
    "Stateful": Fenced("lightning.fabric.utilities.types", "_Stateful"),
    "default_process_group_backend_for_device": Fenced(
        "lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"),
    # Recomputes a module's activations in backward while keeping its parameter names (checkpoints unchanged).
    "composable_checkpoint": Fenced("torch.distributed._composable", "checkpoint"),
    # What torch's checkpoint_wrapper / apply_activation_checkpointing wrap a module in.
    "CheckpointWrapper": Fenced("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointWrapper"),
    # Loads a DCP checkpoint without knowing its keys up front (the recipe's checkpoint reader).
    "EmptyStateDictLoadPlanner": Fenced("torch.distributed.checkpoint.default_planner", "_EmptyStateDictLoadPlanner"),
    # DCP's loader with ``no_dist``: reads a checkpoint in one process without a process group.
    "dcp_load_state_dict": Fenced("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict"),
    # The names DCP's state-dict API gives a parameter (without wrapper prefixes such as torch.compile's).
    "dcp_parameter_fqns": Fenced("torch.distributed.checkpoint.state_dict", "_get_fqns"),
}

#: Connector methods ``connectors.py`` wraps (same name on the Trainer's and Fabric's connector).
CHOOSE_STRATEGY = "_choose_strategy"
CHECK_STRATEGY_AND_FALLBACK = "_check_strategy_and_fallback"
CHECK_AND_INIT_PRECISION = "_check_and_init_precision"
#: The first check of the arguments, where Lightning refuses a precision it does not know.
CHECK_CONFIG = "_check_config_and_set_final_flags"
#: The connector's choice for ``accelerator="auto"`` (tpu, mps, cuda, else cpu), which ``connectors.py`` extends to
#: the NPUs (a static method on both connectors).
CHOOSE_AUTO_ACCELERATOR = "_choose_auto_accelerator"
#: Connector method choosing the cluster environment (TorchElastic -> SLURM -> LSF -> MPI), which
#: ``lightning_patches/cluster.py`` wraps to try the Ascend ones in their places.
CHOOSE_CLUSTER_ENVIRONMENT = "_choose_and_init_cluster_environment"

#: The training loop's per-batch broadcast of Lightning's SIGTERM flag, which ``preemption.py`` skips for NPU strategies.
BROADCAST_SIGTERM = "_broadcast_sigterm_tensor"
#: The checkpoint connector's property naming the ``hpc_ckpt_N.ckpt`` a run under SLURM resumes from by itself,
#: which ``preemption.py`` replaces for NPU strategies.
HPC_RESUME_PATH = "_hpc_resume_path"

#: The connector state the wraps read: (field, Trainer connector attribute, Fabric connector attribute).
_CONNECTOR_FIELDS = (
    ("accelerator", "_accelerator_flag", "_accelerator_flag"),
    ("strategy", "_strategy_flag", "_strategy_flag"),
    ("num_nodes", "_num_nodes_flag", "_num_nodes_flag"),
    ("parallel_devices", "_parallel_devices", "_parallel_devices"),
    ("precision", "_precision_flag", "_precision_input"),
    ("precision_plugin", "_precision_plugin_flag", "_precision_instance"),
)

#: Private methods of Lightning's strategies that NPU strategies override: a rename upstream would silently
#: stop the override from being called (e.g. DDP back on a CUDA stream), so their presence is checked too.
OVERRIDDEN = (
    Fenced(_TRAINER_DDP, "_setup_model"),
    Fenced(_TRAINER_DDP, "_get_process_group_backend"),
    Fenced(_FABRIC_DDP, "_get_process_group_backend"),
    Fenced(_TRAINER_FSDP2, "_get_process_group_backend"),
    Fenced(_FABRIC_FSDP2, "_get_process_group_backend"),
    # Runs in every process before any worker starts: where npu_fsdp checks its mesh sizes against the devices.
    Fenced(_TRAINER_FSDP2, "_configure_launcher"),
    Fenced(_FABRIC_FSDP2, "_configure_launcher"),
    # Refuses every SyncBatchNorm of a CPU module; the simulated NPU's HostSyncBatchNorm trains there.
    Fenced("torch.nn.parallel:DistributedDataParallel", "_passing_sync_batchnorm_handle"),
    # What a tensor-parallel style defines (torch's documented way to write one): parallel.tensor.ReplicatedParallel.
    Fenced("torch.distributed.tensor.parallel.style:ParallelStyle", "_apply"),
)

#: Everything else, read or written through the accessors below.
ACCESSED = (
    *(Fenced(owner, method) for owner in (_TRAINER_CONNECTOR, _FABRIC_CONNECTOR)
      for method in (CHOOSE_STRATEGY, CHECK_STRATEGY_AND_FALLBACK, CHECK_AND_INIT_PRECISION, CHECK_CONFIG,
                     CHOOSE_CLUSTER_ENVIRONMENT)),
    *(Fenced(owner, CHOOSE_AUTO_ACCELERATOR) for owner in (_TRAINER_CONNECTOR, _FABRIC_CONNECTOR)),
    *(Fenced(owner, "_cluster_environment_flag", instance=True) for owner in (_TRAINER_CONNECTOR, _FABRIC_CONNECTOR)),
    *(Fenced(_TRAINER_CONNECTOR, trainer, instance=True) for _, trainer, _ in _CONNECTOR_FIELDS),
    *(Fenced(_FABRIC_CONNECTOR, fabric, instance=True) for _, _, fabric in _CONNECTOR_FIELDS),
    *(Fenced(owner, "_ddp_kwargs", instance=True) for owner in (_TRAINER_DDP, _FABRIC_DDP)),
    *(Fenced(owner, name, instance=True) for owner in (_TRAINER_DDP, _FABRIC_DDP, _TRAINER_FSDP2, _FABRIC_FSDP2)
      for name in ("_timeout", "_process_group_backend")),
    *(Fenced(owner, name, instance=True) for owner in (_TRAINER_FSDP2, _FABRIC_FSDP2)
      for name in ("_device_mesh", "_save_distributed_checkpoint")),
    Fenced(_TRAINER_FSDP2, "_launcher", instance=True),
    # What Lightning's own sharded strategies were given (``strategies/from_lightning.py`` maps them to npu_fsdp).
    *(Fenced(owner, name, instance=True) for owner in (_TRAINER_FSDP1, _FABRIC_FSDP1)
      for name in ("_activation_checkpointing_kwargs", "_state_dict_type", "_timeout", "_process_group_backend")),
    Fenced(_FABRIC_FSDP1, "_fsdp_kwargs", instance=True),
    *(Fenced(owner, name, instance=True) for owner in (_TRAINER_FSDP2, _FABRIC_FSDP2)
      for name in ("_data_parallel_size", "_tensor_parallel_size")),
    Fenced("torch.distributed.fsdp.wrap:ModuleWrapPolicy", "_module_classes", instance=True),
    *(Fenced(owner, "_setup_distributed") for owner in (_TRAINER_FSDP2, _FABRIC_FSDP2)),
    Fenced(_FABRIC_FSDP2, "_backward_sync_control", instance=True),
    Fenced("lightning.pytorch:LightningModule", "_device_mesh", instance=True),
    Fenced("lightning.pytorch:LightningModule", "_trainer", instance=True),
    Fenced("lightning.pytorch:Trainer", "_logger_connector", instance=True),
    Fenced("lightning.pytorch.trainer.connectors.logger_connector.logger_connector:_LoggerConnector",
           "should_update_logs"),
    Fenced("lightning.pytorch.strategies:ParallelStrategy", "_layer_sync", instance=True),
    *(Fenced(owner, "_root_device", instance=True)
      for owner in ("lightning.pytorch.strategies:SingleDeviceStrategy", "lightning.fabric.strategies:SingleDeviceStrategy")),
    Fenced("lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector", HPC_RESUME_PATH),
    Fenced("lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector", "_original_handlers", instance=True),
    Fenced("lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector", "_get_current_signal_handlers"),
    Fenced("lightning.fabric.utilities.cloud_io", "_load"),
    Fenced("lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop", BROADCAST_SIGTERM),
    *(Fenced(owner, "inference_mode", instance=True) for owner in (
        "lightning.pytorch.loops.evaluation_loop:_EvaluationLoop",
        "lightning.pytorch.loops.prediction_loop:_PredictionLoop")),
    Fenced(_FSDP2_MODULE, "_get_fsdp_state"),
    Fenced(_FSDP2_STATE, "_fsdp_param_groups|_fsdp_param_group", instance=True),
    Fenced(_FSDP2_GROUP, "reduce_grads", instance=True),
    Fenced(_FSDP2_GROUP, "all_reduce_grads", instance=True),
    # Where a device mesh keeps its process groups: the objects (recent torch) or only their names (older).
    Fenced(_DEVICE_MESH, "_pg_registry|_dim_group_names|_dim_group_infos", instance=True),
    # Each dimension's group: by name (recent torch: a mesh can be given its groups, mesh_with_groups) or by info.
    Fenced(_DEVICE_MESH, "_dim_group_names|_dim_group_infos", instance=True),
    Fenced("torch.distributed.tensor:DTensor", "_spec", instance=True),
    Fenced(_DEVICE_MESH, "_flatten"),
    Fenced("torch._C", "_current_graph_task_id"),
)

FENCED: tuple[Fenced, ...] = (*IMPORTED.values(), *OVERRIDDEN, *ACCESSED)


# ---- versions -------------------------------------------------------------------------------------------------


def supported_versions() -> str:
    """``torch>=2.6,<2.15, lightning>=2.6,<2.7``: the ranges pyproject.toml declares."""
    from packaging.requirements import Requirement

    requirements = [Requirement(text) for text in _declared_dependencies()]
    ranges = {req.name: f"{req.name}{req.specifier}" for req in requirements if req.marker is None}
    if not ranges:
        return f"(unknown: {DISTRIBUTION}'s pyproject.toml and package metadata are both missing)"
    return ", ".join(ranges.get(name, f"{name} (undeclared)") for name in FRAMEWORKS)


def _declared_dependencies() -> list[str]:
    # A source checkout (or editable install) has pyproject.toml next to the package, and it is current even
    # when the installed metadata is older; a wheel install has only the metadata, which was built from it.
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if pyproject.is_file() and sys.version_info >= (3, 11):
        import tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if project.get("name") == DISTRIBUTION:
            return list(project.get("dependencies", []))
    try:
        return list(importlib.metadata.requires(DISTRIBUTION) or [])
    except importlib.metadata.PackageNotFoundError:
        return []


def installed_versions() -> str:
    """``torch 2.13.0, lightning 2.6.6``: what is installed."""
    found = []
    for name in FRAMEWORKS:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def check(entries: Iterable[Fenced], import_module: Callable[[str], Any] = importlib.import_module) -> list[Any]:
    """Resolve ``entries``; if any is missing, one ImportError names them all with the supported versions."""
    resolved, missing = [], []
    for entry in entries:
        try:
            resolved.append(entry.resolve(import_module))
        except LookupError as error:
            missing.append(str(error))
    if missing:
        raise ImportError(
            f"lightning-npu cannot work with the installed Lightning/torch: it relies on private names they no"
            f" longer have: {', '.join(missing)}. Supported: {supported_versions()}; found: {installed_versions()}."
            " Install a supported version (e.g. `pip install 'lightning>=2.6,<2.7'`) or report the versions you"
            " use at lightning-npu's issue tracker."
        )
    return resolved


_RESOLVED = dict(zip(FENCED, check(FENCED)))

TrainerConnector: type = _RESOLVED[IMPORTED["TrainerConnector"]]
FabricConnector: type = _RESOLVED[IMPORTED["FabricConnector"]]
SignalConnector: type = _RESOLVED[IMPORTED["SignalConnector"]]
CheckpointConnector: type = _RESOLVED[IMPORTED["CheckpointConnector"]]
TrainingEpochLoop: type = _RESOLVED[IMPORTED["TrainingEpochLoop"]]
SubprocessScriptLauncher: type = _RESOLVED[IMPORTED["SubprocessScriptLauncher"]]
BackwardSyncControl: type = _RESOLVED[IMPORTED["BackwardSyncControl"]]
has_dtensor_modules: Callable[..., bool] = _RESOLVED[IMPORTED["has_dtensor_modules"]]
load_raw_module_state: Callable[..., None] = _RESOLVED[IMPORTED["load_raw_module_state"]]
apply_filter: Callable[..., None] = _RESOLVED[IMPORTED["apply_filter"]]
validate_keys_for_strict_loading: Callable[..., None] = _RESOLVED[IMPORTED["validate_keys_for_strict_loading"]]
LIGHTNING_METADATA_FILENAME: str = _RESOLVED[IMPORTED["LIGHTNING_METADATA_FILENAME"]]
move_state_into: Callable[..., None] = _RESOLVED[IMPORTED["move_state_into"]]
load_distributed_checkpoint: Callable[..., dict] = _RESOLVED[IMPORTED["load_distributed_checkpoint"]]
Stateful: type = _RESOLVED[IMPORTED["Stateful"]]
default_process_group_backend_for_device: Callable[..., str] = _RESOLVED[
    IMPORTED["default_process_group_backend_for_device"]]
composable_checkpoint: Callable[..., Any] = _RESOLVED[IMPORTED["composable_checkpoint"]]
CheckpointWrapper: type = _RESOLVED[IMPORTED["CheckpointWrapper"]]
EmptyStateDictLoadPlanner: type = _RESOLVED[IMPORTED["EmptyStateDictLoadPlanner"]]
dcp_load_state_dict: Callable[..., None] = _RESOLVED[IMPORTED["dcp_load_state_dict"]]
dcp_parameter_fqns: Callable[..., set] = _RESOLVED[IMPORTED["dcp_parameter_fqns"]]

_FSDP_PARAM_GROUPS = _RESOLVED[Fenced(_FSDP2_STATE, "_fsdp_param_groups|_fsdp_param_group", instance=True)]
_MESH_GROUPS = _RESOLVED[Fenced(_DEVICE_MESH, "_pg_registry|_dim_group_names|_dim_group_infos", instance=True)]
_MESH_DIM_GROUPS = _RESOLVED[Fenced(_DEVICE_MESH, "_dim_group_names|_dim_group_infos", instance=True)]


# ---- accessors --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorState:
    """What the NPU wraps read from a Trainer or Fabric connector, at the moment they read it."""

    accelerator: Any  # the accelerator= flag: a string or an Accelerator instance
    strategy: Any  # the strategy= flag: a string or a Strategy instance
    num_nodes: int
    parallel_devices: list
    precision: Any  # the precision= flag (a string)
    precision_plugin: Any  # a precision plugin given through plugins= (or the strategy), else None


def connector_state(connector: Any) -> ConnectorState:
    column = 1 if isinstance(connector, TrainerConnector) else 2
    return ConnectorState(**{field[0]: getattr(connector, field[column]) for field in _CONNECTOR_FIELDS})


def cluster_environment_given(connector: Any) -> Any:
    """The cluster environment the user passed in ``plugins=`` (or a strategy carried), else None or a string."""
    return connector._cluster_environment_flag


def set_connector_strategy(connector: Any, strategy: Any) -> None:
    """Replace the ``strategy=`` flag a Trainer or Fabric connector was given (before it builds the strategy)."""
    connector._strategy_flag = strategy


def fsdp1_kwargs(strategy: Any) -> dict[str, Any]:
    """The ``FullyShardedDataParallel`` keyword arguments a Lightning ``FSDPStrategy`` (Trainer or Fabric) keeps:
    ``auto_wrap_policy``, ``device_mesh``, ``use_orig_params`` and whatever else it was given."""
    return strategy._fsdp_kwargs if hasattr(strategy, "_fsdp_kwargs") else strategy.kwargs


def fsdp1_activation_checkpointing(strategy: Any) -> dict[str, Any]:
    """A Lightning ``FSDPStrategy``'s activation checkpointing: ``{}``, ``{"auto_wrap_policy": policy}`` or
    ``{"check_fn": fn}`` (the deprecated ``activation_checkpointing=`` classes, kept in ``fn``'s closure)."""
    return strategy._activation_checkpointing_kwargs


def fsdp1_state_dict_type(strategy: Any) -> str:
    return strategy._state_dict_type


def model_parallel_sizes(strategy: Any) -> tuple[Any, Any]:
    """A Lightning ``ModelParallelStrategy``'s ``(data_parallel_size, tensor_parallel_size)``, each an int or "auto"."""
    return strategy._data_parallel_size, strategy._tensor_parallel_size


def model_parallel_function(strategy: Any) -> Optional[Any]:
    """Fabric ``ModelParallelStrategy``'s ``parallelize_fn``; None for the Trainer's, which has none."""
    return getattr(strategy, "_parallelize_fn", None)


def wrap_policy_classes(policy: Any) -> set[type]:
    """The module classes a torch ``ModuleWrapPolicy`` wraps."""
    return set(policy._module_classes)


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments Lightning's DDP strategies pass to ``DistributedDataParallel``."""
    return strategy._ddp_kwargs


def process_group_timeout(strategy: Any) -> Optional[timedelta]:
    return getattr(strategy, "_timeout", None)


def process_group_backend_given(strategy: Any) -> Optional[str]:
    """The ``process_group_backend=`` the user gave the strategy (None: choose one)."""
    return strategy._process_group_backend


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether an FSDP2 strategy writes sharded (DCP directory) checkpoints rather than one full file."""
    return strategy._save_distributed_checkpoint


def setup_distributed(strategy: Any) -> None:
    """Lightning's FSDP2 process-group setup (cluster environment, ``init_process_group``) without its mesh."""
    strategy._setup_distributed()


def check_before_launch(strategy: Any, check: Callable[[Any], None]) -> None:
    """Make the Trainer ``strategy``'s launcher, if it is Lightning's subprocess launcher (the one that starts the
    other ranks), call ``check(lightning_module)`` first, in the launching process."""
    if type(strategy._launcher) is SubprocessScriptLauncher:
        strategy._launcher = _CheckedLauncher(check, strategy.cluster_environment, strategy.num_processes,
                                              strategy.num_nodes)


class _CheckedLauncher(SubprocessScriptLauncher):
    """Lightning's subprocess launcher, calling ``check(lightning_module)`` before it starts the other ranks."""

    def __init__(self, check: Callable[[Any], None], *args: Any) -> None:
        super().__init__(*args)
        self._check = check

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self._check(trainer.lightning_module)
        return super().launch(function, *args, trainer=trainer, **kwargs)


def set_device_mesh(owner: Any, mesh: Any) -> None:
    """Give a strategy or LightningModule the mesh its public ``device_mesh`` property returns."""
    owner._device_mesh = mesh


def has_device_mesh(owner: Any) -> bool:
    """Whether a strategy has its mesh yet (its public ``device_mesh`` property raises until then)."""
    return owner._device_mesh is not None


def flatten_mesh(mesh: Any, name: str) -> Any:
    """One dimension ``name`` made of ``mesh``'s dimensions (new process groups unless it spans every rank); keep the
    mesh this returns: reading it back from the root mesh by name is deprecated in torch 2.11."""
    return mesh._flatten(name)


def check_mesh_unflatten(feature: str) -> None:
    """RuntimeError naming ``feature`` and the torch release it needs when this torch's DeviceMesh cannot split a
    dimension (``unflatten_mesh``; torch 2.9 and later have it). Not in ``FENCED``: the package takes torch 2.6,
    which lacks it, so only the runs that need it check for it, before workers start."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    if not hasattr(DeviceMesh, "_unflatten"):
        raise RuntimeError(f"{feature} needs a DeviceMesh that can split a dimension (torch >= 2.9); this is torch"
                           f" {torch.__version__}: upgrade torch (and the matching torch_npu), or drop one of the two")


def unflatten_mesh(mesh: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``mesh`` (1-D) split into dimensions ``names`` of ``sizes``, innermost last: a view of the same root mesh
    (new process groups for the new dimensions), so FSDP and DTensor combine it with the root's other views."""
    return mesh._unflatten(0, sizes, names)


def check_mesh_join(feature: str) -> None:
    """RuntimeError naming ``feature`` unless this torch's DeviceMesh can join views of one root into one mesh
    (``join_meshes``; torch 2.10 and later). Not in ``FENCED``, as ``check_mesh_unflatten``."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    if not hasattr(DeviceMesh, "_concatenate"):
        raise RuntimeError(f"{feature} needs a DeviceMesh that can join two views (torch >= 2.10); this is torch"
                           f" {torch.__version__}: upgrade torch (and the matching torch_npu), or drop one of the two")


def join_meshes(meshes: list[Any]) -> Any:
    """One mesh whose dimensions are those of ``meshes`` (views of one root mesh, over disjoint rank strides), in
    order, with their process groups: no new group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def mesh_with_groups(device_type: str, ranks: Any, names: tuple[str, ...],
                     group_names: Callable[[], list[str]]) -> Any:
    """A DeviceMesh over ``ranks`` (a tensor of global ranks, one axis per name) whose dimensions use the process
    groups ``group_names()`` names, asked for the first time a group is needed (slicing the mesh, a collective on
    it), not when the mesh is made: a group it would create (a size-1 dimension's) then exists only if used.
    ``group_names`` must create nothing a peer has to join (existing groups, or local ones). On a torch whose meshes
    cannot be given groups, an ordinary mesh with groups of its own."""
    if _MESH_DIM_GROUPS != "_dim_group_names":
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(ranks.shape), mesh_dim_names=names)
    mesh = _MeshWithGroups(device_type, ranks, mesh_dim_names=names, _init_backend=False)
    mesh._group_names = group_names
    return mesh


def _mesh_with_groups_class() -> Optional[type]:
    if _MESH_DIM_GROUPS != "_dim_group_names":
        return None
    from torch.distributed.device_mesh import DeviceMesh

    class MeshWithGroups(DeviceMesh):
        """``mesh_with_groups``: its ``_dim_group_names`` (what torch reads to find each dimension's group) come from
        ``_group_names()`` on first read; pickled with the names, as a plain mesh is."""

        _given: Optional[list[str]] = None
        _group_names: Optional[Callable[[], list[str]]] = None

        @property
        def _dim_group_names(self) -> list[str]:
            if self._given is None:
                self._given = self._group_names()
            return self._given

        @_dim_group_names.setter
        def _dim_group_names(self, value: list[str]) -> None:
            self._given = value

        def __getstate__(self) -> dict:
            state = super().__getstate__()
            state["_given"] = self._dim_group_names
            state.pop("_group_names", None)
            return state

    MeshWithGroups.__qualname__ = MeshWithGroups.__name__ = "_MeshWithGroups"
    return MeshWithGroups


_MeshWithGroups = _mesh_with_groups_class()


def layer_sync(strategy: Any) -> Optional[Any]:
    """The ``LayerSync`` plugin the Trainer's connector gave a parallel strategy (``Trainer(sync_batchnorm=True)``:
    ``TorchSyncBatchNorm``), or None."""
    return strategy._layer_sync


def release_mesh_process_groups(mesh: Any) -> None:
    """Drop a device mesh's own references to its process groups, once they are destroyed.

    Recent torch keeps the group objects in the mesh (``_pg_registry``), and DTensor's sharding caches keep the
    mesh alive to the end of the process, so without this its groups would outlive ``destroy_process_group``.
    Older releases keep only the groups' names: nothing to drop.
    """
    if _MESH_GROUPS == "_pg_registry":
        mesh._pg_registry.clear()


def set_root_device(strategy: Any, device: Any) -> None:
    """The device a single-device strategy's public ``root_device`` returns."""
    strategy._root_device = device


def set_backward_sync_control(strategy: Any, control: Any) -> None:
    """What Fabric's ``no_backward_sync`` uses for this strategy."""
    strategy._backward_sync_control = control


def keep_signal_handlers(signal_connector: Any) -> None:
    """Record the current handlers where Lightning's ``teardown()`` restores them from."""
    signal_connector._original_handlers = signal_connector._get_current_signal_handlers()


def lightning_file_loader() -> Callable[..., Any]:
    """Lightning's checkpoint file loader (``lightning.fabric.utilities.cloud_io._load``)."""
    import lightning.fabric.utilities.cloud_io as cloud_io

    return cloud_io._load


def set_lightning_file_loader(load: Callable[..., Any]) -> None:
    import lightning.fabric.utilities.cloud_io as cloud_io

    cloud_io._load = load


def fsdp_gradient_sync_flags(unit: Any) -> Optional[tuple[bool, bool]]:
    """``(reduce_grads, all_reduce_grads)`` of one FSDP2 unit; None for a unit that holds no parameters.

    FSDP2 has setters for these flags but no getters, so they are read from its parameter group(s):
    ``_fsdp_param_groups`` (a list, in recent torch) or ``_fsdp_param_group`` (one or None, in older torch).
    """
    groups = _fsdp_param_groups(unit)
    if not groups:
        return None
    return bool(groups[0].reduce_grads), bool(groups[0].all_reduce_grads)


def _fsdp_param_groups(unit: Any) -> list:
    """One FSDP2 unit's parameter groups: ``_fsdp_param_groups`` (a list, in recent torch) or ``_fsdp_param_group``
    (one or None, in older torch), as a list."""
    groups = getattr(unit._get_fsdp_state(), _FSDP_PARAM_GROUPS)
    if not isinstance(groups, list):
        groups = [] if groups is None else [groups]
    return groups


def fsdp_reshard_flags(unit: Any) -> tuple[bool, bool]:
    """``(reshards_after_forward, is_unsharded)`` of one FSDP2 unit: whether it frees its gathered parameters after
    its forward, and whether they are gathered now (a unit with no parameters: ``(False, True)``). FSDP2 has setters
    but no getters, so both are read from its parameter group(s), as :func:`fsdp_gradient_sync_flags` reads."""
    groups = _fsdp_param_groups(unit)
    if not groups:
        return False, True
    return groups[0].post_forward_mesh_info is not None, all(group.is_unsharded for group in groups)


def dtensor_with_local(dtensor: Any, local: Any) -> Any:
    """A DTensor sharded as ``dtensor`` (mesh, placements, global shape) whose local shard is ``local``, kept on
    ``local``'s device: ``DTensor.from_local`` would move a host shard back to the mesh's device."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, dtensor._spec, requires_grad=False)


def attached_trainer(module: Any) -> Optional[Any]:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer


def evaluate_without_inference_mode(trainer: Any) -> None:
    """Make the Trainer's validation, test and predict loops (the fit loop's validation too) run under ``no_grad``
    instead of ``inference_mode``, whatever ``Trainer(inference_mode=...)`` says, as Lightning does for its own
    FSDPStrategy."""
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop, trainer.fit_loop.epoch_loop.val_loop):
        loop.inference_mode = False


def logs_this_step(trainer: Any) -> bool:
    """Whether the Trainer writes this training batch's ``self.log`` values to its loggers (every
    ``log_every_n_steps`` optimizer steps, when it stops, and every step of ``fast_dev_run``): the same on every rank,
    and the same answer in ``training_step`` as when the values are written."""
    return trainer._logger_connector.should_update_logs or bool(trainer.fast_dev_run)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass in this thread now: a forward that runs then is
    activation checkpointing's recompute (``torch._C._current_graph_task_id`` is -1 outside backward)."""
    import torch

    return torch._C._current_graph_task_id() != -1


def grouped_mm() -> Optional[Callable[..., Any]]:
    """torch's grouped matmul over stacked weights (``torch._grouped_mm(x, weight, offs=int32 ends)``), or None
    in a torch release without it (callers then multiply expert by expert)."""
    import torch

    return getattr(torch, "_grouped_mm", None)


def set_gradient_divide_factor(unit: Any, factor: float, shard_size: int) -> None:
    """Divide one FSDP2 unit's reduced gradients by ``factor`` rather than by its mesh size (``shard_size``
    ranks), with a plain SUM reduction and a division after it: the custom factor otherwise becomes a PREMUL_SUM
    reduction, which gloo and HCCL reject. On one rank nothing is reduced, and torch 2.13 divides by the factor
    there already (forcing SUM would divide twice). Releases before ``set_force_sum_reduction_for_comms`` name the
    factor setter ``set_reduce_scatter_divide_factor`` and reduce by SUM already."""
    if not hasattr(unit, "set_force_sum_reduction_for_comms"):
        unit.set_reduce_scatter_divide_factor(factor)
        return
    if shard_size > 1:
        unit.set_force_sum_reduction_for_comms(True)
    unit.set_gradient_divide_factor(factor)


def run_shape_inference_inside(stage: Any, context: Callable[[], Any]) -> None:
    """Make the pipeline ``stage`` run its forward metadata inference (the forward torch runs once per schedule, at
    its first step, to learn what the stage sends; torch 2.13's private ``_forward_metadata_inference``) inside
    ``context()``; AttributeError in a torch without it."""
    infer = stage._forward_metadata_inference

    def inside(*args: Any, **kwargs: Any) -> Any:
        with context():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = inside
