"""A LightningModule as a user with their own project writes it, pipelined through the one parallelism protocol:
nothing of the recipes. Its model classifies sequences of float features: an input projection (with a persistent
buffer that scales the features), residual blocks that take only ``x``, a final norm, masked mean pooling (the mask
is a keyword input, split into the microbatches like the rows) and a head; its loss is cross entropy over the rows
whose label is not -100. ``parallel_plan`` names its parts: the projection goes with the first stage, the norm and
head with the last."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_npu.parallel import ParallelPlan, PipelineLayout

FEATURES, SEQ, WIDTH, CLASSES, DEPTH = 8, 12, 32, 5, 4


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.norm(x))


class SequenceClassifier(nn.Module):
    def __init__(self, features: int = FEATURES, width: int = WIDTH, classes: int = CLASSES, depth: int = DEPTH):
        super().__init__()
        self.register_buffer("feature_scale", torch.linspace(0.5, 1.5, features))
        self.project = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor, *, labels: Optional[Tensor] = None, mask: Optional[Tensor] = None) -> Tensor:
        # Under pipeline parallelism a stage holds some parts only, the others None: the first stage's input is x,
        # a later one's the activations the previous stage returned, and all but the last return those.
        h = x if self.project is None else self.project(x * self.feature_scale)
        for block in self.blocks:
            h = block(h)
        if self.head is None:
            return h
        h = self.norm(h)
        weights = torch.ones(h.shape[:2], dtype=h.dtype, device=h.device) if mask is None else mask.to(h.dtype)
        pooled = (h * weights[..., None]).sum(1) / weights.sum(1, keepdim=True).clamp_min(1)
        logits = self.head(pooled)
        return logits if labels is None else self.loss(logits, labels)

    def loss(self, logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
        return F.cross_entropy(logits, labels, ignore_index=-100, reduction=reduction)


class Classify(LightningModule):
    def __init__(self, learning_rate: float = 3e-3) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.model = SequenceClassifier()

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(pipeline=PipelineLayout(module="model", inputs=("project",), blocks="blocks",
                                                    outputs=("norm", "head")))

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.model(batch["x"], labels=batch["labels"], mask=batch["mask"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self.model(batch["x"], labels=batch["labels"], mask=batch["mask"]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


class Sequences(Dataset):
    """``count`` sequences of features drawn from 16 (so the loss falls), each with its class; 30 % of the labels
    -100, and a mask leaving out each row's last few positions."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(0)
        base = torch.randn(16, SEQ, FEATURES, generator=generator)
        classes = torch.randint(0, CLASSES, (16,), generator=generator)
        pick = torch.randint(0, 16, (count,), generator=torch.Generator().manual_seed(seed))
        self.x, self.labels = base[pick], classes[pick].masked_fill(
            torch.rand(count, generator=torch.Generator().manual_seed(seed + 1)) < 0.3, -100)
        unmasked = SEQ - torch.randint(0, 4, (count, 1), generator=torch.Generator().manual_seed(seed + 2))
        self.mask = torch.arange(SEQ) < unmasked

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.labels[i], "mask": self.mask[i]}
