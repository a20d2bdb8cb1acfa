"""One line of a pytest junit file: ``N passed, F failed, E errors, S skipped`` and each skip's
reason (and each failure's test), as ``benchmarks/results/gpu-tier-<kind>-<date>.txt`` keeps it.

    python scripts/junit_summary.py gpu-tier.xml
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path


def summarize(path: Path) -> str:
    """The summary of the junit file at ``path`` (every test case counted once)."""
    passed, failed, errors, skipped = [], [], [], []
    for case in ET.parse(path).getroot().iter("testcase"):
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
    parser.add_argument("junit", type=Path)
    args = parser.parse_args()
    print(summarize(args.junit))


if __name__ == "__main__":
    main()
