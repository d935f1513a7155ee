"""Expert parallelism under npu_fsdp on 4 simulated NPUs: several Trainer runs of a small MoE recipe model in one
launch, with the same data, first weights and global batch.

- ``ep1`` / ``ep2`` / ``ep4``: 20 steps (2 epochs of 10) with expert_parallel_size 1, 2 and 4; ep2 writes a
  sharded checkpoint after epoch 0, ep1 and ep4 a full one at the end (``ep1.ckpt``, ``ep4.ckpt``);
- ``ep2_to_ep4`` / ``ep2_to_ep1``: ``ep2``'s epoch-0 checkpoint resumed under expert_parallel_size 4 and 1;
- ``fabric_ep1`` / ``fabric_ep2``: the same model in a Fabric loop, 6 steps.

Rank 0 writes ``<out>/result.json``: each run's per-step losses (averaged over ranks), the local shape and
placements of layer 0's ``w_gate_up``, and the routers' balancing biases after the first optimizer step (with
``router_bias_update_rate``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset

import lightning_npu
from recipes.decoder.module import DecoderLM
from tests.strategies.scripts.trainer_run import SaveAfterFirstEpoch

STEPS, SAVE_AT = 20, 10
SEQ, BATCH = 32, 2  # per rank: 4 ranks x 2 rows of 32 tokens a step
CONFIG = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2, expert_hidden_dim=32,
              max_seq_len=SEQ)
#: The runs' model per family: its config fields over the tiny preset, and the block FSDP wraps and recomputes.
#: DeepSeek's: MLA (q/k heads 48 wide, v 32), the first layer dense, then DeepSeekMoE (8 routed + 1 shared experts);
#: Qwen's: Qwen3 (per-head q/k norms, head_dim 48, the embedding tied to the head); LLaMA's: the tiny preset.
FAMILIES = {"moe": (CONFIG, "MoEBlock"), "deepseek": (dict(n_layers=2, max_seq_len=SEQ), "DeepSeekBlock"),
            "qwen": (dict(n_layers=2, max_seq_len=SEQ), "QwenBlock"), "llama": (dict(max_seq_len=SEQ), "TransformerBlock")}


class Tokens(Dataset):
    """One epoch of ``SAVE_AT`` steps: a different batch for every rank and step, drawn from 16 random rows the
    model learns by heart (so the loss falls)."""

    def __init__(self) -> None:
        rows = torch.randint(0, 2048, (16, SEQ + 1), generator=torch.Generator().manual_seed(0))
        self.ids = rows[torch.randint(0, 16, (SAVE_AT * 4 * BATCH,), generator=torch.Generator().manual_seed(1))]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_biases: list[list[float]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == 1:  # the biases the first step's routing moved
            routers = [module.model.layers[i].feed_forward.router for i in getattr(module.config, "moe_layers", [])]
            self.first_biases = [router.expert_bias.tolist() for router in routers if hasattr(router, "expert_bias")]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())


def module(family: str = "moe", init_from: str | None = None, lora: dict | None = None, **config) -> DecoderLM:
    return DecoderLM(family=family, preset="tiny", config={**FAMILIES[family][0], **config}, learning_rate=3e-3,
                     warmup_steps=2, init_from=init_from, lora=lora)


def save_first_weights(path: Path, family: str = "moe", **config) -> str:
    """A recipe checkpoint of freshly built weights, written once (before the Trainer starts the other ranks, which
    find it): runs of different layouts start from it (``init_from``), since FSDP shards drawn shard by shard differ
    between layouts whatever the seed."""
    from recipes.decoder.checkpoint_layout import save_recipe_checkpoint

    if not path.exists():
        seed_everything(1234)
        lm = module(family, **config)
        lm.configure_model()
        save_recipe_checkpoint(path, lm.config, lm.model.state_dict())
    return str(path)


def fit(out: Path, name: str, ep: int, *, state_dict_type: str = "sharded", resume: str | None = None,
        config: dict | None = None, family: str = "moe", epochs: int = STEPS // SAVE_AT, devices: int = 4,
        init_from: str | None = None, **mesh: int | str) -> dict:
    """``epochs`` epochs of ``SAVE_AT`` steps (a resumed run: the second) on ``devices``; a checkpoint after epoch 0
    (sharded) or at the end (full). ``config``: model config fields replaced; ``family``: the model's
    (``FAMILIES``); ``init_from``: first weights (``save_first_weights``); ``mesh``: tensor_parallel_size /
    context_parallel_size / context_parallel_algo. The global batch
    is the same rows on any layout: each data-parallel replica takes its share (the ranks of a TP or CP group share
    theirs)."""
    seed_everything(1234)
    # tiny_moe.yaml's policies: half the blocks recompute their activations (their all_to_alls too) in backward.
    block = FAMILIES[family][1]
    strategy = lightning_npu.NPUFSDPStrategy(
        expert_parallel_size=ep, state_dict_type=state_dict_type, auto_wrap_policy=[block],
        activation_checkpointing_policy=[block], activation_checkpointing_ratio=0.5, timeout=300, **mesh,
    )
    losses = Losses()
    callbacks = [losses]
    if state_dict_type == "sharded" and resume is None:
        callbacks.append(SaveAfterFirstEpoch(str(out / f"{name}_epoch0")))
    trainer = Trainer(
        accelerator="npu", devices=devices, strategy=strategy, precision="32-true", max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True, gradient_clip_val=1.0, callbacks=callbacks, limit_val_batches=0,
    )
    lm = module(family, init_from, **(config or {}))
    replicas = devices // (mesh.get("tensor_parallel_size", 1) * mesh.get("context_parallel_size", 1))
    loader = DataLoader(Tokens(), batch_size=4 * BATCH // replicas)
    trainer.fit(lm, train_dataloaders=loader, ckpt_path=resume)
    if state_dict_type == "full":
        trainer.save_checkpoint(out / f"{name}.ckpt")
    weight = next((m.w_gate_up for m in lm.model.modules() if hasattr(m, "w_gate_up")), None)  # the first MoE layer's
    return {"losses": losses.losses, "first_biases": losses.first_biases,
            "local_shape": None if weight is None else list(weight.to_local().shape),
            "placements": None if weight is None else [str(p) for p in weight.placements]}


def fabric_fit(ep: int, steps: int = 6) -> dict:
    """The same model in a Fabric loop under NPUFabricFSDPStrategy, gradients clipped by fabric.clip_gradients."""
    from lightning.fabric import Fabric

    seed_everything(1234)
    fabric = Fabric(accelerator="npu", devices=4, precision="32-true",
                    strategy=lightning_npu.NPUFabricFSDPStrategy(expert_parallel_size=ep, timeout=300))
    fabric.launch()
    lm = module()
    with fabric.init_module(empty_init=False):
        lm.configure_model()
    model = fabric.setup(lm.model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    loader = fabric.setup_dataloaders(DataLoader(Tokens(), batch_size=BATCH))
    losses = []
    for step, batch in zip(range(steps), loader):
        logits = model(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return {"losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    results = {
        "ep1": fit(out, "ep1", 1, state_dict_type="full"),
        "ep2": fit(out, "ep2", 2),
        "ep4": fit(out, "ep4", 4, state_dict_type="full"),
    }
    for ep in (4, 1):
        results[f"ep2_to_ep{ep}"] = fit(out, f"ep2_to_ep{ep}", ep, resume=str(out / "ep2_epoch0"))
    results["fabric_ep1"] = fabric_fit(1)
    results["fabric_ep2"] = fabric_fit(2)
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
