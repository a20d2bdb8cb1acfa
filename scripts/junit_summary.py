"""One line over pytest junit files: ``N passed, F failed, E errors, S skipped``, then each
skip's reason and each failure's test, as ``benchmarks/results/gpu-tier-<kind>-<date>.txt``
keeps it. A file that is missing (its pytest never finished) is named and counted as an error.

    python scripts/junit_summary.py gpu-tier-side.xml gpu-tier-one.xml gpu-tier-two.xml
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path


def summarize(paths: list[Path]) -> str:
    """The summary of the junit files at ``paths`` (every test case counted once)."""
    passed: list[str] = []
    failed: list[str] = []
    errors = [f"{p} (no junit file: its pytest did not finish)" for p in paths if not p.exists()]
    skipped: list[str] = []
    cases = (c for p in paths if p.exists() for c in ET.parse(p).getroot().iter("testcase"))
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "error" in kinds:
            errors.append(name)
        elif "failure" in kinds:
            failed.append(name)
        elif "skipped" in kinds:
            skipped.append(f"{name} ({kinds['skipped'].get('message', '').strip()})")
        else:
            passed.append(name)
    head = (f"{len(passed)} passed, {len(failed)} failed, {len(errors)} errors, "
            f"{len(skipped)} skipped")  # fmt: skip
    lines = [head]
    lines += [f"skipped: {s}" for s in skipped]
    lines += [f"failed: {s}" for s in failed] + [f"error: {s}" for s in errors]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, nargs="+")
    args = parser.parse_args()
    print(summarize(args.junit))


if __name__ == "__main__":
    main()
