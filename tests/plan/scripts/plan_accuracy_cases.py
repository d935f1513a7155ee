"""The planner against measured peaks for tests/plan/test_accuracy.py: ``compare`` (benchmarks/plan_accuracy.py's own
measurement) of each case of the JSON ``cases`` argument, one worker process each; writes ``<out>`` with each case's
row, or the error it raised (a case that fails does not hide the others' rows)."""

import json
import sys
from pathlib import Path

from benchmarks.plan_accuracy import compare


def main() -> None:
    cases, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    timeout = float(sys.argv[3])
    results = {}
    for name, case in cases.items():
        try:
            results[name] = {"row": compare(name, dict(case, backend="fake"), out.parent, timeout=timeout)}
        except Exception as error:  # reported by that case's test
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
