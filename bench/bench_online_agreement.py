"""Does online tuning choose what full timing chooses?

For each named shape (bench_matrix.SHAPES), in one process:

- **full timing**: `rnnfuse.optimize(model, cache=False, tune=x)` times
  every candidate on the batch before the fit (the plan a long fit commits
  to) and records each candidate's median;
- **online**: `rnnfuse.optimize(model, cache=False)` with online tuning on
  races the candidates on a `fit`'s own training steps and commits one.

A shape agrees where both commit the same plan, a fused one or the
original layers (`per-layer`). Where they differ, the
online choice's cost is read from full timing's medians: it is within
target if it is at most 5% slower than full timing's choice. The target:
agreement in at least 90% of the shapes, every other shape within 5%.

    python bench/bench_online_agreement.py --out $OUT/online_agreement_torch.json
    python bench/bench_online_agreement.py --quick   # tiny shapes (still a GPU)

>>> judge({"chosen": "fused", "timings_ms": {"fused": 10.0, "per-layer": 20.0}},
...       {"chosen": "fused"})["verdict"]
'agrees'
>>> judge({"chosen": "fused", "timings_ms": {"fused": 10.0, "split": 10.4}},
...       {"chosen": "split"})["verdict"]
'within 5%'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import out_path  # noqa: E402

TOLERANCE = 1.05
DEFAULT_SHAPES = "bilstm4x384,lstm4x512,lstm3x768,bigru5x512,gru3x192,gru3x64,rnn3x256,lstm8x128,lstm2x40"


def judge(full: dict, online: dict) -> dict:
    """One group's verdict from full timing's decision record (`chosen`,
    `timings_ms`) and online tuning's (`chosen`, None where it decided
    nothing): "agrees", "within 5%", "slower" (by `ratio`, online's choice
    over full's, from full's medians), "unmeasured" (full timing did not
    time online's choice) or "undecided" (online tuning made no decision)."""
    chosen, picked = full["chosen"], online["chosen"]
    if picked is None:
        return dict(full=chosen, online=None, ratio=None, verdict="undecided")
    if picked == chosen:
        return dict(full=chosen, online=picked, ratio=1.0, verdict="agrees")
    times = full.get("timings_ms") or {}
    if picked not in times or chosen not in times:
        return dict(full=chosen, online=picked, ratio=None, verdict="unmeasured")
    ratio = times[picked] / times[chosen]
    return dict(full=chosen, online=picked, ratio=ratio,
                verdict="within 5%" if ratio <= TOLERANCE else "slower")


def summarize(verdicts: list[dict]) -> dict:
    """The target's reading over every group's verdict.

    >>> summarize([{"verdict": "agrees", "ratio": 1.0}, {"verdict": "within 5%", "ratio": 1.02}])
    {'groups': 2, 'agree': 1, 'agree_share': 0.5, 'worst_ratio': 1.02, 'met': False}
    """
    agree = sum(v["verdict"] == "agrees" for v in verdicts)
    ratios = [v["ratio"] for v in verdicts if v["ratio"] is not None]
    share = agree / len(verdicts) if verdicts else 0.0
    met = bool(verdicts) and share >= 0.9 and all(v["verdict"] in ("agrees", "within 5%") for v in verdicts)
    return dict(groups=len(verdicts), agree=agree, agree_share=share,
                worst_ratio=max(ratios) if ratios else None, met=met)


def full_timing(model, x) -> list[dict]:
    """Full timing's decision for each fusion group of `model` on the batch
    `x`, whether it fuses or keeps the original layers (then the optimized
    model has no fused layer to ask: the decisions are `optimize`'s result)."""
    import rnnfuse

    results = rnnfuse.optimize(model, cache=False, tune=x, return_result=True).plans
    if not results:
        raise RuntimeError(f"model '{model.name}' has no fusion group to time")
    if not any(r.timings for r in results):
        raise RuntimeError(f"full timing timed nothing here ({results[0].source}; no GPU "
                           "visible to the backend?)")
    return [dict(layers=list(r.group.layers), chosen=r.plan.name, source=r.source,
                 timings_ms={n: 1e3 * s for n, s in r.timings.items()},
                 rejected=dict(r.rejected)) for r in results]


def online_decisions(model, x, y, steps: int) -> list[dict]:
    """Online tuning's training decisions for `model` over one `fit` of
    `steps` batches, each the batch `x`, `y` (its candidates race on the
    fit's own steps, every one started: the question is the race's choice,
    not what a fit this long may spend on it)."""
    import keras

    import rnnfuse
    from rnnfuse.tuning.first_batch import decisions

    class Repeated(keras.utils.PyDataset):
        """The one batch, `steps` times (no copy of it a step)."""

        def __init__(self):
            super().__init__()

        def __len__(self):
            return steps

        def __getitem__(self, index):
            return x, y

    online = rnnfuse.optimize(model, cache=False, online=True)
    if getattr(online, "_rnnfuse_autotune", None) is None:
        raise RuntimeError("optimize made no layer that tunes at its first batch "
                           "(no GPU visible to the backend?)")
    online._rnnfuse_autotune.fit_share = None  # no budget: every candidate starts
    online.compile(optimizer="adam", loss="mse")
    online.fit(Repeated(), epochs=1, verbose=0, shuffle=False)
    return [dict(layers=d["layers"], chosen=d["chosen"], source=d["source"],
                 timings_ms=d["timings_ms"], rejected=d["rejected"])
            for d in decisions(online) if d.get("mode") == "training"]


def compare(full: list[dict], online: list[dict]) -> dict:
    """Full timing's and online tuning's decisions paired by group (its
    layers), with each pair's verdict."""
    by_layers = {tuple(o["layers"]): o for o in online}
    missing = dict(chosen=None, source="no online decision", timings_ms={})
    paired = [by_layers.get(tuple(f["layers"]), dict(missing, layers=f["layers"])) for f in full]
    return dict(full=full, online=paired, verdicts=[judge(f, o) for f, o in zip(full, paired)])


def measure(shape: dict, steps: int) -> dict:
    """Full timing's and online tuning's training decisions for `shape`."""
    import keras

    import bench_matrix

    model = bench_matrix.build_keras(shape)
    x, y, _ = bench_matrix.data(shape)
    full = full_timing(model, x)
    online = online_decisions(model, x, y, steps)
    keras.backend.clear_session()
    return compare(full, online)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file (default: outside the repository)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated names of bench_matrix.SHAPES")
    parser.add_argument("--steps", type=int, default=80,
                        help="batches of the online fit (the race's room: 10 candidates of 7 steps)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (still a GPU)")
    args = parser.parse_args(argv)
    import keras

    import bench_matrix
    import rnnfuse

    unknown = [n for n in args.shapes.split(",") if n not in bench_matrix.SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(bench_matrix.SHAPES)}")
    backend = keras.backend.backend()
    args.out = args.out or out_path(f"online_agreement_{backend}.json")
    meta = dict(backend=backend, keras=keras.__version__, rnnfuse=rnnfuse.__version__,
                python=platform.python_version(), steps=args.steps, quick=args.quick)
    rows = []
    for name in args.shapes.split(","):
        shape = bench_matrix.SHAPES[name]
        shape = bench_matrix.quick(shape) if args.quick else shape
        try:
            row = dict(shape_name=name, **measure(shape, args.steps))
            sources = [o["source"] for o in row["online"]]
            print(f"online {backend} {name}: {row['verdicts']} (online: {sources})", flush=True)
            for o in row["online"]:
                print(f"online {backend} {name} not raced: {o.get('rejected')}", flush=True)
        except Exception as err:  # noqa: BLE001 - record and go on
            row = dict(shape_name=name, error=f"{type(err).__name__}: {err}"[:500])
            print("ERROR", backend, name, row["error"], flush=True)
        rows.append(row)
        verdicts = [v for r in rows for v in r.get("verdicts", [])]
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=rows, summary=summarize(verdicts)), f, indent=1)
    print(f"online agreement {backend}: {summarize(verdicts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
