"""Facts about Ascend NPUs and lightning-npu's options, each written once, importing neither torch nor Lightning.

The runtime, strategies, accelerator, precision plugin, kernels, planner and doctor all read them here, so
torch-free tools (``lightning-npu plan`` and ``doctor``) and the training code cannot disagree.

- ``chips``: the one chip table -- series (which fused kernels run), peak bf16 FLOP/s, device memory (GiB),
  matched by the exact name ``torch.npu.get_device_name()`` returns; the planner's default chip.
- ``precisions``: the precision settings NPU runs accept, Lightning's aliases, their dtypes, and why the rest
  cannot run (``canonical_precision``).
- ``options``: every ``npu_fsdp`` option declared once (``FSDPOptions``): default, type, validation with the fix in
  the message, one-line help; the strategies' signature, docstring and the docs' options table are generated from it.
  Also which blocks a ratio checkpoints, and the mesh layout the sizes give a run (``MeshLayout``).
- ``env``: the name of every environment variable the package reads or writes.
- ``optim8bit``: which tensors AdamW8bit keeps 8-bit (from shape and shard count) and the bytes its state takes.
- ``devices``: device ids -- torch_npu's reading of ``ASCEND_RT_VISIBLE_DEVICES`` and a ``devices=`` value.

Modules here import only the standard library and each other (``tests/facts/test_facts.py`` checks it).
"""
