"""Ordinary LightningModules, written the way people write them, for the npu_fsdp compatibility suite.

Each model computes its loss in ``loss(batch)`` (its ``training_step`` calls it), so a test can compute the loss
of the freshly built model on a batch outside any Trainer, and each has a ``dataset()`` of 32 samples. Models
built in ``configure_model`` seed themselves there, so that rebuilding one gives the same weights.
"""

from __future__ import annotations

import os

import torch
import torchmetrics
from lightning.pytorch import LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

WIDTH = 16
VOCAB = 32
SEQ = 8


def _regression(seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, WIDTH, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def _tokens(seed: int = 0) -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(seed)))


class Residual(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Base(LightningModule):
    dataset = staticmethod(_regression)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ModuleListNet(Base):
    """Layers in an ``nn.ModuleList`` child (a container without ``forward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self(x), y)


class ModuleDictNet(Base):
    """Encoder and decoder in an ``nn.ModuleDict``."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({"encoder": nn.Sequential(Residual(), Residual()), "decoder": nn.Linear(WIDTH, 1)})

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.parts["decoder"](self.parts["encoder"](x)), y)


class OwnParameterNet(Base):
    """A learnable temperature held by the LightningModule itself."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(Residual(), Residual(), nn.Linear(WIDTH, 1))
        self.temperature = nn.Parameter(torch.tensor(2.0))

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x) / self.temperature, y)


class TiedNet(Base):
    """An embedding tied to the output head through two children."""

    dataset = staticmethod(_tokens)

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(Residual(), Residual())
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embedding.weight

    def loss(self, batch):
        (tokens,) = batch
        logits = self.head(self.blocks(self.embedding(tokens[:, :-1])))
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def tied(self):
        return self.embedding.weight, self.head.weight


class CustomInitNet(Base):
    """Initialisation in ``__init__`` beyond the layers' defaults: a scaled head and a filled bias."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Residual(), Residual())
        self.head = nn.Linear(WIDTH, 1)
        with torch.no_grad():
            self.head.weight.mul_(0.01)
            self.head.bias.fill_(0.5)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.head(self.blocks(x)), y)


class Shift(nn.Module):
    """A module with a buffer and no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.empty(WIDTH))

    def forward(self, x):
        return x - self.offset


class ConfigureModelNet(Base):
    """Built in ``configure_model`` with custom initialisation, weights loaded from a file and a buffer of a module
    without ``reset_parameters``; ``training_step`` never calls ``forward``."""

    def __init__(self, weights_file: str) -> None:
        super().__init__()
        self.weights_file = weights_file
        self.encoder = None

    def configure_model(self) -> None:
        if self.encoder is not None:
            return
        torch.manual_seed(1234)
        self.shift = Shift()
        self.shift.offset.fill_(0.25)
        self.encoder = nn.Sequential(Residual(), Residual())
        self.encoder.load_state_dict(torch.load(self.weights_file))
        self.head = nn.Linear(WIDTH, 1)
        with torch.no_grad():
            self.head.weight.mul_(3.0)
            self.head.bias.fill_(-0.5)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.head(self.encoder(self.shift(x))), y)

    @staticmethod
    def write_weights(path: str) -> None:
        torch.manual_seed(99)
        torch.save(nn.Sequential(Residual(), Residual()).state_dict(), path)


class UserShardedNet(Base):
    """Built in ``configure_model``, which seeds and shards each block itself with ``fully_shard`` on
    ``self.device_mesh``, as Lightning's ModelParallelStrategy users write it (no mesh, no sharding: npu_ddp)."""

    def __init__(self, change_after_sharding: bool = False) -> None:
        super().__init__()
        self.change_after_sharding = change_after_sharding
        self.blocks = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        torch.manual_seed(4321)
        self.blocks = nn.Sequential(Residual(), Residual())
        self.head = nn.Linear(WIDTH, 1)
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh)
        if self.change_after_sharding:
            with torch.no_grad():
                self.blocks[0].linear.weight.to_local().mul_(2.0)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.head(self.blocks(x)), y)


class FrozenBackboneNet(Base):
    """A frozen backbone under a trainable head; the optimizer holds the trainable parameters only."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(Residual(), Residual(), Residual())
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class ManualOptimizationNet(Base):
    """Manual optimization: ``manual_backward``, gradient clipping, an explicit optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.blocks = nn.Sequential(Residual(), Residual())
        self.head = nn.Linear(WIDTH, 1)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.head(self.blocks(x)), y)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.loss(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss.detach()


class MetricsNet(Base):
    """torchmetrics objects logged from the steps."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Residual(), Residual())
        self.head = nn.Linear(WIDTH, 1)
        self.train_mse = torchmetrics.MeanSquaredError()
        self.train_mae = torchmetrics.MeanAbsoluteError()

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.head(self.blocks(x)), y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.head(self.blocks(x))
        self.train_mse(prediction, y)
        self.train_mae(prediction, y)
        self.log_dict({"train_mse": self.train_mse, "train_mae": self.train_mae}, on_step=True, on_epoch=True)
        return F.mse_loss(prediction, y)


class GPT2Net(Base):
    """A Hugging Face GPT-2 built from a config (tied input and output embeddings), wrapped as people do."""

    dataset = staticmethod(_tokens)

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=2,
                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = GPT2LMHeadModel(config)

    def loss(self, batch):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def tied(self):
        return self.model.transformer.wte.weight, self.model.lm_head.weight

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class BatchNormNet(Base):
    """BatchNorm layers (on the input and between blocks), built in ``configure_model``; the suite trains it with
    ``Trainer(sync_batchnorm=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        torch.manual_seed(4321)
        self.net = nn.Sequential(nn.BatchNorm1d(WIDTH), Residual(), nn.BatchNorm1d(WIDTH), Residual(), nn.Linear(WIDTH, 1))

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x), y)


class FSDP1WrapNet(Base):
    """Blocks annotated with FSDP1's ``wrap()`` in ``configure_model``, as written for Lightning's FSDPStrategy."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp.wrap import wrap

        if self.blocks is not None:
            return
        torch.manual_seed(2468)
        self.blocks = nn.Sequential(wrap(Residual()), wrap(Residual()))
        self.head = nn.Linear(WIDTH, 1)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.head(self.blocks(x)), y)


class FSDP1UnitNet(ModuleListNet):
    """A block wrapped in FSDP1's ``FullyShardedDataParallel`` in ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not isinstance(self.blocks[0], FullyShardedDataParallel):
            self.blocks[0] = FullyShardedDataParallel(self.blocks[0], device_id=torch.device("cpu"))


class FSDP1EnableWrapNet(ModuleListNet):
    """FSDP1's ``enable_wrap`` entered in ``configure_model``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap, wrap

        with enable_wrap(wrapper_cls=FullyShardedDataParallel):
            self.head = wrap(self.head)


#: name -> how to build the model (given the run's scratch directory).
MODELS = {
    "module_list": lambda out: ModuleListNet(),
    "module_dict": lambda out: ModuleDictNet(),
    "own_parameter": lambda out: OwnParameterNet(),
    "tied_embedding_head": lambda out: TiedNet(),
    "custom_init": lambda out: CustomInitNet(),
    "configure_model": lambda out: ConfigureModelNet(os.path.join(out, "encoder.pt")),
    "user_fully_shard": lambda out: UserShardedNet(),
    "frozen_backbone": lambda out: FrozenBackboneNet(),
    "manual_optimization": lambda out: ManualOptimizationNet(),
    "torchmetrics": lambda out: MetricsNet(),
    "hf_gpt2": lambda out: GPT2Net(),
    "fsdp1_wrap": lambda out: FSDP1WrapNet(),
}

#: Models the suite trains with particular Trainer arguments (not with every strategy's defaults).
SPECIAL_MODELS = {"batch_norm": lambda out: BatchNormNet()}


class L2PenaltyNet(ModuleListNet):
    """An explicit L2 penalty over ``self.parameters()`` in ``training_step``."""

    def training_step(self, batch, batch_idx):
        return self.loss(batch) + 1e-4 * sum(p.pow(2).sum() for p in self.parameters())
