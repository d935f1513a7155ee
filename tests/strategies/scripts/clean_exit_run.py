"""A 3-step run on 2 simulated NPUs with no teardown (nothing destroys a process group), for the clean-exit test
and ``benchmarks/clean_exit.py``.

Started three ways: by ``lightning-npu run --devices 2`` (a no-argument ``Fabric()``; this script imports no
lightning_npu then), with ``--launch`` (``Fabric(accelerator="npu", devices=2).launch()``: Lightning starts rank 1
from rank 0), or with ``--trainer`` (``Trainer(accelerator="npu", devices=2).fit`` of 3 steps, launched the same way).
Options: ``--strategy`` (npu_ddp by default); ``--async-save DIR`` (Fabric, npu_fsdp with ``async_save=True``: a save
started after the last step is still being written when the script ends, on the async-checkpoint gloo group);
``--kill-rank R --sync-dir DIR``: once every rank has finished, rank R SIGKILLs itself and the other ranks exit only
after it is dead, so they exit while a peer is gone.

Each process prints ``clean-exit: rank R pid P finished`` when the script is done, then, from an atexit hook
registered before any process group exists (atexit runs last-registered first, so this one runs after the
plugin's), at the very end of Python's exit: ``clean-exit: rank R pid P at teardown: process groups left B, gloo
worker threads N``.
"""

import argparse
import atexit
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

MARKER = "clean-exit:"
#: How long a rank waits for its peers in the --kill-rank handshake.
SYNC_TIMEOUT_S = 120


def gloo_worker_threads() -> int:
    """Threads gloo runs collectives on (``pt_gloo_runloop``): they end when their process group is freed."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() == "pt_gloo_runloop"
        except OSError:  # a thread that ended during the scan (the exit hook's cancelled watchdog timer does)
            pass
    return count


def report_teardown(rank: list) -> None:
    print(f"{MARKER} rank {rank[0]} pid {os.getpid()} at teardown: process groups left"
          f" {torch.distributed.is_initialized()}, gloo worker threads {gloo_worker_threads()}", flush=True)


def fabric_steps(args: argparse.Namespace) -> int:
    """Three AdamW steps under Fabric, each logging the loss averaged over ranks; the global rank."""
    from lightning.fabric import Fabric

    if args.launch:
        import lightning_npu

        strategy = lightning_npu.NPUFabricFSDPStrategy(async_save=True) if args.async_save else args.strategy
        fabric = Fabric(accelerator="npu", devices=2, strategy=strategy)
        fabric.launch()
    else:
        fabric = Fabric()  # lightning-npu run configured it
    model = fabric.setup(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(3):
        loss = model(torch.randn(8, 16, device=fabric.device)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.all_reduce(loss.detach(), reduce_op="mean").item()  # the logged loss: the last collective
    if args.async_save:
        fabric.save(args.async_save, {"model": model, "optimizer": optimizer})  # returns while still writing
    return fabric.global_rank


def trainer_steps(args: argparse.Namespace) -> int:
    """Three optimizer steps of the integration tests' regression module under the Trainer; the global rank."""
    from lightning.pytorch import Trainer

    import lightning_npu  # noqa: F401
    from tests.strategies.scripts.trainer_run import Regression, data

    trainer = Trainer(accelerator="npu", devices=2, strategy=args.strategy, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), train_dataloaders=data())
    return trainer.global_rank


def kill_handshake(rank: int, kill_rank: int, sync_dir: Path) -> None:
    """Rank ``kill_rank`` SIGKILLs itself once every other rank has finished; the others return once it is dead."""
    sync_dir.mkdir(parents=True, exist_ok=True)
    if rank == kill_rank:
        # Written under another name, then renamed: a peer polling for the file must never read it half-written
        # (an empty pid failed the survivor with a ValueError: the intermittent exit 1 of the killed-peer case).
        (sync_dir / "victim.pid.partial").write_text(str(os.getpid()))
        os.replace(sync_dir / "victim.pid.partial", sync_dir / "victim.pid")
        _wait_for(lambda: (sync_dir / "survivor.done").exists(), "the surviving rank to finish")
        os.kill(os.getpid(), signal.SIGKILL)
    (sync_dir / "survivor.done").touch()
    _wait_for(lambda: (sync_dir / "victim.pid").exists() and not _alive(int((sync_dir / "victim.pid").read_text())),
              f"rank {kill_rank} to be killed")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its status is left for its parent


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {SYNC_TIMEOUT_S} s for {what}")
        time.sleep(0.05)


def main(rank: list) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launch", action="store_true")
    parser.add_argument("--trainer", action="store_true")
    parser.add_argument("--strategy", default="npu_ddp")
    parser.add_argument("--async-save", default=None)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--sync-dir", type=Path, default=None)
    args = parser.parse_args()
    rank[0] = trainer_steps(args) if args.trainer else fabric_steps(args)
    if args.kill_rank is not None:
        kill_handshake(rank[0], args.kill_rank, args.sync_dir)
    print(f"{MARKER} rank {rank[0]} pid {os.getpid()} finished", flush=True)


if __name__ == "__main__":
    # Known before any process group exists (Lightning's launcher gives rank 1 LOCAL_RANK, torchrun RANK).
    process_rank = [int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))]
    atexit.register(report_teardown, process_rank)
    main(process_rank)
    sys.stdout.flush()
