"""`rnnfuse check MODEL`: the largest difference between the original and
the optimized model, in outputs and every trainable variable's gradient;
exits 1 above the tolerance (default: `DEFAULT_TOLERANCE` of the model's
narrowest dtype). Float32 matmuls are kept exact on GPUs, so TF32 rounding
does not hide rnnfuse's differences.

>>> DEFAULT_TOLERANCE["float16"]
0.02
"""

from __future__ import annotations

import importlib.util
import math

from rnnfuse.cli import pipeline, render
from rnnfuse.cli.arguments import positive_int, tolerance
from rnnfuse.cli.errors import CliError
from rnnfuse.cli.inputs import backend_for, random_inputs, run_model
from rnnfuse.cli.loading import load_model

NAME = "check"
HELP = "compare outputs and gradients of the original and optimized model"
PARENTS = ("model", "plan", "json")

# Default tolerances (max abs difference), by compute dtype.
DEFAULT_TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
# Time steps of inputs whose time dimension is None, unless --steps says.
DEFAULT_STEPS = 16


def add_arguments(parser) -> None:
    parser.add_argument(
        "--tolerance",
        type=tolerance,
        metavar="X",
        help="largest allowed max abs difference (default 1e-4; 2e-2 for float16)",
    )
    parser.add_argument("--batch", type=positive_int, default=4, metavar="N", help="batch size (default 4)")
    parser.add_argument(
        "--steps",
        type=positive_int,
        metavar="T",
        help=f"time steps, for inputs whose time dimension is None (default {DEFAULT_STEPS})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument(
        "--mixed-precision", action="store_true", help="run both models under the mixed_float16 dtype policy"
    )


def run(args) -> int:
    import numpy as np

    from rnnfuse.cli.output import envelope, group_records, input_records

    engine = backend_for(NAME)
    engine.exact_float32()
    model = load_model(
        args.model, imports=args.imports, safe_mode=not args.unsafe, mixed_precision=args.mixed_precision
    )
    report = pipeline.analyze(model, args.min_layers)
    notes: list[str] = []
    inputs, described = random_inputs(
        model,
        batch=args.batch,
        steps=args.steps,
        default_steps=DEFAULT_STEPS,
        rng=np.random.default_rng(args.seed),
        notes=notes,
    )
    optimized = pipeline.optimize(model, args)
    chosen, fast = list(optimized.plans), optimized.model
    variables = list(model.trainable_variables)
    run_both = engine.outputs_and_grads
    out_orig, grads_orig = run_model(run_both, model, inputs, variables, args.seed, command=NAME)
    out_fast, grads_fast = run_model(run_both, fast, inputs, variables, args.seed, command=NAME)
    if len(out_orig) != len(out_fast):
        raise CliError(
            f"the optimized model returns {len(out_fast)} outputs and the "
            f"original {len(out_orig)}. Fix: this is a bug in rnnfuse; please report it"
        )
    out_diff, out_scale = _max_diff(out_orig, out_fast)
    grad_diff, grad_scale, worst = 0.0, 0.0, None
    for v, a, b in zip(variables, grads_orig, grads_fast):
        d, s = _max_diff([a], [b])
        grad_scale = max(grad_scale, s)
        if worst is None or d > grad_diff:
            grad_diff, worst = d, v.path
    compute = pipeline.compute_dtype(model)
    limit = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE.get(compute, 1e-4)
    passed = out_diff <= limit and grad_diff <= limit
    paths = pipeline.fused_paths(fast)
    compared_fused = any(p == "fused" or (p and not p.startswith("layers")) for p in paths.values())
    device, on_gpu = engine.describe_device()
    result = {
        **envelope(NAME, model.name),
        "device": device,
        "gpu": bool(on_gpu),
        "compute_dtype": compute,
        "batch": args.batch,
        "groups": group_records(chosen),
        "fused_paths": paths,
        "inputs": input_records(described),
        "outputs_max_abs_diff": _finite(out_diff),
        "outputs_max_abs": out_scale,
        "gradients_max_abs_diff": _finite(grad_diff),
        "gradients_max_abs": grad_scale,
        "gradients_worst_variable": worst,
        "variables": len(variables),
        "tolerance": limit,
        "passed": passed,
        "compared_fused_path": compared_fused,
        "caveat": pipeline.caveat(paths, len(report.groups)),
        "notes": notes,
    }
    if not compared_fused:
        result["notes"].append(_self_comparison_note(chosen) if report.groups else (
            "nothing fuses in this model, so this compared the model against itself: "
            "PASS says nothing about the fused kernel."
        ))
    if args.json:
        render.print_json(result)
    else:
        render.print_check(render.Printer(quiet=bool(args.quiet)), result)
    return 0 if passed else 1


def _self_comparison_note(chosen) -> str:
    """Says that `check` compared the original layers against themselves."""
    from rnnfuse.placement import backend_name

    why = pipeline.nothing_fused_here(chosen) or "every fused layer fell back to the original layers"
    text = (
        f"no fused call ran here ({why}), so this compared the original layers "
        "against themselves: PASS says nothing about the fused kernel."
    )
    if backend_name() == "tensorflow":
        if importlib.util.find_spec("torch") is not None:
            text += (
                " To compare a fused call on this machine, run under "
                "KERAS_BACKEND=torch (its fused call runs on the CPU too)."
            )
        else:
            text += (
                " To compare a fused call on a CPU: pip install 'rnnfuse[torch]' "
                "and run under KERAS_BACKEND=torch; or run on a CUDA GPU."
            )
    else:
        text += " Run on a CUDA GPU to compare the fused call."
    return text


def _max_diff(a: list, b: list) -> tuple[float, float]:
    """(max abs difference, max abs value of `a`) over paired arrays."""
    import numpy as np

    diff, scale = 0.0, 0.0
    for x, y in zip(a, b):
        x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x64.shape != y64.shape:
            return float("inf"), scale
        if x64.size:
            diff = max(diff, float(np.max(np.abs(x64 - y64))))
            scale = max(scale, float(np.max(np.abs(x64))))
    return diff, scale


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
