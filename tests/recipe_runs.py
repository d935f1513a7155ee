"""Runs of the tiny LLaMA recipe (``recipes/train.py fit``) on 2 simulated NPUs for the tests, and the one trained run
a test session shares.

Many tests only need "a trained run" (a ``last.ckpt`` to export, generate from, fine-tune or resume, or an
uninterrupted run's losses to compare with). Training it costs a process pair and about 20 s on 2 cores, so the
session trains it once (``trained_tiny_run`` in tests/conftest.py) and hands it out read-only; a test that writes
next to it works on ``TrainedRun.copy_to(tmp_path)``. Tests that check what happens during training (a crash, a
signal, a NaN, host syncs) start their own runs with ``train_tiny``.
"""

from __future__ import annotations

import csv
import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO, run_python

TRAIN = str(REPO / "recipes/train.py")
TINY = str(REPO / "recipes/models/llama/configs/tiny.yaml")
TINY_SFT_LORA = str(REPO / "recipes/models/llama/configs/tiny_sft_lora.yaml")
SMALL = ["--data.seq_len", "64", "--data.max_documents", "60", "--data.batch_size", "4",
         "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "4", "--trainer.log_every_n_steps", "2",
         "--trainer.enable_progress_bar", "false", "--model.warmup_steps", "2"]
#: The shared run's schedule (after SMALL): 10 steps, a checkpoint (with validation) every 4, every step's loss in
#: metrics.csv; the warmup ends inside the run, so the LR changes every step. A run meant to reproduce the shared
#: one (a crashed and resumed one) trains with these arguments too.
TRAINED_STEPS = ["--trainer.max_steps", "10", "--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "4",
                 "--model.warmup_steps", "3"]


def train_tiny(root, *extra, simulate=2):
    """``recipes/train.py fit`` of tiny.yaml with SMALL's data and schedule (then ``extra``) into ``root``."""
    return run_python([TRAIN, "fit", "--config", TINY, *SMALL, "--trainer.default_root_dir", str(root), *extra],
                      simulate=simulate)


def last_checkpoint(root, version) -> Path:
    return Path(root) / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"


def logged_losses(root, version) -> dict[int, float]:
    """The training loss of every logged step of a run, from its metrics.csv."""
    with open(Path(root) / "lightning_logs" / f"version_{version}" / "metrics.csv") as metrics:
        rows = [row for row in csv.DictReader(metrics) if row.get("train_loss")]
    return {int(row["step"]): float(row["train_loss"]) for row in rows}


@dataclass(frozen=True)
class TrainedRun:
    """A finished ``train_tiny(root, *TRAINED_STEPS)``: its run directory (``lightning_logs/version_0``) and output."""

    root: Path
    stdout: str

    @property
    def last_ckpt(self) -> Path:
        """The sharded checkpoint ModelCheckpoint wrote at the run's last validation (step 8)."""
        return last_checkpoint(self.root, 0)

    def losses(self) -> dict[int, float]:
        return logged_losses(self.root, 0)

    def copy_to(self, directory: Path) -> "TrainedRun":
        """A copy of the run in ``directory / "run"``, for a test that writes into the run (a resume, a new version);
        ``stdout`` still names the shared run's paths."""
        copy = Path(directory) / "run"
        shutil.copytree(self.root, copy)
        return TrainedRun(copy, self.stdout)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """Every file's size and modification time, to check at the end of the session that no test wrote into it."""
        return {str(p.relative_to(self.root)): (p.stat().st_size, p.stat().st_mtime_ns)
                for p in sorted(self.root.rglob("*")) if p.is_file()}

