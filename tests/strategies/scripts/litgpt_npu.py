"""litgpt's command line on NPUs: litgpt's own entry point with ``import lightning_npu`` before it (the one change a
litgpt user makes, docs/porting.md). ``python litgpt_npu.py pretrain --config x.yaml`` runs ``litgpt pretrain
--config x.yaml``; Lightning starts the other ranks with the same command."""

import lightning_npu  # noqa: F401  (registers the NPU accelerator and strategies)
from litgpt.__main__ import main

if __name__ == "__main__":
    main()
