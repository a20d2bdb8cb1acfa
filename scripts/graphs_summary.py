"""One summary line per result of ``scripts/gpu_graphs.sh``: the eager step vs CUDA graphs.

    python3 scripts/graphs_summary.py throughput DIR/engine_throughput.json
    python3 scripts/graphs_summary.py profile DIR/engine_profile.json
    python3 scripts/graphs_summary.py e2e DIR/e2e-on.json

Reads the JSON of ``benchmarks/engine_throughput.py``, ``engine_profile.py`` or ``e2e.py`` and
prints one line; a missing or unreadable file prints what is missing (exit status 0 either way:
the line goes into the run's summary).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _f(x: Any, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def _graphs(stats: dict[str, Any] | None) -> str:
    """`` [3 replays]`` of a graphed row, or why its graphs were turned off."""
    if not stats:
        return ""
    if stats.get("disabled"):
        return f" [graphs OFF: {stats['disabled']}]"
    return f" [{stats.get('captures')} captures, {stats.get('replays')} replays]"


def throughput(rep: dict[str, Any]) -> str:
    """``packed-16 12345 tok/s (0.46, host 80 ms) | packed-16+graphs ... (1.20x)``."""
    parts, eager = [], {}
    for r in rep["rows"]:
        if r["case"] == "peft":
            continue
        key = (r["model"], r["liger"], r["adapters"])
        if r.get("oom"):
            parts.append(f"{r['case']} OOM")
            continue
        text = (f"{r['case']} {r['tokens_per_s']:.0f} tok/s ({r['ceiling_fraction']:.3f} of "
                f"ceiling, step {1e3 * r['step_s']:.1f} ms, host {_f(r.get('host_ms'))} ms)"
                f"{_graphs(r.get('graph_stats'))}")  # fmt: skip
        if r.get("graphs") and key in eager:
            text += f" {r['tokens_per_s'] / eager[key]:.2f}x eager"
        elif not r.get("graphs"):
            eager[key] = r["tokens_per_s"]
        parts.append(text)
    return f"throughput ({rep['device']}): " + " | ".join(parts)


def profile(rep: dict[str, Any]) -> str:
    """``packed-16 wall 400 ms host 90 ms GPU 330 ms idle 18% | packed-16+graphs ...``."""
    parts = [
        f"{v['label']} wall {v['wall_ms']:.1f} ms, host {_f(v['host_ms'])} ms, GPU kernels "
        f"{_f(v['gpu_kernel_ms'])} ms, idle {_f(v['gpu_idle'], '.1%')}, "
        f"{v['kernels_per_step']:.0f} kernels/step{_graphs(v.get('graph_stats'))}"
        for v in rep["variants"]
    ]
    return f"profile ({rep['device']}, {rep['model']} x{rep['adapters']}): " + " | ".join(parts)


def e2e(rep: dict[str, Any]) -> str:
    """``e2e graphs=on: plora 120 s (plan 1.02x) | tune-frac 300 s (2.5x slower); ok``."""
    parts = []
    for name, row in rep["systems"].items():
        done = sum(v is not None for v in row["eval_loss"].values())
        text = f"{name} {_f(row['wall_s'])} s ({done}/{len(rep['configs'])} configs"
        if name == "plora":
            text += f", measured/plan {_f(row.get('measured_over_predicted'), '.2f')}"
        else:
            text += f", plora {_f(rep['speedups'].get(name), '.2f')}x faster"
        parts.append(text + ")")
    graphs = rep.get("cuda_graphs", {}).get("setting", "auto")
    ok = "ok" if rep["agreement"]["ok"] else "checks FAILED"
    return f"e2e graphs={graphs} ({rep['gpu']}): " + " | ".join(parts) + f"; {ok}"


def main(argv: list[str]) -> int:
    kinds = {"throughput": throughput, "profile": profile, "e2e": e2e}
    if len(argv) != 2 or argv[0] not in kinds:
        print(f"usage: graphs_summary.py {{{','.join(kinds)}}} FILE.json", file=sys.stderr)
        return 2
    kind, path = argv[0], Path(argv[1])
    try:
        print(kinds[kind](json.loads(path.read_text())))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{kind}: no result ({path.name}: {type(e).__name__}: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
