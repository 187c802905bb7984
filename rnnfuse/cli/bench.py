"""`rnnfuse bench MODEL`: times the original and the optimized model on the
same random inputs, `--warmup` untimed runs each, then `--repeats` timed
runs in alternating order, so drift favours neither.

>>> from rnnfuse.cli import main
>>> main(["bench", "model.keras", "--batch", "32", "--steps", "200", "--train"])  # doctest: +SKIP
0
"""

from __future__ import annotations

import logging
import statistics
import time

from rnnfuse.cli import pipeline, render
from rnnfuse.cli.arguments import positive_int
from rnnfuse.cli.inputs import backend_for, random_inputs, run_model
from rnnfuse.cli.loading import load_model

NAME = "bench"
HELP = "time the original and the optimized model on this machine"
PARENTS = ("model", "plan", "json")

logger = logging.getLogger("rnnfuse")


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=positive_int, default=32, metavar="N", help="batch size (default 32)")
    parser.add_argument(
        "--steps", type=positive_int, metavar="T", help="time steps, for inputs whose time dimension is None"
    )
    parser.add_argument(
        "--train", action="store_true", help="time a training step (forward and gradients) instead of inference"
    )
    parser.add_argument(
        "--mixed-precision", action="store_true", help="run both models under the mixed_float16 dtype policy"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=10, metavar="K", help="timed runs of each model (default 10)"
    )
    parser.add_argument("--warmup", type=positive_int, default=2, metavar="W", help="untimed runs first (default 2)")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="let optimize() time each group's candidate plans on this device "
        "for this batch and length (cached on disk) instead of its rule table",
    )


def run(args) -> int:
    import keras
    import numpy as np

    import rnnfuse
    from rnnfuse.cli.output import envelope, group_records, input_records

    engine = backend_for(NAME)
    model = load_model(
        args.model, imports=args.imports, safe_mode=not args.unsafe, mixed_precision=args.mixed_precision
    )
    report = pipeline.analyze(model, args.min_layers)
    notes: list[str] = []
    inputs, described = random_inputs(
        model, batch=args.batch, steps=args.steps, rng=np.random.default_rng(0), notes=notes
    )
    tune = None
    if args.tune:
        steps = next((np.shape(x)[1] for x in keras.tree.flatten(inputs) if np.ndim(x) >= 2), 1)
        tune = rnnfuse.TuneShape(args.batch, int(steps))
    optimized = pipeline.optimize(model, args, tune=tune, training=args.train)
    chosen, fast = list(optimized.plans), optimized.model
    device, on_gpu = engine.describe_device()
    notes += engine.timing_notes(on_gpu)
    result = {
        **envelope(NAME, model.name),
        "device": device,
        "gpu": on_gpu,
        "mode": "train" if args.train else "inference",
        "compute_dtype": pipeline.compute_dtype(model),
        "batch": args.batch,
        "inputs": input_records(described),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "groups": group_records(chosen),
        "notes": notes,
    }
    # Say what the numbers can show before spending the time on them.
    early = _early_caveat(report, chosen)
    printer = render.Printer(quiet=bool(args.quiet))
    if not args.json:
        render.print_bench_start(printer, result, len(report.groups), early)
    elif early:
        logger.info("before timing: %s", early)
    times = _time(engine, model, fast, inputs, args, quiet=args.json or bool(args.quiet))
    paths = pipeline.fused_paths(fast)
    orig_ms, fast_ms = statistics.median(times["original"]), statistics.median(times["optimized"])
    result.update(
        {
            "fused_paths": paths,
            "original_ms": times["original"],
            "optimized_ms": times["optimized"],
            "original_median_ms": orig_ms,
            "optimized_median_ms": fast_ms,
            "speedup": orig_ms / fast_ms if fast_ms > 0 else None,
            "caveat": pipeline.caveat(paths, len(report.groups)),
        }
    )
    if args.json:
        render.print_json(result)
    else:
        render.print_bench(printer, result, early)
    return 0


def _time(engine, model, fast, inputs, args, *, quiet: bool) -> dict[str, list[float]]:
    """Milliseconds of each timed run of each model, in alternating order."""
    steps = {"original": engine.model_step(model, args.train), "optimized": engine.model_step(fast, args.train)}
    times: dict[str, list[float]] = {"original": [], "optimized": []}
    with render.progress(disable=quiet) as progress:
        task = progress.add_task("warming up", total=2 * (args.warmup + args.repeats))
        for _ in range(args.warmup):
            for fn in steps.values():
                run_model(fn, inputs, command=NAME)
                progress.advance(task)
        for i in range(args.repeats):
            progress.update(task, description=f"timing {i + 1}/{args.repeats}")
            # Alternate the order so drift does not favour either model.
            order = ["original", "optimized"] if i % 2 == 0 else ["optimized", "original"]
            for which in order:
                start = time.perf_counter()
                run_model(steps[which], inputs, command=NAME)
                times[which].append(1000 * (time.perf_counter() - start))
                progress.advance(task)
    return times


def _early_caveat(report, chosen) -> str | None:
    """What the timing can show, from the plans alone (before any run)."""
    if not report.groups:
        return "nothing fuses in this model: both models run the same layers, so expect about 1.0x."
    why = pipeline.nothing_fused_here(chosen)
    if why:
        return (
            f"no group runs fused here ({why}): both models run the same layers, "
            "so expect about 1.0x. On a CUDA GPU each group runs as one cuDNN call."
        )
    return None
