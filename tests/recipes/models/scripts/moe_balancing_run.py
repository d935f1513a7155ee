"""The MoE family's auxiliary-loss-free balancing under npu_fsdp on 2 simulated NPUs: a tiny MoE trains 4 steps with
router_bias_update_rate, each rank routing its own batch; every rank writes ``<out>/rank<r>.json`` with its routers'
balancing biases and the tokens it routed in its last step."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_npu  # noqa: F401  (registers the npu accelerator and strategies)
from recipes.decoder.module import DecoderLM

RATE = 0.01


class RecordRouted(Callback):
    """Each rank's own routed counts of the last batch, before the module's hook sums them over the ranks."""

    def __init__(self) -> None:
        self.routed: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        layers = [pl_module.model.layers[i].feed_forward for i in pl_module.config.moe_layers]
        self.routed = [layer.routed.tolist() if layer.routed is not None else None for layer in layers]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    out = Path(parser.parse_args().out)
    seed_everything(3)
    module = DecoderLM(family="moe", preset="tiny", warmup_steps=0,
                       config={"n_layers": 2, "router_aux_loss_coef": 0.0, "router_bias_update_rate": RATE})
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (16, 33), generator=generator)
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]
    record = RecordRouted()
    trainer = Trainer(accelerator="npu", devices=2, strategy="npu_fsdp", precision="32-true", max_steps=4,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[record])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=2))
    biases = [module.model.layers[i].feed_forward.router.expert_bias.tolist() for i in module.config.moe_layers]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"biases": biases, "routed": record.routed}))


if __name__ == "__main__":
    main()
