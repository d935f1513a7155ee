"""The recipe's LightningModule: schedule, optimizer groups, hyper-parameters that make checkpoints self-describing."""

import pytest
import torch
from lightning.pytorch import Trainer

from recipes.decoder.module import DecoderLM, warmup_cosine
from recipes.models.llama.config import LLaMAConfig
from recipes.models.llama.model import LLaMA
from tests.helpers import read_json, room_scripts, run_python

SCRIPTS = room_scripts("recipes")


def test_warmup_then_cosine_to_the_floor():
    schedule = warmup_cosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1)  # (0 + 1) / 10
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(500) == pytest.approx(0.1)


def test_no_weight_decay_on_norms_and_biases(tmp_path):
    module = DecoderLM(preset="tiny", weight_decay=0.05)
    module.configure_model()
    trainer = Trainer(accelerator="cpu", max_steps=100, logger=False, default_root_dir=tmp_path)
    module.trainer = trainer
    optimizer = module.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    norm_ids = {id(p) for name, p in module.model.named_parameters() if "norm" in name}
    assert norm_ids and norm_ids <= {id(p) for p in no_decay["params"]}
    assert all(p.ndim >= 2 for p in decay["params"])
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == module.config.num_params()


def test_checkpoint_hparams_describe_the_architecture():
    module = DecoderLM(preset="tiny", config={"n_layers": 2})
    assert module.hparams["config"]["n_layers"] == 2
    assert DecoderLM(**module.hparams).config == module.config  # reloading from hparams rebuilds the same model


def test_bad_schedule_settings_are_rejected():
    with pytest.raises(ValueError, match="min_lr_ratio=1.5 must lie in"):
        DecoderLM(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        DecoderLM(warmup_steps=-1)


def test_loss_of_a_batch_is_next_token_cross_entropy():
    torch.manual_seed(0)
    module = DecoderLM(preset="tiny")
    module.configure_model()
    batch = {"input_ids": torch.randint(0, 2048, (2, 16))}
    batch["labels"] = torch.roll(batch["input_ids"], -1, dims=1)
    expected = torch.nn.functional.cross_entropy(module(batch["input_ids"]).reshape(-1, 2048), batch["labels"].reshape(-1))
    assert module._loss(batch).item() == pytest.approx(expected.item())


@pytest.mark.slow
def test_init_from_reaches_every_shard_and_each_rank_reads_only_its_slices_of_an_hf_directory(tmp_path):
    """A recipe checkpoint: catches every rank reading the full checkpoint (rank 1 is given a path that does not
    exist), a shard that does not receive rank 0's weights, and a config mismatch seen by rank 0 alone (rank 1 would
    hang). An HF directory (85 MB of fp32, largest tensor 16 MiB) under FSDP on 2 ranks: catches a rank reading
    more than its half of the file or holding a whole-model copy (the former rank-0 read peaked at +1.0 of the
    file): each rank reads at most 0.55 of the file's bytes and peaks at most 10% of the file plus one tensor (and
    8 MiB of allocator slack) above its memory before the load; the shards hold the file's tensors exactly. An FP8
    DeepSeek-V3 directory read into shards on dim 0 (experts), dim 1 and replicas: catches a slice of per-expert
    tensors or block scales read at the wrong offset."""
    from recipes.decoder.hf_checkpoint import save_hf_checkpoint
    from tests.recipes.models.test_deepseek import write_fp8_directory

    config = LLaMAConfig.from_preset("tiny", vocab_size=8192, dim=512, n_heads=8, n_kv_heads=4, ffn_hidden_dim=1408)
    torch.manual_seed(0)
    save_hf_checkpoint(config, LLaMA(config).state_dict(), tmp_path / "hf", max_shard_bytes=32 * 2**20)
    file_bytes = sum(path.stat().st_size for path in (tmp_path / "hf").glob("*.safetensors"))
    largest = 4 * config.vocab_size * config.dim
    write_fp8_directory(tmp_path / "fp8")
    run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(SCRIPTS / "init_from_run.py"), str(tmp_path)], simulate=None)
    first, second = (read_json(tmp_path / f"rank{rank}.json") for rank in (0, 1))
    assert first["equal"] is True and first["keys"] == len(LLaMA(LLaMAConfig.from_preset("tiny")).state_dict())
    assert first["mismatch"] == second["mismatch"]
    assert first["mismatch"].startswith("init_from=") and "n_layers=1" in first["mismatch"]
    assert first["hf_equal"] is True
    assert first["fp8_equal"] == second["fp8_equal"] == {"0": True, "1": True, "None": True}
    assert first["hf_mismatch"] == second["hf_mismatch"] and "n_layers=1" in first["hf_mismatch"]
    assert first["stage_equal"] is True and second["stage_equal"] is True
    assert first["stage_keys"] + second["stage_keys"] == len(LLaMA(config).state_dict())
    for scheme in ("int8", "nf4"):
        assert first[f"{scheme}_equal"] is True and first[f"{scheme}_codes"] == 7 * config.n_layers  # q k v o gate up down
    for rank in (first, second):
        for read in ("hf_read", "stage_read", "int8_read", "nf4_read"):
            assert rank[read] <= 0.55 * file_bytes, (read, rank[read], file_bytes)
        assert rank["hf_peak_above"] <= 0.10 * file_bytes + largest + 8 * 2**20, (rank["hf_peak_above"], file_bytes)


def test_the_run_summary_prints_the_steps_losses_not_lightnings_accumulation_share(tmp_path, capsys):
    """Lightning hands ``on_train_batch_end`` the loss divided by ``accumulate_grad_batches``; the recipe's summary
    printed that (half the loss at 2 batches a step) as the run's first and last loss."""
    from lightning.pytorch import LightningModule
    from torch.utils.data import DataLoader

    from recipes.train import RunSummary

    class Constant(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def training_step(self, batch, batch_idx):
            return self.w * 0 + 3.0 + batch_idx  # 3.0 on the first batch, 6.0 on the last (batch 3)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    trainer = Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, callbacks=[RunSummary()])
    trainer.fit(Constant(), DataLoader(torch.zeros(4, 1), batch_size=1))
    assert "train loss: first 3.0000 -> last 6.0000" in capsys.readouterr().out
