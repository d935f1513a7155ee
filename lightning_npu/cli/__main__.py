"""``python -m lightning_npu.cli <command>``: the same as the ``lightning-npu`` console script."""

from lightning_npu.cli import main

raise SystemExit(main())
