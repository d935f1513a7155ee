"""Imported first by the recipe's scripts when they run as files (``python recipes/llama2/train.py``):

    if __package__ in (None, ""):
        import script_path  # noqa: F401

Python then puts ``recipes/llama2/`` on ``sys.path``, not the repository root, so ``import recipes.llama2``
would fail; this puts the root in front. Run as modules (``python -m recipes.llama2.train``) they skip it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
