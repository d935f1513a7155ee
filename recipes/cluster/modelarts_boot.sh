#!/bin/bash
# ModelArts boot file: LLaMA-2 7B on 2 hosts x 8 cards (configs/llama2_7b_2nodes.yaml). The preset
# Ascend-Powered-Engine runs it once per card, each with its RANK_ID, RANK_SIZE and ASCEND_DEVICE_ID (and, on
# several hosts, MA_NUM_HOSTS, VC_TASK_INDEX, VC_WORKER_HOSTS; RANK_TABLE_FILE when ModelArts writes a rank
# table), so every run of it is one rank: lightning-npu's ModelArtsEnvironment reads them, the master is the first
# host of VC_WORKER_HOSTS, and a RANK_TABLE_FILE is checked against the job before training starts.
# Boot command in the job: bash recipes/cluster/modelarts_boot.sh
# Arguments, if given, replace the recipe command (e.g. another script and its arguments).
set -euo pipefail
cd "$(dirname "$0")/../.."

# source /usr/local/Ascend/ascend-toolkit/set_env.sh   # CANN, unless the image has it loaded
# ModelArts names no rendezvous port: MASTER_PORT, else 29500 on the first host.
export HCCL_CONNECT_TIMEOUT=1200    # link set-up across 16 NPUs takes longer than the 120 s default
export HCCL_EXEC_TIMEOUT=1200       # below the strategy's timeout (1800 s in the config), checked at start-up
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export TASK_QUEUE_ENABLE=1

if [ "$#" -eq 0 ]; then
    set -- recipes/train.py fit --config recipes/models/llama/configs/llama2_7b_2nodes.yaml
fi
# The Trainer's devices / num_nodes are the job's: cards per host, hosts (ModelArtsEnvironment checks both).
exec python "$@" --trainer.devices "$(( RANK_SIZE / ${MA_NUM_HOSTS:-1} ))" --trainer.num_nodes "${MA_NUM_HOSTS:-1}"
