"""A Trainer run on 2 simulated NPUs with ModelCheckpoint(save_last=True, save_top_k=1) after every epoch, for the
checkpoint tests. It can crash one rank at a chosen moment of a chosen save, fail a background save, resume, run
lr_find first, or evaluate a checkpoint afterwards.

Crash points (``--crash POINT --crash-save N``: the N-th checkpoint save of the run; a save of ``last.ckpt`` is one):
  data      rank 1 dies while writing its shard (leaves a truncated ``.distcp`` file)
  metadata  rank 0 dies after every shard is written, before DCP's ``.metadata``
  meta      rank 0 dies after the shards and ``.metadata``, before ``meta.pt``
  publish   rank 0 dies between moving the old checkpoint aside and renaming the new one in
The dying rank first writes ``<out>/crashed-rank<r>`` so the test knows the crash happened where it asked.

Rank 0 writes ``<out>/result.json``: per-step losses (averaged over ranks), the checkpoint directory's entries, and
whatever the chosen extras measured.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_npu
from tests.strategies.scripts.trainer_run import Block, Regression, data

CRASH_EXIT = 17


class _Counter:
    def __init__(self, target: int) -> None:
        self.calls, self.target = 0, target

    def hit(self) -> bool:
        self.calls += 1
        return self.calls == self.target


def _die(out: Path, rank: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"crashed-rank{rank}").write_text("crashed")
    os._exit(CRASH_EXIT)


def install_crash(point: str, save: int, out: Path, rank: int) -> None:
    """Monkeypatch torch's DCP writer, torch.save or os.replace so that one rank dies at ``point`` of save ``save``."""
    from torch.distributed.checkpoint import filesystem

    counter = _Counter(save)
    if point == "data" and rank == 1:
        original_write = filesystem._FileSystemWriter.write_data

        def write_data(self, plan, planner):
            if counter.hit():
                # Half a shard on disk, as a rank killed mid-write leaves it.
                (Path(self.path) / f"{plan.storage_data.prefix}0.distcp").write_bytes(b"\x00" * 64)
                _die(out, rank)
            return original_write(self, plan, planner)

        filesystem._FileSystemWriter.write_data = write_data
    elif point == "metadata" and rank == 0:
        original_finish = filesystem._FileSystemWriter.finish

        def finish(self, metadata, results):
            if counter.hit():
                _die(out, rank)
            return original_finish(self, metadata, results)

        filesystem._FileSystemWriter.finish = finish
    elif point == "meta" and rank == 0:
        original_save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and Path(f).name == "meta.pt" and counter.hit():
                _die(out, rank)
            return original_save(obj, f, *args, **kwargs)

        torch.save = save
    elif point == "publish" and rank == 0:
        original_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if ".tmp-" in Path(src).name and counter.hit():
                _die(out, rank)
            return original_replace(src, dst, *args, **kwargs)

        os.replace = replace


def install_failure(save: int, rank: int) -> None:
    """Rank 1's shard write of save ``save`` raises, as a full disk would."""
    from torch.distributed.checkpoint import filesystem

    if rank != 1:
        return
    counter = _Counter(save)
    original_write = filesystem._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if counter.hit():
            raise OSError(28, "No space left on device (injected)")
        return original_write(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data


class SGDRegression(Regression):
    """The test model with an optimizer that keeps no state (plain SGD, no momentum)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x).float(), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


def full_parameter_sum(module: torch.nn.Module) -> float:
    """Sum of every parameter element, gathered across ranks (a collective: call on every rank)."""
    total = 0.0
    for parameter in module.parameters():
        value = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
        total += float(value.detach().double().sum())
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--save-top-k", type=int, default=1)
    parser.add_argument("--crash", choices=["data", "metadata", "meta", "publish"], default=None)
    parser.add_argument("--crash-save", type=int, default=4)
    parser.add_argument("--fail-save", type=int, default=None)
    parser.add_argument("--lr-find", action="store_true")
    parser.add_argument("--evaluate", default=None, help="after fit: validate/test/predict with this ckpt_path")
    args = parser.parse_args()
    out = Path(args.out)

    seed_everything(7)
    extra = {"async_save": True} if args.async_save else {}
    strategy = lightning_npu.NPUFSDPStrategy(auto_wrap_policy={Block}, state_dict_type=args.state_dict_type, timeout=60,
                                             **extra)
    checkpoint = ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=args.save_top_k, every_n_epochs=1,
                                 save_on_train_epoch_end=True)
    trainer = Trainer(
        accelerator="npu", devices=2, strategy=strategy, max_epochs=args.epochs, callbacks=[checkpoint],
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
        num_sanity_val_steps=0, deterministic=True,
    )
    model = SGDRegression() if args.optimizer == "sgd" else Regression()
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set for the launched rank; rank 0 is the launching process
    if args.crash:
        install_crash(args.crash, args.crash_save, out, rank)
    if args.fail_save:
        install_failure(args.fail_save, rank)
    result = {}
    if args.lr_find:
        from lightning.pytorch.tuner import Tuner

        initial = sum(float(p.detach().double().sum()) for p in model.parameters())
        finder = Tuner(trainer).lr_find(model, train_dataloaders=data(), val_dataloaders=data(16), num_training=3, update_attr=False,
                                        early_stop_threshold=None)
        result.update(lr_find_points=len(finder.results["lr"]), lr_find_suggestion=finder.suggestion(),
                      initial_parameter_sum=initial, restored_parameter_sum=full_parameter_sum(model))
    trainer.fit(model, train_dataloaders=data(), val_dataloaders=data(16), ckpt_path=args.resume)
    if args.evaluate:
        result["validate"] = trainer.validate(model, dataloaders=data(16), ckpt_path=args.evaluate)[0]["val_loss"]
        result["test"] = trainer.test(model, dataloaders=data(16), ckpt_path=args.evaluate)[0]["test_loss"]
        predictions = trainer.predict(model, dataloaders=data(16), ckpt_path=args.evaluate)
        result["predict"] = float(sum(p.double().sum() for p in predictions))
    if trainer.global_rank == 0:
        result.update(losses=model.losses, entries=sorted(p.name for p in Path(args.ckpt_dir).iterdir()),
                      last=checkpoint.last_model_path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
