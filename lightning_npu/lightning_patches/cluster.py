"""The Trainer's and Fabric's choice of cluster environment, taught the Ascend ones.

Lightning's ``_choose_and_init_cluster_environment`` takes an instance given in ``plugins`` first, else the first of
TorchElastic -> SLURM -> LSF -> MPI whose ``detect()`` is true, else ``LightningEnvironment``. Wrapped, it tries
``AscendOperatorEnvironment`` before TorchElastic (it is torchrun's processes in an Ascend Operator pod) and
``ModelArtsEnvironment`` right after it (a torchrun inside a ModelArts job stays torchrun's), and says which it
chose. With ``accelerator="npu"`` and ``RANK_TABLE_FILE`` set, whatever the environment, the rank table is checked
against the run's nodes and devices here, in every process before any worker starts or the process group forms.
Everything else is Lightning's own choice, unchanged.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment, TorchElasticEnvironment
from lightning.fabric.utilities import rank_zero_info

from lightning_npu import compat
from lightning_npu.cluster import rank_table
from lightning_npu.cluster.environments import AscendOperatorEnvironment, ModelArtsEnvironment
from lightning_npu.lightning_patches.connectors import is_npu

_PATCHED = "_lightning_npu_cluster_patched"


def choose(connector: Any, original: Any) -> ClusterEnvironment:
    """Lightning's choice, with the Ascend environments in their places; the rank table checked for an NPU run."""
    if isinstance(compat.cluster_environment_given(connector), ClusterEnvironment):
        environment = original()
    elif AscendOperatorEnvironment.detect():
        environment = AscendOperatorEnvironment()
    elif ModelArtsEnvironment.detect() and not TorchElasticEnvironment.detect():
        environment = ModelArtsEnvironment()
    else:
        environment = original()
    if isinstance(environment, (AscendOperatorEnvironment, ModelArtsEnvironment)):
        rank_zero_info(f"lightning-npu: cluster environment {type(environment).__name__}")
    state = compat.connector_state(connector)
    if is_npu(state.accelerator):
        table = rank_table.check_for_job(os.environ, state.num_nodes, len(state.parallel_devices))
        if table is not None:
            rank_zero_info(f"lightning-npu: {table.describe()}, matches the run")
    return environment


def install() -> None:
    """Wrap the Trainer's and Fabric's connector (idempotent)."""
    for connector_cls in (compat.TrainerConnector, compat.FabricConnector):
        if getattr(connector_cls, _PATCHED, False):
            continue
        original = getattr(connector_cls, compat.CHOOSE_CLUSTER_ENVIRONMENT)

        @functools.wraps(original)
        def wrapped(self: Any, _original: Any = original) -> ClusterEnvironment:
            return choose(self, functools.partial(_original, self))

        setattr(connector_cls, compat.CHOOSE_CLUSTER_ENVIRONMENT, wrapped)
        setattr(connector_cls, _PATCHED, True)
