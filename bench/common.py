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


def tuning_share(tuning_s: float, fit_s: float, tuned_before_fit: bool = False) -> dict:
    """Tuning's share of a whole `fit` as its user waits for it.

    First-batch tuning runs inside the fit, so `fit_s` includes it; tuning
    in `optimize(tune=batch)` runs before the fit, so the wait is both.

    >>> tuning_share(2.0, 20.0)
    {'tuning_s': 2.0, 'fit_s': 20.0, 'share': 0.1}
    >>> tuning_share(2.0, 18.0, tuned_before_fit=True)
    {'tuning_s': 2.0, 'fit_s': 20.0, 'share': 0.1}
    >>> tuning_share(0.0, 0.0)["share"] is None
    True
    """
    total = fit_s + (tuning_s if tuned_before_fit else 0.0)
    return dict(tuning_s=tuning_s, fit_s=total, share=tuning_s / total if total > 0 else None)


def share_table(runs: list[tuple[str, dict]]) -> str:
    """A Markdown table of tuning shares: `runs` = [(backend, {shape: share})],
    a column each; with two runs, the first's share over the second's (the
    target "no more on JAX than on TensorFlow" holds where it is at most 1).

    >>> print(share_table([("jax", {"a": 0.05, "b": 0.2}), ("tensorflow", {"a": 0.1})]))
    | shape | jax | tensorflow | jax / tensorflow |
    |---|---|---|---|
    | a | 5.0% | 10.0% | 0.50 |
    | b | 20.0% | - | - |
    """
    names = list(dict.fromkeys(n for _, shares in runs for n in shares))
    cols = [backend for backend, _ in runs]
    two = len(runs) == 2
    if two:
        cols.append(f"{runs[0][0]} / {runs[1][0]}")
    lines = ["| shape | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for n in names:
        values = [shares.get(n) for _, shares in runs]
        cells = ["-" if v is None else f"{100 * v:.1f}%" for v in values]
        if two:
            a, b = values
            cells.append(f"{a / b:.2f}" if a is not None and b else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
