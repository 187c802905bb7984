"""Turn benchmark JSON into docs/benchmarks.md tables and a speedup plot.

    python bench/report.py bench/results/tf_h200.json --plot docs/benchmarks.png

Prints the Markdown tables (to paste into docs/benchmarks.md, which also
holds the discussion) and writes the plot: one bar group per cell, the
speedup of the default fused plan and of the tuned plan over the original
Keras model, on a log scale, with 1.0x marked.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def static_choice(row: dict) -> tuple[str, float]:
    """(candidate name, speedup) the current rule table picks for a cell."""
    sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
    from rnnfuse.tuning.table import Regime, plan_for_regime

    plan = plan_for_regime(Regime(**row["regime"]), row["layers_in_group"]).for_length(row["layers_in_group"])
    name = "original" if not plan.pieces else plan.name
    return name, row["speedup"].get(name, float("nan"))


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def cells_table(data: dict) -> str:
    rows = [
        "| cell | original ms | fused (default) | best fused plan | tuned | tuned plan | static table | rejected for training |",
        "|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in data["cells"]:
        if "error" in row:
            rows.append(f"| {row['name']} | error: {row['error'][:80]} | | | | | | |")
            continue
        fused = {k: v for k, v in row["speedup"].items() if k != "original"}
        best = max(fused, key=fused.get)
        if "regime" in row:
            row["static"], row["static_speedup"] = static_choice(row)
        rows.append(
            "| {name} | {orig} | {fd:.2f}x | {bv:.2f}x ({bn}) | {tv:.2f}x | {tn} | {sv:.2f}x ({sn}) | {rej} |".format(
                name=row["name"],
                orig=_fmt_ms(row["medians_s"]["original"]),
                fd=row["fused_default_speedup"],
                bv=fused[best],
                bn=best,
                tv=row["tuned_speedup"],
                tn=row["tuned"],
                sv=row["static_speedup"],
                sn=row["static"],
                rej=", ".join(row["rejected"]) or "-",
            )
        )
    return "\n".join(rows)


def _geomean(values) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summary(data: dict) -> str:
    ok = [r for r in data["cells"] if "error" not in r]
    for r in ok:
        if "regime" in r:
            r["static"], r["static_speedup"] = static_choice(r)
    static_worst = min(ok, key=lambda r: r["static_speedup"]) if ok else None
    lstm_gru_train = [r for r in ok if r["cell"]["kind"] in ("lstm", "gru", "bilstm", "bigru") and r["cell"]["mode"] == "train"]
    fp16_big = [r for r in lstm_gru_train if r["cell"]["dtype"] == "mixed_float16" and r["cell"]["batch"] >= 32]
    loops = [r for r in ok if r["cell"]["kind"] in ("simple_rnn", "rnn_lstmcell")]
    worst = min(ok, key=lambda r: r["tuned_speedup"]) if ok else None
    lines = [
        f"- cells measured: {len(ok)} (errors: {len(data['cells']) - len(ok)}, skipped: {len(data.get('skipped', []))})",
        f"- slowest tuned cell: {worst['tuned_speedup']:.2f}x ({worst['name']})" if worst else "",
        f"- slowest cell under the static table (no tuning): {static_worst['static_speedup']:.2f}x ({static_worst['name']}, {static_worst['static']})" if static_worst else "",
        f"- geometric mean, LSTM/GRU training, tuned: {_geomean([r['tuned_speedup'] for r in lstm_gru_train]):.2f}x "
        f"(default fused plan: {_geomean([r['fused_default_speedup'] for r in lstm_gru_train]):.2f}x; n={len(lstm_gru_train)})",
        f"- mixed_float16 training at batch >= 32, tuned: geometric mean {_geomean([r['tuned_speedup'] for r in fp16_big]):.2f}x "
        f"(min {min((r['tuned_speedup'] for r in fp16_big), default=float('nan')):.2f}x; n={len(fp16_big)})",
        f"- SimpleRNN and RNN(cell) stacks, tuned: min {min((r['tuned_speedup'] for r in loops), default=float('nan')):.2f}x, "
        f"geometric mean {_geomean([r['tuned_speedup'] for r in loops]):.2f}x (n={len(loops)})",
    ]
    if "tuner" in data:
        t = data["tuner"]
        lines.append(f"- optimize(tune=...) on a 10-layer model: {t.get('wall_s', float('nan')):.1f} s ({t.get('fused', t.get('error'))})")
    return "\n".join(l for l in lines if l)


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in data["cells"] if "error" not in r]
    names = [r["name"] for r in ok]
    fused = [r["fused_default_speedup"] for r in ok]
    tuned = [r["tuned_speedup"] for r in ok]
    fig, ax = plt.subplots(figsize=(10, 0.34 * len(ok) + 1.5))
    y = range(len(ok))
    ax.barh([i + 0.2 for i in y], fused, height=0.4, label="fused, default algorithm", color="#9ecae1")
    ax.barh([i - 0.2 for i in y], tuned, height=0.4, label="tuned plan", color="#3182bd")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_yticks(list(y))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the original Keras model (log scale; >1 is faster)")
    env = data.get("environment", {})
    ax.set_title(f"rnnfuse on {env.get('device', '?')}, TF {env.get('tensorflow', '?')}")
    for i, (f, t) in enumerate(zip(fused, tuned)):
        ax.text(t * 1.03, i - 0.2, f"{t:.2f}x", va="center", fontsize=7)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    print("Environment: " + ", ".join(f"{k} {v}" for k, v in data.get("environment", {}).items()))
    print()
    print(summary(data))
    print()
    print(cells_table(data))
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
