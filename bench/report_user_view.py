"""Tables and a plot from bench_user_view.py's JSON (one or more parts).

Parts of one matrix (runs split with `--skip`, or `--only` for the cells a
change touched) are merged per backend, in draw order (anchors first),
each row numbered by its drawn cell; a cell measured again in a later part
replaces the earlier measurement, which the table still shows ("was").

    python bench/report_user_view.py bench/results/user_view_torch_h200_*.json \\
        --plot docs/benchmarks_user_view.png > /tmp/table.md

Example (what a cell's row looks like):

    >>> row = dict(shape=dict(kind="gru", layers=3, units=64, batch=8, steps=50,
    ...            dtype="float32", masked=True), fit_speedup=1.5,
    ...            predict_speedup=2.0, tuning_s=0.4, plans=[dict(pieces=None, algorithm=None)],
    ...            fit_ms=dict(original=3.0, optimized=2.0))
    >>> print(markdown_row(1, row))
    | 1 | gru 3x64 B8 T50 float32 masked | 3.0 / 2.0 | **1.50x** | 2.00x | 0.4 s | not recorded | fused |
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def shape_text(shape: dict) -> str:
    text = (
        f"{shape['kind']} {shape['layers']}x{shape['units']} B{shape['batch']} "
        f"T{shape['steps']} {shape['dtype']}"
    )
    return text + (" masked" if shape.get("masked") else "")


def plan_text(plans: list[dict]) -> str:
    out = []
    for plan in plans:
        pieces = plan.get("pieces")
        name = (
            "fused" if pieces is None
            else "per layer" if tuple(pieces) == ()
            else "split " + "+".join(str(p) for p in pieces)
        )
        if plan.get("algorithm"):
            name += f" @{plan['algorithm']}"
        out.append(name)
    return "; ".join(out) or "-"


def same_kernels(row: dict) -> bool:
    """Whether the optimized model trained on the original layers in every
    group (each fit plan "per layer"): both models then run the same
    kernels, and their ratio is the benchmark's noise.

    >>> kept, fused = [dict(pieces=[])], [dict(pieces=None)]
    >>> same_kernels(dict(plans=kept, plans_predict=fused)), same_kernels(dict(plans=fused, plans_predict=fused))
    (True, False)
    >>> same_kernels(dict(plans=kept))  # an older run: its "plans" are predict's
    False
    """
    # Runs before plans_predict was recorded wrote "plans" after predict:
    # those are the inference plans, so such rows are not judged.
    plans = row.get("plans") if row.get("plans_predict") else None
    return bool(plans) and all(p.get("pieces") is not None and tuple(p["pieces"]) == () for p in plans)


# Which decision an entry point runs: (mode, batch multiple, xla_baseline
# wanted: None for any). The custom loop is the user's own tf.function,
# decided without XLA where that differs (SimpleRNN under jit "auto").
_ENTRY_DECISIONS = {
    "fit_speedup": ("training", 1, True),
    "fit_call_speedup": ("training", 1, True),
    "loop_speedup": ("training", 1, False),
    "predict_speedup": ("inference", 1, True),
    "predict_call_speedup": ("inference", 1, True),
    "predict_4x_speedup": ("inference", 4, True),
}


def kept_original_at(row: dict, key: str) -> bool:
    """Whether the optimized model ran the original layers at entry point
    `key` (bench_user_view.ENTRY_POINTS): every decision of that mode at
    that batch chose "per-layer", so both models ran the same kernels there
    and the ratio is the benchmark's noise. False where not recorded.

    >>> dec = lambda mode, b, chosen: dict(mode=mode, input=[b, 9, 4], chosen=chosen)
    >>> row = dict(shape=dict(batch=8), decisions=[dec("training", 8, "fused"),
    ...     dec("inference", 8, "per-layer"), dec("inference", 32, "fused")])
    >>> [kept_original_at(row, k) for k in ("fit_speedup", "predict_speedup", "predict_4x_speedup")]
    [False, True, False]
    """
    mode, times, xla = _ENTRY_DECISIONS[key]
    batch = int(row["shape"]["batch"]) * times
    found = [d for d in row.get("decisions") or []
             if d.get("mode") == mode and int(d["input"][0]) == batch]
    by_path = [d for d in found if d.get("xla_baseline", xla) == xla]
    found = by_path or found
    return bool(found) and all(d.get("chosen") == "per-layer" for d in found)


def markdown_row(i: int, row: dict) -> str:
    fit = row["fit_speedup"]
    if "plans_predict" in row:
        fit_plan, predict_plan = plan_text(row["plans"]), plan_text(row["plans_predict"])
    else:  # an older run recorded the plans once, after predict
        fit_plan, predict_plan = "not recorded", plan_text(row["plans"])
    mark = "**" if fit >= 0.97 else ""
    was = "".join(f" (was {e:.2f}x)" for e in row.get("earlier", []))
    dagger = " †" if same_kernels(row) else ""
    return (
        f"| {i} | {shape_text(row['shape'])} | {row['fit_ms']['original']:.1f} / "
        f"{row['fit_ms']['optimized']:.1f} | {mark}{fit:.2f}x{mark}{dagger}{was} | "
        f"{row['predict_speedup']:.2f}x | {row['tuning_s']:.1f} s | {fit_plan} | {predict_plan} |"
    )


def _shape_key(shape: dict) -> str:
    return json.dumps(shape, sort_keys=True)


def cell_numbers(seed: int = 2026, cells: int = 30) -> dict[str, int | str]:
    """Shape key -> its drawn cell number (1-based), or "A<n>" for an anchor.

    >>> from bench_user_view import ANCHORS, draw_shapes
    >>> numbers = cell_numbers()
    >>> numbers[_shape_key(draw_shapes(30)[3])], numbers[_shape_key(dict(ANCHORS[0]))]
    (4, 'A1')
    """
    from bench_user_view import ANCHORS, draw_shapes

    numbers: dict[str, int | str] = {
        _shape_key(d): i for i, d in enumerate(draw_shapes(cells, seed), 1)
    }
    numbers.update({_shape_key(dict(a)): f"A{i}" for i, a in enumerate(ANCHORS, 1)})
    return numbers


def _order(number) -> tuple:
    return (0, int(number[1:])) if isinstance(number, str) else (1, number or 0)


def merge(paths: list[str]) -> dict[str, dict]:
    """Per backend: meta of the first part and every measured row, by cell.

    Rows carry "cell" (their drawn number); a later part's measurement of a
    cell replaces an earlier one, whose fit speedup goes to "earlier".
    """
    out: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        backend = data["meta"]["backend"]
        numbers = cell_numbers(data["meta"].get("seed", 2026))
        entry = out.setdefault(backend, dict(meta=data["meta"], rows=[], other=[], by_cell={}))
        for row in data["results"]:
            if "fit_speedup" in row:
                key = _shape_key(row["shape"])
                row = dict(row, cell=row.get("cell") or numbers.get(key))
                before = entry["by_cell"].get(key)
                if before is not None:
                    row["earlier"] = before.get("earlier", []) + [before["fit_speedup"]]
                entry["by_cell"][key] = row
            elif "error" in row:
                entry["other"].append(row)
    for entry in out.values():
        entry["rows"] = sorted(entry.pop("by_cell").values(), key=lambda r: _order(r["cell"]))
    return out


def summary(rows: list[dict]) -> dict:
    fits = [r["fit_speedup"] for r in rows]
    preds = [r["predict_speedup"] for r in rows]
    geo = lambda xs: math.exp(statistics.mean(math.log(x) for x in xs))
    return dict(
        cells=len(rows),
        fit_min=min(fits),
        fit_geomean=geo(fits),
        fit_below=sum(f < 0.97 for f in fits),
        predict_min=min(preds),
        predict_geomean=geo(preds),
        predict_below=sum(p < 0.97 for p in preds),
        tuning_s=sum(r["tuning_s"] for r in rows),
        # Cells whose optimized model trained on the original layers: the
        # spread of their fit ratios is what the benchmark resolves.
        same_kernels=[r["fit_speedup"] for r in rows if same_kernels(r)],
    )


def overhead_text(rows: list[dict]) -> str:
    """The tuning-overhead figure (bench_user_view.tuning_overhead) over the
    drawn cells (anchors are chosen, not drawn, so they are left out)."""
    from bench_user_view import tuning_overhead

    o = tuning_overhead([r for r in rows if not isinstance(r["cell"], str)])
    if not o:
        return ""
    tuning = (
        f"{o['median_model_fit_tuning_s']:.1f} s of training tuning "
        f"({o['median_model_tuning_s']:.1f} s with predict's)"
        if o.get("median_model_training_only")
        else f"{o['median_model_tuning_s']:.1f} s of tuning (training and predict: "
        "that run did not record them apart)"
    )
    return (
        f"Tuning overhead: {o['tuning_overhead_share']:.1%} for the median drawn model "
        f"({shape_text(o['median_model'])}): {tuning} against "
        f"{o['median_model_10_epochs_s']:.0f} s for 10 epochs of 100 steps."
    )


def _same_kernels_text(s: dict) -> str:
    same = s["same_kernels"]
    if not same:
        return ""
    below = (
        f"; {sum(f < 0.97 for f in same)} of the {s['fit_below']} fit cells below 0.97x are among them"
        if s["fit_below"] else ""
    )
    return (
        f"† the optimized model trained on the original layers (first-batch tuning kept them), so both "
        f"models ran the same kernels: {len(same)} cells, fit {min(same):.2f}x to {max(same):.2f}x{below}."
    )


def markdown(merged: dict[str, dict]) -> str:
    lines = []
    for backend, entry in merged.items():
        rows = entry["rows"]
        if not rows:
            continue
        s = summary(rows)
        lines += [
            f"#### {backend}: {s['cells']} cells",
            "",
            f"fit: min {s['fit_min']:.2f}x, geometric mean {s['fit_geomean']:.2f}x, "
            f"{s['fit_below']} of {s['cells']} below 0.97x; predict: min {s['predict_min']:.2f}x, "
            f"geometric mean {s['predict_geomean']:.2f}x, {s['predict_below']} below 0.97x; "
            f"first-batch tuning {s['tuning_s']:.0f} s in all.",
            "",
            _same_kernels_text(s),
            "",
            resolution_text(rows),
            "",
            control_text(rows),
            "",
            overhead_text(rows),
            "",
            "| # | model | fit ms/step original / optimized | fit | predict | tuning | fit plan | predict plan |",
            "|---:|---|---:|---:|---:|---:|---|---|",
        ]
        lines += [markdown_row(r["cell"], r) for r in rows]
        for row in entry["other"]:
            lines.append(f"| - | {shape_text(row['shape'])} | error: {row['error'][:120]} | | | | | |")
        lines.append("")
        lines += entry_point_lines(rows)
        if any(r.get("decisions") for r in rows):
            lines += table_coverage(backend, rows) + [""]
    return "\n".join(lines)


def entry_point_lines(rows: list[dict]) -> list[str]:
    """The entry points (bench_user_view.ENTRY_POINTS): per entry
    point its min and geometric mean over the cells, then one row per cell
    (every entry point's ratio; the first fit and predict calls' seconds,
    original / optimized, reported apart). [] for runs without them.

    >>> row = dict(cell=2, shape=dict(kind="lstm", layers=8, units=128, batch=32, steps=20,
    ...            dtype="float32", masked=False), fit_speedup=1.1, predict_speedup=1.0,
    ...            predict_4x_speedup=0.99, loop_speedup=1.2, fit_call_speedup=1.05,
    ...            predict_call_speedup=1.0, first_call_s=dict(fit=dict(original=2.0, optimized=4.5),
    ...            predict=dict(original=0.5, optimized=1.5)))
    >>> print(entry_point_lines([row])[-2])
    | 2 | lstm 8x128 B32 T20 float32 | 1.10x | 1.00x | 0.99x | 1.20x | 1.05x | 1.00x | 2.0 / 4.5 s | 0.5 / 1.5 s |
    """
    from bench_user_view import ENTRY_POINTS, entry_points

    if not any("fit_call_speedup" in r for r in rows):
        return []
    found = entry_points(rows)
    lines = ["Entry points (original time / optimized time; first calls reported apart, not judged;"
             " ‡: the optimized model ran the original layers there, so both models ran the same"
             " kernels):", ""]
    for key, what in ENTRY_POINTS:
        if key in found:
            e = found[key]
            below = [r for r in rows if key in r and r[key] < 0.97]
            same = sum(kept_original_at(r, key) for r in below)
            lines.append(f"- {what}: min {e['min']:.2f}x, geometric mean {e['geomean']:.2f}x, "
                         f"{e['below_0_97']} of {e['cells']} below 0.97x"
                         + (f" ({same} of them ‡)" if below else ""))
    lines += [
        "",
        "| # | model | fit | predict | predict 4x | custom loop | fit calls 2-N | predict calls 2-N "
        "| first fit call | first predict call |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "fit_call_speedup" not in r:
            continue
        cells = [f"{r[k]:.2f}x" + (" ‡" if kept_original_at(r, k) else "") if k in r else "-"
                 for k, _ in ENTRY_POINTS]
        first = r.get("first_call_s", {})
        firsts = [
            f"{first[k]['original']:.1f} / {first[k]['optimized']:.1f} s" if k in first else "-"
            for k in ("fit", "predict")
        ]
        lines.append(f"| {r['cell']} | {shape_text(r['shape'])} | " + " | ".join(cells + firsts) + " |")
    return lines + [""]


def _regime_plan(row: dict, training: bool) -> str | None:
    """The plan today's static table gives a TensorFlow cell (from its shape)."""
    from rnnfuse.tuning.table import Regime, plan_for_regime

    shape = row["shape"]
    kind = shape["kind"].removeprefix("bi_")
    cell = {"lstm": "lstm", "gru": "gru", "simple_rnn": "rnn_tanh"}[kind]
    dtype = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}.get(shape["dtype"], shape["dtype"])
    regime = Regime(cell, shape["units"], shape["layers"], shape["kind"].startswith("bi_"),
                    cell == "rnn_tanh", dtype, training)
    return plan_for_regime(regime, shape["layers"]).name


def table_coverage(backend: str, rows: list[dict], margin: float = 0.03) -> list[str]:
    """How the static table's plans fare on the tuner's own clock.

    Per decision (cell x training/inference): the table's plan against the
    tuned one and against the original layers ("per-layer"), both timed
    side by side by first-batch tuning. "as run": the table of the run;
    "today": rnnfuse's table now (TensorFlow rows only; it is recomputed
    from each cell's shape).

    >>> row = dict(shape=dict(kind="gru", layers=3, units=64, batch=8, steps=50,
    ...            dtype="float32", masked=False), decisions=[dict(mode="training",
    ...            chosen="fused", static="per-layer",
    ...            timings_ms={"per-layer": 2.0, "fused": 1.0})])
    >>> table_coverage("torch", [row])[2]
    '- as run: the tuned plan in 0 of 1; within 3% of it in 0; over 3% slower than the original layers in 0'
    """
    def tally(static_of):
        same = close = slower = 0
        worst = []
        n = 0
        for row in rows:
            for d in row.get("decisions", []):
                t = d["timings_ms"]
                plan = static_of(row, d)
                if plan not in t or "per-layer" not in t:
                    continue
                n += 1
                same += plan == d["chosen"]
                close += plan != d["chosen"] and t[plan] <= (1 + margin) * t[d["chosen"]]
                if t[plan] > (1 + margin) * t["per-layer"]:
                    slower += 1
                    worst.append(f"{shape_text(row['shape'])} {d['mode']} {t['per-layer'] / t[plan]:.2f}x")
        return n, same, close, slower, worst

    lines = [f"Static table vs first-batch tuning ({backend}, the tuner's clock):", ""]
    views = [("as run", lambda row, d: d["static"])]
    if backend == "tensorflow":
        views.append(("today", lambda row, d: _regime_plan(row, d["mode"] == "training")))
    for name, static_of in views:
        n, same, close, slower, worst = tally(static_of)
        line = (f"- {name}: the tuned plan in {same} of {n}; within {margin:.0%} of it in {close}; "
                f"over {margin:.0%} slower than the original layers in {slower}")
        lines.append(line + (f" ({'; '.join(worst)})" if worst else ""))
    return lines


def resolution(rows: list[dict], rounds=(5, 11, 15), draws: int = 4000, seed: int = 0) -> dict:
    """How often a cell whose two models run the same kernels would read
    below 0.97x, by the number of timed rounds: a bootstrap over the
    per-round ratios of every cell in `rows`, a fixed seed.

    Rounds are paired: round i of the original and of the optimized model
    ran back to back (interleaved), so drift that moves both (the machine,
    its clocks) cancels in their ratio, as it does in a cell's reading.
    Each cell's log ratios are centred on their median (the cell's own
    speedup taken out), which leaves the noise between two models in one
    round; a draw is exp(median of `n` drawn deviations).

    Returns {"round_sd": sd of the log deviations, "deviations": how many}
    and, per n, {"below_0_97": share, "band_90": (5th, 95th percentile of
    the ratio)}; {} with fewer than 20 deviations.
    """
    import random

    devs = []
    for r in rows:
        fit = (r.get("raw") or {}).get("fit", {})
        pairs = [math.log(o / f) for o, f in zip(fit.get("original", []), fit.get("optimized", []))]
        if len(pairs) >= 3:
            m = statistics.median(pairs)
            devs += [p - m for p in pairs]
    if len(devs) < 20:
        return {}
    rng = random.Random(seed)
    out = {"round_sd": statistics.pstdev(devs), "deviations": len(devs)}
    for n in rounds:
        ratios = sorted(
            math.exp(statistics.median(rng.choice(devs) for _ in range(n))) for _ in range(draws)
        )
        out[n] = {"below_0_97": sum(x < 0.97 for x in ratios) / draws,
                  "band_90": (ratios[draws // 20], ratios[draws - draws // 20])}
    return out


def resolution_text(rows: list[dict]) -> str:
    res = resolution(rows)
    if not res:
        return ""
    parts = [
        f"{n} rounds: {res[n]['below_0_97']:.0%} (90% of readings {res[n]['band_90'][0]:.2f}-"
        f"{res[n]['band_90'][1]:.2f}x)"
        for n in res if isinstance(n, int)
    ]
    return (
        f"Resolution: a round's ratio of the two models (timed back to back) deviates from its "
        f"cell's median ratio by {res['round_sd']:.1%} (sd of {res['deviations']} paired rounds' log "
        f"deviations); bootstrapped from them, a cell whose two models run the same kernels reads "
        f"below 0.97x with " + "; ".join(parts) + "."
    )


def control_text(rows: list[dict]) -> str:
    """The A/A controls among `rows` (`bench_user_view.py --control`): the
    original against a clone of itself, what the benchmark reads for two
    models that differ in nothing.

    >>> control_text([dict(cell=3, control_fit_speedup=0.985, rounds=15)])
    'A/A control (the original against a clone of itself, timed beside both models): cell 3 0.98x (15 rounds).'
    """
    cells = [r for r in rows if "control_fit_speedup" in r]
    if not cells:
        return ""
    parts = ", ".join(f"cell {r['cell']} {r['control_fit_speedup']:.2f}x ({r.get('rounds', '?')} rounds)"
                      for r in cells)
    return f"A/A control (the original against a clone of itself, timed beside both models): {parts}."


def plot(merged: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = [b for b, e in merged.items() if e["rows"]]
    fig, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4), squeeze=False)
    for ax, backend in zip(axes[0], backends):
        rows = merged[backend]["rows"]
        # Drawn cells at their number; anchors (chosen, not drawn) at 0.
        idx = [0 if isinstance(r["cell"], str) else r["cell"] for r in rows]
        kept = [same_kernels(r) for r in rows]
        for hollow, label in ((False, "fit"), (True, "fit, original layers kept (same kernels)")):
            xs = [i for i, k in zip(idx, kept) if k == hollow]
            ys = [r["fit_speedup"] for r, k in zip(rows, kept) if k == hollow]
            if xs:
                ax.scatter(xs, ys, label=label, marker="o", facecolors="none" if hollow else None,
                           edgecolors="C0", color=None if hollow else "C0")
        ax.scatter(idx, [r["predict_speedup"] for r in rows], label="predict", marker="x", color="C1")
        ax.axhline(0.97, color="red", linewidth=0.8, linestyle="--", label="0.97x")
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_yscale("log")
        ax.set_xlabel("drawn cell (0: the anchor cells)")
        ax.set_ylabel("speedup over the original (log)")
        ax.set_title(f"{backend}: optimize() defaults")
        ax.legend(loc="upper left", fontsize="small", framealpha=0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    merged = merge(args.parts)
    print(markdown(merged))
    if args.plot:
        plot(merged, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
