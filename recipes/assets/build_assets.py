"""Rebuild the embedded corpus, instruction set and tokenizer of the LLaMA-2 recipe, byte for byte.

    python recipes/assets/build_assets.py            # rewrite the files next to this script
    python recipes/assets/build_assets.py --check    # rebuild in a temp dir, compare, exit 1 on a difference
    python recipes/assets/build_assets.py --out DIR  # write elsewhere

Corpus: the docstrings of the Python standard library that runs this script, read with ``ast``
(nothing is imported, so no module's import side effects run), one document per module, modules in
path order, leaving out modules whose header names a copyright holder other than the PSF.
Docstrings differ between Python versions, so a byte-identical corpus needs the version in
``BUILT_WITH``; the tokenizer is a function of the corpus (and of the ``tokenizers`` version).

Instruction set: short question/answer samples read off the corpus alone (``build_instructions``), so it
is the same on every Python version given the same corpus: SFT data for the tiny recipe.

Tokenizer: byte-level BPE, 2048 tokens (<s>, </s>, <unk>, the 256 byte symbols, 1789 merges), trained
with HF ``tokenizers`` and written as a ``PreTrainedTokenizerFast`` directory. The two JSON configs are
written here rather than by ``save_pretrained`` so they do not depend on the transformers version.
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import itertools
import json
import os
import re
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
    "instructions.jsonl",
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


def module_name(source: str) -> str:
    """The import name of a corpus record's module: ``Lib/email/mime/text.py`` -> ``email.mime.text``."""
    name = source.removeprefix("Lib/").removesuffix(".py").removesuffix("/__init__")
    return name.replace("/", ".")


# Instruction set. The sizes keep a sample well inside the tiny recipe's 256-token rows (about 3
# characters a token), and the per-module cap keeps the few large modules from being most of the set.
SHOWN_CHARS = 300  # a paragraph given as input is cut to its leading sentences within this
ANSWER_CHARS = 250  # a longer sentence is not used as an answer
PARAGRAPHS_PER_TASK = 3  # per module, for each of the two paragraph tasks
SYSTEM_PROMPT = "You answer questions about the documentation of the Python 3.11 standard library."
ASK_MODULE = "Which standard-library module is this documentation from?"
ASK_CONTINUE = "Continue this documentation."
ASK_FIRST = "Give the first sentence of the documentation of module {module}."
ASK_FILE = "Which file of the standard library defines that module?"
ASK_FILE_MODULE = "Which module does the standard-library file {source} define? Give its import name."
# A sentence ends at . ! or ? before whitespace and a capital letter, except after these abbreviations.
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
ABBREVIATIONS = ("e.g.", "i.e.", "cf.", "vs.")


def prose_paragraphs(text: str) -> list[str]:
    """The paragraphs of a document that are plain prose, whitespace collapsed onto one line: code,
    doctests and lists (a line that is indented or starts with ``>>>``, ``-`` or ``*``), and paragraphs
    that do not start with a capital letter, do not end a sentence or are shorter than ``MIN_WORDS``
    words are left out."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").splitlines()
        if any(line[:1].isspace() or line.startswith((">>>", "-", "*")) for line in lines):
            continue
        paragraph = " ".join(block.split())
        if paragraph[:1].isupper() and paragraph.endswith((".", "!", "?")) and len(paragraph.split()) >= MIN_WORDS:
            paragraphs.append(paragraph)
    return paragraphs


def sentences(paragraph: str) -> list[str]:
    """A prose paragraph split at ``SENTENCE_END``, the pieces after an abbreviation joined back."""
    parts: list[str] = []
    for part in SENTENCE_END.split(paragraph):
        if parts and parts[-1].endswith(ABBREVIATIONS):
            parts[-1] += " " + part
        else:
            parts.append(part)
    return parts


def leading(parts: list[str], chars: int) -> list[str]:
    """The longest run of leading sentences of ``parts`` that is at most ``chars`` characters long."""
    n = 0
    while n < len(parts) and len(" ".join(parts[: n + 1])) <= chars:
        n += 1
    return parts[:n]


def unseen(candidates: list[tuple[str, str, str]], seen: set[tuple[str, str]]) -> Iterator[dict[str, str]]:
    """Instruction samples of the ``(instruction, input, output)`` candidates whose instruction and input are
    not in ``seen`` (adding them): the standard library repeats some docstrings in several modules, and an
    input must have one answer."""
    for instruction, text, output in candidates:
        if (instruction, text) not in seen:
            seen.add((instruction, text))
            yield {"instruction": instruction, "input": text, "output": output}


def build_instructions(records: list[dict[str, str]]) -> list[dict]:
    """SFT samples made from corpus records, module by module in corpus order; a module without a prose
    paragraph gives none. For module ``m`` (``module_name``), file ``f`` (its ``source``) and its prose
    paragraphs split into sentences:

    * a chat: "Give the first sentence of the documentation of module m." -> the first sentence (if at
      most ``ANSWER_CHARS``), then "Which file of the standard library defines that module?" -> ``f``;
      every second module's chat (odd record index) starts with ``SYSTEM_PROMPT`` as a system message;
    * an instruction: "Which module does the standard-library file f define? ..." -> ``m``;
    * each paragraph whose first sentence fits ``SHOWN_CHARS``: "Which standard-library module is this
      documentation from?", input: its leading sentences within ``SHOWN_CHARS`` -> ``m``;
    * each paragraph of two or more sentences whose leading sentences (all but at least the last, within
      ``SHOWN_CHARS``) are followed by a sentence of at most ``ANSWER_CHARS``: "Continue this
      documentation.", input: those sentences -> that next sentence.

    Each of the two paragraph tasks takes the module's first ``PARAGRAPHS_PER_TASK`` such paragraphs
    whose input was not already given for the same instruction (``unseen``).
    """
    samples: list[dict] = []
    seen: set[tuple[str, str]] = set()
    for index, record in enumerate(records):
        module, source = module_name(record["source"]), record["source"]
        paragraphs = [sentences(p) for p in prose_paragraphs(record["text"])]
        if not paragraphs:
            continue
        if len(paragraphs[0][0]) <= ANSWER_CHARS:
            chat = [
                {"role": "user", "content": ASK_FIRST.format(module=module)},
                {"role": "assistant", "content": paragraphs[0][0]},
                {"role": "user", "content": ASK_FILE},
                {"role": "assistant", "content": source},
            ]
            system = [{"role": "system", "content": SYSTEM_PROMPT}] if index % 2 else []
            samples.append({"messages": system + chat})
        samples.append({"instruction": ASK_FILE_MODULE.format(source=source), "output": module})
        identify, follow = [], []
        for paragraph in paragraphs:
            shown, before = leading(paragraph, SHOWN_CHARS), leading(paragraph[:-1], SHOWN_CHARS)
            if shown:
                identify.append((ASK_MODULE, " ".join(shown), module))
            if before and len(paragraph[len(before)]) <= ANSWER_CHARS:
                follow.append((ASK_CONTINUE, " ".join(before), paragraph[len(before)]))
        for candidates in (identify, follow):
            samples += itertools.islice(unseen(candidates, seen), PARAGRAPHS_PER_TASK)
    return samples


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


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def build(out: Path, root: Path | None = None) -> None:
    """Write corpus.jsonl, instructions.jsonl, PSF-LICENSE.txt and tokenizer/ under ``out``."""
    root = root or stdlib_dir()
    records = build_corpus(root)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "corpus.jsonl", records)
    write_jsonl(out / "instructions.jsonl", build_instructions(records))
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
