"""Imported first by the recipe's commands when they run as files (``python recipes/train.py``):

    if __package__ in (None, ""):
        import script_path  # noqa: F401

Python then puts ``recipes/`` on ``sys.path``, not the repository root, so ``import recipes.decoder`` would fail;
this puts the root in front. Run as modules (``python -m recipes.train``) they skip it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
