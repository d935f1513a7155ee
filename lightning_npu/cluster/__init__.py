"""How Ascend clusters start a job, read the way Lightning reads SLURM and torchelastic.

- ``pod``: the variables MindCluster's Ascend Operator (acjob on Volcano) sets in every pod -- ``RANK`` the pod's
  rank, ``LOCAL_RANK`` a list string such as ``{0,1,2,3}``, ``WORLD_SIZE`` the job's NPUs -- checked and turned
  into torchrun's options (``lightning-npu run`` starts the pod's processes from them, before Lightning is imported).
- ``modelarts``: the variables Huawei Cloud ModelArts gives each card's process (``RANK_ID``, ``RANK_SIZE``,
  ``ASCEND_DEVICE_ID``, ``MA_NUM_HOSTS``, ``VC_TASK_INDEX``, ``VC_WORKER_HOSTS``).
- ``rank_table``: an HCCL rank table (``hccl.json``, versions 1.0, 1.2 and 2.0) named by ``RANK_TABLE_FILE``,
  parsed and checked against the job.
- ``environments``: the Lightning ``ClusterEnvironment``s built on them (``AscendOperatorEnvironment``,
  ``ModelArtsEnvironment``); ``lightning_patches/cluster.py`` makes the Trainer and Fabric detect them.

Everything but ``environments`` is pure Python (no torch, no Lightning): the launcher and ``lightning-npu doctor``
read these variables where ``import lightning`` fails (an Ascend Operator pod's ``LOCAL_RANK`` breaks it).
"""
