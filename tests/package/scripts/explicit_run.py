"""The explicit-instance path on the simulated NPUs with Lightning's connectors as Lightning ships them.

``import lightning_npu`` wraps three private connector methods
(``lightning_npu/lightning_patches/connectors.py``); this script
undoes the wraps first, then fits ``Trainer(accelerator=NPUAccelerator(), strategy=NPUFSDPStrategy(...),
plugins=[MixedPrecision("bf16-mixed", device=<the runtime's device type>)])`` on two ranks and writes
``<out>/result.json`` from rank 0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_npu
from lightning_npu import compat
from tests.strategies.scripts.trainer_run import Block, Regression, data

WRAPPED = (compat.CHOOSE_STRATEGY, compat.CHECK_STRATEGY_AND_FALLBACK, compat.CHECK_AND_INIT_PRECISION)


def unwrap_connectors() -> list[str]:
    """Put Lightning's own connector methods back (functools.wraps kept them as ``__wrapped__``)."""
    restored = []
    for cls in (compat.TrainerConnector, compat.FabricConnector):
        for name in WRAPPED:
            method = getattr(cls, name)
            if hasattr(method, "__wrapped__"):
                setattr(cls, name, method.__wrapped__)
                restored.append(f"{cls.__name__}.{name}")
    return restored


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    restored = unwrap_connectors()
    seed_everything(7)
    runtime = lightning_npu.get_runtime()
    trainer = Trainer(
        accelerator=lightning_npu.NPUAccelerator(), devices=2,
        strategy=lightning_npu.NPUFSDPStrategy(auto_wrap_policy={Block}, timeout=120),
        plugins=[MixedPrecision("bf16-mixed", device=runtime.device_type)],
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    model = Regression()
    trainer.fit(model, train_dataloaders=data())
    if trainer.global_rank == 0:
        still_wrapped = [f"{cls.__name__}.{name}" for cls in (compat.TrainerConnector, compat.FabricConnector)
                         for name in WRAPPED if hasattr(getattr(cls, name), "__wrapped__")]
        result = {
            "restored": restored,
            "still_wrapped": still_wrapped,
            "strategy": type(trainer.strategy).__name__,
            "accelerator": type(trainer.accelerator).__name__,
            "precision_device": trainer.precision_plugin.device,
            "matmul_dtypes": sorted(model.matmul_dtypes),
            "losses": model.losses,
            "world_size": trainer.world_size,
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
