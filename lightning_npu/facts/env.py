"""The name of every environment variable lightning-npu reads or writes, with who reads it.

Code spells these names only through this module (the doctor, the runtime, the strategies and the launcher
alike), so renaming or documenting one happens here. Values and the rules about them stay with their users
(``timeouts.py`` for the HCCL timeouts, ``runtime`` for the simulator, ``cli/doctor.py`` for the checks).
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------------- lightning-npu's own
#: ``<n>``: run accelerator="npu" on the CPU as n simulated NPUs (gloo); unset, "" or "0": real NPUs.
SIMULATE_ENV = "LIGHTNING_NPU_SIMULATE"
#: Comma-separated fused kernels (the names in ``kernels/_dispatch.py``'s FUSED_OPS, or all) run on their PyTorch
#: reference path instead (the switch ``lightning-npu selftest`` names for a failing kernel).
DISABLE_FUSED_ENV = "LIGHTNING_NPU_DISABLE_FUSED"

# ------------------------------------------------------------------------------------------ torch / torch_npu
#: The device ids the NPU runtime shows this process (CANN's mask, parsed by ``facts.devices``).
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
#: torch >= 2.5 loads torch_npu on ``import torch`` unless this is "0".
AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
#: torch_npu's caching allocator settings (``expandable_segments:True``, ...).
NPU_ALLOC_CONF = "PYTORCH_NPU_ALLOC_CONF"
#: torch's device-generic allocator settings; torch_npu refuses to start when both are set.
ALLOC_CONF = "PYTORCH_ALLOC_CONF"
#: torch_npu's operator dispatch queue level (0, 1, 2).
TASK_QUEUE_ENABLE = "TASK_QUEUE_ENABLE"
#: "1": every operator launches synchronously (debugging).
ASCEND_LAUNCH_BLOCKING = "ASCEND_LAUNCH_BLOCKING"
#: torch_npu's HCCL error handling mode (0..3); ``HCCL_ASYNC_ERROR_HANDLING`` is its old spelling.
TORCH_HCCL_ASYNC_ERROR_HANDLING = "TORCH_HCCL_ASYNC_ERROR_HANDLING"
HCCL_ASYNC_ERROR_HANDLING = "HCCL_ASYNC_ERROR_HANDLING"
#: torch_npu's flight recorder (see ``timeouts.FLIGHT_RECORDER_ENV`` for the values it is turned on with).
TORCH_HCCL_TRACE_BUFFER_SIZE = "TORCH_HCCL_TRACE_BUFFER_SIZE"
TORCH_HCCL_ENABLE_MONITORING = "TORCH_HCCL_ENABLE_MONITORING"
TORCH_HCCL_DUMP_ON_TIMEOUT = "TORCH_HCCL_DUMP_ON_TIMEOUT"
TORCH_HCCL_DEBUG_INFO_TEMP_FILE = "TORCH_HCCL_DEBUG_INFO_TEMP_FILE"
TORCH_HCCL_TRACE_CPP_STACK = "TORCH_HCCL_TRACE_CPP_STACK"

# --------------------------------------------------------------------------------------------------- CANN / HCCL
#: Seconds HCCL waits for link set-up / inside one collective (``timeouts.py`` holds the defaults and the rule).
HCCL_CONNECT_TIMEOUT = "HCCL_CONNECT_TIMEOUT"
HCCL_EXEC_TIMEOUT = "HCCL_EXEC_TIMEOUT"
HCCL_TIMEOUTS = (HCCL_CONNECT_TIMEOUT, HCCL_EXEC_TIMEOUT)
#: MB each communicator allocates (twice) on every NPU.
HCCL_BUFFSIZE = "HCCL_BUFFSIZE"
#: torch_npu: MB of each of the two buffers a point-to-point (pipeline) communicator holds; default 20 since 7.1.0.
P2P_HCCL_BUFFSIZE = "P2P_HCCL_BUFFSIZE"
#: Which host NIC HCCL binds: by address, by interface name, and its first port.
HCCL_IF_IP = "HCCL_IF_IP"
HCCL_SOCKET_IFNAME = "HCCL_SOCKET_IFNAME"
HCCL_IF_BASE_PORT = "HCCL_IF_BASE_PORT"
#: Deterministic reductions (false, true, strict).
HCCL_DETERMINISTIC = "HCCL_DETERMINISTIC"
#: Where CANN's ``set_env.sh`` points, and where its installer does, in the order the doctor searches them.
ASCEND_HOME_PATH = "ASCEND_HOME_PATH"
ASCEND_TOOLKIT_HOME = "ASCEND_TOOLKIT_HOME"
CANN_HOME_ENVS = (ASCEND_HOME_PATH, ASCEND_TOOLKIT_HOME)
#: CANN's log level and event logs (turned on for hang diagnostics).
ASCEND_GLOBAL_LOG_LEVEL = "ASCEND_GLOBAL_LOG_LEVEL"
ASCEND_GLOBAL_EVENT_ENABLE = "ASCEND_GLOBAL_EVENT_ENABLE"

# ------------------------------------------------------------------------------------------ cluster / launcher
#: SLURM's job ids, read to requeue a preempted job (``preemption.py``).
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_ARRAY_JOB_ID = "SLURM_ARRAY_JOB_ID"
SLURM_ARRAY_TASK_ID = "SLURM_ARRAY_TASK_ID"
#: Set in processes srun / torchrun started: ``lightning-npu selftest`` then runs its checks in place (one rank of many).
SLURM_NTASKS = "SLURM_NTASKS"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
#: What ``lightning-npu run`` sets for ``Fabric()`` in place of its arguments (lightning/fabric/connector.py).
LT_CLI_USED = "LT_CLI_USED"
LT_ACCELERATOR = "LT_ACCELERATOR"
LT_DEVICES = "LT_DEVICES"
LT_NUM_NODES = "LT_NUM_NODES"
LT_STRATEGY = "LT_STRATEGY"
LT_PRECISION = "LT_PRECISION"
#: torch.distributed's rendezvous variables, which torchrun sets in every worker (``lightning-npu run`` reads the
#: Ascend Operator's pod-level values of the same names, see below).
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
#: MindCluster's Ascend Operator (acjob on Volcano) sets these in every pod, with RANK the pod's (node) rank,
#: LOCAL_RANK a list string such as {0,1,2,3} and WORLD_SIZE the job's NPUs (``lightning_npu.cluster.pod``).
MINDX_TASK_ID = "MINDX_TASK_ID"
MINDX_SERVER_IP = "MINDX_SERVER_IP"
#: Huawei Cloud ModelArts runs the boot file once per card with these (``lightning_npu.cluster.modelarts``).
RANK_ID = "RANK_ID"
RANK_SIZE = "RANK_SIZE"
ASCEND_DEVICE_ID = "ASCEND_DEVICE_ID"
MA_NUM_HOSTS = "MA_NUM_HOSTS"
VC_TASK_INDEX = "VC_TASK_INDEX"
VC_WORKER_HOSTS = "VC_WORKER_HOSTS"
#: The path of an HCCL rank table (``hccl.json``), read by torch_npu and checked by ``lightning_npu.cluster.rank_table``.
RANK_TABLE_FILE = "RANK_TABLE_FILE"
#: CPU threads per process ``lightning-npu run`` sets unless given.
OMP_NUM_THREADS = "OMP_NUM_THREADS"

#: Every name above.
NAMES = tuple(value for name, value in sorted(globals().items()) if name.isupper() and isinstance(value, str))

# ------------------------------------------------------------------------------------------ progress output
#: torchrun's global rank of a process, read by ``progress.py`` where no process group exists yet (rank 0 prints).
RANK = "RANK"
#: ``dumb``: a terminal that cannot redraw a line; ``progress.py`` prints plain lines there, as to a log.
TERM = "TERM"
