"""Checkpoints of the ``npu_fsdp`` strategies (Trainer and Fabric): atomic, optionally asynchronous, readable
without the strategy. One module per job:

- ``layout``: what a sharded and a full checkpoint hold on disk; the consolidation hint.
- ``publish``: a save made visible by one rename, and the repair of an interrupted one.
- ``save``: ``CheckpointWriter`` (blocking or in the background, from host buffers kept in ``staging``), and the
  model's and optimizers' state the strategies hand it.
- ``load``: a checkpoint restored into a sharded model and its optimizers.
- ``optimizer_state``: an optimizer's state keyed by name or by index, and its full form (the optimizer's own
  ``to_full_state`` / ``from_full_state``).
- ``offline``: a sharded checkpoint read in one process, or consolidated into one file.

Lightning's own file loader learns to read a sharded directory in ``lightning_npu.lightning_patches``.
"""
