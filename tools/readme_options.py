"""Write ``npu_fsdp``'s options table into README.md, between its two markers, from the one declaration
(``lightning_npu.facts.options.FSDPOptions``, rendered by ``options_table``).

Usage::

    python tools/readme_options.py            # rewrites README.md next to this folder
    python tools/readme_options.py --check    # exit status 1 if the table is stale (tests/test_options.py checks it)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_npu.facts.options import options_table

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN = "<!-- npu_fsdp options: generated from lightning_npu/facts/options.py by tools/readme_options.py -->\n"
END = "<!-- end of npu_fsdp options -->\n"


def with_table(text: str) -> str:
    """``text`` (a README) with the generated table between the markers; ValueError if they are missing."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no {BEGIN.strip()} ... {END.strip()} block to write the options table into")
    return text[: start + len(BEGIN)] + options_table() + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the table is stale")
    args = parser.parse_args(argv)
    text = README.read_text()
    updated = with_table(text)
    if args.check:
        if updated != text:
            print(f"{README}: the npu_fsdp options table is stale; run python tools/readme_options.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
