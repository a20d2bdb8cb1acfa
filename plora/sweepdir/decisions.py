"""``decisions.jsonl`` read once per version, and a plan decision's jobs wherever they are kept.

The coordinator's decision log is the largest file a sweep directory's readers parse: about
150,000 records at 10,000 configs, which ``plora status`` read twice (the status text and the
plan check), 7 s of ``json.loads`` between them (``benchmarks/RESULTS.md``, issue 44).
:func:`read_records` parses a given version of the file once per process: it keeps the records
of each file it read keyed on the file's size, modification time and inode, so a second reader
of the same version gets them at once and a grown file (the driver appends) is read again.

A ``replan`` decision names its plan file (``plan_file``: ``plans/plan-NNN.json``, which holds
the plan's jobs) and counts its configs and jobs instead of listing them (layout version 5,
:data:`plora.sweepdir.schema.SCHEMA_VERSION`); directories written before list them in every
plan decision. :func:`decision_jobs` gives a plan decision's jobs either way.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Decision log versions kept parsed (the latest of each file; the oldest file is dropped).
CACHED_FILES = 4

_cache: OrderedDict[Path, tuple[tuple[int, int, int], list[dict[str, Any]]]] = OrderedDict()
_lock = threading.Lock()


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The decision records of the ``decisions.jsonl`` at ``path``, in order.

    A line that is not a JSON object (a torn last line: the driver was killed mid-write) is
    skipped. The records are parsed once per version of the file (its size, ``mtime_ns`` and
    inode): a later call for an unchanged file returns the same record dicts, which callers
    must not change (the list is a fresh copy).

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    path = Path(path).absolute()
    st = path.stat()
    version = (st.st_size, st.st_mtime_ns, st.st_ino)  # ino: a file replaced whole
    with _lock:
        hit = _cache.get(path)
        if hit is not None and hit[0] == version:
            _cache.move_to_end(path)
            return list(hit[1])
    records = _parse(path.read_bytes())
    with _lock:
        _cache[path] = (version, records)
        _cache.move_to_end(path)
        while len(_cache) > CACHED_FILES:
            _cache.popitem(last=False)
    return list(records)


def _parse(data: bytes) -> list[dict[str, Any]]:
    records = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def decision_jobs(root: str | os.PathLike[str], record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The jobs of a ``plan`` / ``replan`` decision of the sweep directory ``root``.

    Those the record lists (``inputs.jobs``: the first plan's, and every plan's in a directory
    written before layout version 5), else those of the plan file it names (``inputs.plan_file``,
    relative to ``root``; each job has ``job_id``, ``config_ids``, ``gpus``, ``micro_batches``
    and ``max_rows`` either way, the plan file's times and memory too).

    Raises:
        ValueError: the record neither lists jobs nor names a plan file (it is no plan
            decision, or it was logged without a sweep directory).
        FileNotFoundError: the plan file it names is gone.
    """
    inputs = record.get("inputs")
    inputs = inputs if isinstance(inputs, Mapping) else {}
    jobs = inputs.get("jobs")
    if isinstance(jobs, list):
        return jobs
    name = inputs.get("plan_file")
    if not name:
        raise ValueError(
            f"decision {record.get('kind')!r} at {record.get('time_s')} s lists no jobs and names "
            "no plan file; pass a plan or replan decision of a sweep directory"
        )
    plan = json.loads((Path(root) / str(name)).read_text())
    return list(plan["jobs"])


__all__ = ["CACHED_FILES", "decision_jobs", "read_records"]
