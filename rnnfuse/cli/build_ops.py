"""`rnnfuse build-ops [--force]`: compiles rnnfuse's native libraries now (no
GPU needed; else on first GPU use, into $RNNFUSE_CACHE_DIR/ops or the user
cache folder) and prints their paths: the cuDNN RNN core, the wavefront
library, then TensorFlow's ops or, under KERAS_BACKEND=jax, the XLA FFI
libraries (the wavefront kernel's last). A library not built is a note.

>>> from rnnfuse.cli import main
>>> main(["build-ops"])  # doctest: +SKIP
0
"""

from __future__ import annotations

import sys

from rnnfuse.cli.errors import CliError

NAME = "build-ops"
HELP = ("compile rnnfuse's native libraries and TensorFlow ops (under JAX: its XLA FFI library) "
        "now (no GPU needed) and print where they went")
PARENTS = ()


def add_arguments(parser) -> None:
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")


def run(args) -> int:
    from rnnfuse.backends.cuda import build

    core_built = False
    try:
        print(build.build_cudnn_core(force=args.force))
        core_built = True
    except build.BuildError as err:
        print(f"rnnfuse: the cuDNN RNN core was not built ({err}); fused torch stacks run on "
              "torch._VF", file=sys.stderr)
    _build_wavefront_library(build, args.force)
    from rnnfuse.backends import active_name

    if active_name() == "jax":
        return _build_for_jax(args.force)
    try:
        from rnnfuse.backends.tensorflow import op_build
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "tensorflow":
            raise
        if core_built:
            print("rnnfuse: TensorFlow is not installed here: its ops were not built",
                  file=sys.stderr)
            return 0
        raise CliError(
            "build-ops compiles rnnfuse's op for TensorFlow, and TensorFlow is not "
            "installed here. Fix: pip install 'tensorflow>=2.16' (what the "
            "rnnfuse[tensorflow] extra adds); under KERAS_BACKEND=torch or jax "
            "rnnfuse needs no op"
        ) from err
    try:
        path = op_build.build_op(force=args.force)
    except op_build.BuildError as err:
        raise CliError(f"building the op failed: {err}") from err
    try:
        print(op_build.build_wavefront_op(force=args.force))
    except op_build.BuildError as err:
        print(f"rnnfuse: the wavefront op was not built ({err}); fused stacks run on cuDNN",
              file=sys.stderr)
    print(path)
    return 0


def _build_wavefront_library(build, force: bool) -> None:
    """The wavefront kernel's C-ABI library: every backend's kernel checks load it."""
    try:
        print(build.build_library(force=force))
    except build.BuildError as err:
        print(f"rnnfuse: the wavefront library was not built ({err}); fused stacks run on "
              "cuDNN", file=sys.stderr)


def _build_for_jax(force: bool) -> int:
    """Builds the XLA FFI libraries for JAX and prints their paths."""
    from rnnfuse.backends.jax import ffi_build

    try:
        print(ffi_build.build_cudnn_ffi_library(force=force))
    except ffi_build.BuildError as err:
        print(f"rnnfuse: the cuDNN core's XLA FFI library was not built ({err}); fused "
              "stacks run the wavefront kernel or the original layers", file=sys.stderr)
    try:
        print(ffi_build.build_ffi_library(force=force))
    except ffi_build.BuildError as err:
        raise CliError(f"building rnnfuse's XLA FFI library for JAX failed ({err}); fused "
                       "stacks run the cuDNN core or the original layers") from err
    return 0
