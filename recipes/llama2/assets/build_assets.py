"""Rebuild the embedded corpus and tokenizer of the LLaMA-2 recipe, byte for byte.

    python recipes/llama2/assets/build_assets.py            # rewrite the files next to this script
    python recipes/llama2/assets/build_assets.py --check    # rebuild in a temp dir, compare, exit 1 on a difference
    python recipes/llama2/assets/build_assets.py --out DIR  # write elsewhere

Corpus: the docstrings of the Python standard library that runs this script, read with ``ast``
(nothing is imported, so no module's import side effects run), one document per module, modules in
path order, leaving out modules whose header names a copyright holder other than the PSF.
Docstrings differ between Python versions, so a byte-identical corpus needs the version in
``BUILT_WITH``; the tokenizer is a function of the corpus (and of the ``tokenizers`` version).

Tokenizer: byte-level BPE, 2048 tokens (<s>, </s>, <unk>, the 256 byte symbols, 1789 merges), trained
with HF ``tokenizers`` and written as a ``PreTrainedTokenizerFast`` directory. The two JSON configs are
written here rather than by ``save_pretrained`` so they do not depend on the transformers version.
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

BUILT_WITH = (3, 11)
VOCAB_SIZE = 2048
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
# Tests, tools, GUI demos and vendored packages are mostly code, not prose; site-packages is not stdlib.
SKIP_DIRS = {
    "__pycache__",
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "venv",
    "distutils",
    "unittest",
}
MIN_WORDS = 8  # shorter docstrings ("Return self.") add repetition, not language
HEADER_CHARS = 5000  # where modules put their copyright notices
OUTPUTS = (
    "corpus.jsonl",
    "PSF-LICENSE.txt",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/special_tokens_map.json",
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_files(root: Path) -> list[Path]:
    """Standard-library ``.py`` files under ``root`` in sorted path order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of a module and its classes and functions, in source order."""
    text = ast.get_docstring(node, clean=True)
    if text:
        yield text
    for child in getattr(node, "body", []):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from docstrings(child)


def names_other_copyright_holder(source: str) -> bool:
    """Whether a module's header carries a copyright notice of someone other than the PSF.

    All of CPython ships under the PSF license, but leaving out modules with their own notices keeps
    the corpus's licensing a single sentence.
    """
    header = source[:HEADER_CHARS].lower()
    return any("copyright" in line and "python software foundation" not in line for line in header.splitlines())


def build_corpus(root: Path) -> list[dict[str, str]]:
    """One record ``{"text", "source"}`` per module that has docstrings worth keeping."""
    records = []
    for path in module_files(root):
        source = path.read_text(encoding="utf-8")
        if names_other_copyright_holder(source):
            continue
        tree = ast.parse(source, filename=str(path))
        parts = [d for d in docstrings(tree) if len(d.split()) >= MIN_WORDS]
        if parts:
            records.append({"text": "\n\n".join(parts), "source": f"Lib/{path.relative_to(root).as_posix()}"})
    return records


def train_tokenizer(texts: list[str]):
    """Byte-level BPE with exactly ``VOCAB_SIZE`` tokens (a ``tokenizers.Tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"BPE training produced {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}: the corpus is too "
            "small to learn enough merges."
        )
    return tokenizer


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build(out: Path, root: Path | None = None) -> None:
    """Write corpus.jsonl, PSF-LICENSE.txt and tokenizer/ under ``out``."""
    root = root or stdlib_dir()
    records = build_corpus(root)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
    # The PSF license asks that its notice travel with derived works.
    shutil.copyfile(root / "LICENSE.txt", out / "PSF-LICENSE.txt")

    tok_dir = out / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    train_tokenizer([r["text"] for r in records]).save(str(tok_dir / "tokenizer.json"), pretty=True)
    write_json(
        tok_dir / "tokenizer_config.json",
        # clean_up_tokenization_spaces off: decode must give back the exact text (" ." stays " .").
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **SPECIAL_TOKENS},
    )
    write_json(tok_dir / "special_tokens_map.json", SPECIAL_TOKENS)


def differing_outputs(a: Path, b: Path) -> list[str]:
    """Output files that are missing from, or differ between, build directories ``a`` and ``b``."""
    return [
        name
        for name in OUTPUTS
        if not ((a / name).is_file() and (b / name).is_file() and filecmp.cmp(a / name, b / name, shallow=False))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with --out")
    args = parser.parse_args(argv)
    if sys.version_info[:2] != BUILT_WITH:
        print(
            f"note: the committed corpus was built with Python {BUILT_WITH[0]}.{BUILT_WITH[1]}; this is "
            f"{sys.version_info[0]}.{sys.version_info[1]}, whose docstrings differ.",
            file=sys.stderr,
        )
    if not args.check:
        build(args.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        differ = differing_outputs(Path(tmp), args.out)
    if differ:
        print(f"differs from a fresh build: {differ}", file=sys.stderr)
        return 1
    print("assets match a fresh build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
