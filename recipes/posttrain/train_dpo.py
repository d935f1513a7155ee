"""Train a decoder LM of any family by DPO: ``recipes/train.py``'s command line (the same checks before workers
start, callbacks, checkpoints and resume) with ``DPOLM`` as the model and preference data.

    LIGHTNING_NPU_SIMULATE=2 python recipes/posttrain/train_dpo.py fit --config recipes/models/llama/configs/tiny_dpo.yaml \\
        --model.init_from runs/llama2-tiny/lightning_logs/version_0/checkpoints/last.ckpt
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, so that `recipes` imports (as script_path.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recipes import train  # noqa: E402
from recipes.posttrain.dpo import DPOLM  # noqa: E402

if __name__ == "__main__":
    train.main(model_class=DPOLM)
