"""What the benchmarks share: list arguments, where output goes, the budgeted matrix loop.

    >>> csv_list(int)("2,4,")
    [2, 4]
    >>> out_path("x.json").endswith(os.path.join("rnnfuse-bench", "x.json"))
    True
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Callable, Iterable


def csv_list(kind):
    """An argparse `type`: "a,b,c" -> [kind(a), kind(b), kind(c)]."""
    return lambda text: [kind(v) for v in text.split(",") if v]


def out_path(name: str) -> str:
    """The default `--out` of a benchmark: `name` in a folder outside the
    repository (RNNFUSE_BENCH_DIR, else `rnnfuse-bench` in the system's
    temporary folder), so a run never adds files to bench/results; copy a
    result there when docs/benchmarks.md cites it."""
    folder = os.environ.get("RNNFUSE_BENCH_DIR") or os.path.join(tempfile.gettempdir(), "rnnfuse-bench")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


def run_matrix(
    configs: Iterable[tuple],
    measure: Callable[[tuple], list[dict]],
    describe: Callable[[dict], str],
    *,
    meta: dict,
    out: str,
    max_seconds: float,
) -> list[dict]:
    """Measures each configuration until `max_seconds` have passed.

    A configuration that raises becomes an error row; every row is printed
    (`describe` for measured ones); the JSON file `out` ({meta, results,
    skipped}) is rewritten after each configuration, so a run cut short
    keeps what it measured.

    Returns:
        All result rows.
    """
    results, skipped = [], []
    start = time.perf_counter()
    for config in configs:
        if time.perf_counter() - start > max_seconds:
            skipped.append(list(config))
            continue
        try:
            rows = measure(config)
        except Exception as e:  # noqa: BLE001 - record and go on
            rows = [dict(config=list(config), error=f"{type(e).__name__}: {e}")]
        results += rows
        for r in rows:
            if "error" in r:
                print("ERROR", r["config"], r["error"], flush=True)
            else:
                print(describe(r), flush=True)
        with open(out, "w") as f:
            json.dump(dict(meta=meta, results=results, skipped=skipped), f, indent=1)
    if skipped:
        print(f"time budget reached: {len(skipped)} configurations not run", flush=True)
    return results
