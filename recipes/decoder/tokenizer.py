"""The recipe's tokenizers: local Hugging Face tokenizer directories, loaded and checked in one place
(by the data module, ``generate.py`` and the Hugging Face export). Nothing is ever downloaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

# Files that define a tokenizer (what the data cache's key hashes); a model directory's weights are not among them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# A directory holding one of these has a tokenizer to load (the others only refine one).
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a directory holding a Hugging Face tokenizer."""
    return Path(path).is_dir() and any((Path(path) / name).is_file() for name in _TOKENIZER_MARKERS)


def load_tokenizer(path: Union[str, os.PathLike]) -> Any:
    """The Hugging Face tokenizer in the local directory ``path``. Raises ``FileNotFoundError`` when ``path`` is
    not a directory and ``ValueError`` when it holds no loadable tokenizer or one without an EOS token (packing
    puts EOS between documents, and generation stops at it)."""
    from transformers import AutoTokenizer

    path = str(path)
    p = Path(path).expanduser()
    if not p.is_dir():
        what = "is a file" if p.exists() else "does not exist"
        raise FileNotFoundError(
            f"Tokenizer path {path!r} {what}: pass a local directory with tokenizer.json and "
            "tokenizer_config.json (e.g. the HF model directory). Nothing is downloaded."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as err:  # transformers raises many types; the cause is kept below
        raise ValueError(
            f"Could not load a Hugging Face tokenizer from {path!r}: {err}. The directory needs tokenizer.json "
            "(or tokenizer.model) and tokenizer_config.json."
        ) from err
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"The tokenizer at {path!r} has no EOS token, which packing puts between documents and generation stops "
            "at; set eos_token in its tokenizer_config.json."
        )
    return tokenizer
