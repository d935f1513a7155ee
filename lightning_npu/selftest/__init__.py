"""``lightning-npu selftest``: the checks, one module per family, and the report they make.

- ``kernels``: fused ops against their PyTorch references (errors, times);
- ``collectives``: exact results and bus bandwidth of the collectives FSDP uses;
- ``training``: a short npu_fsdp run of ``model``'s decoder: loss, exact resume, memory against the planner, and
  the same decoder in pipeline stages against plain npu_fsdp;
- ``report``: results, verdicts, the table and the JSON file, the exit status;
- ``worker``: what every launched process runs (the command itself is ``lightning_npu/cli/selftest.py``).
"""
