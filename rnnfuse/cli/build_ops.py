"""`rnnfuse build-ops [--force]`: compiles rnnfuse's ops for TensorFlow now
(no GPU needed) and prints where the libraries went: the wavefront op's
(inference kernel, needs nvcc; a failure there is a note, not an error),
then the cuDNN RNN op's on the last line.

The op is otherwise built on first GPU use (rnnfuse.backends.tensorflow
.op_build), into $RNNFUSE_CACHE_DIR/ops or the user cache folder. Without
TensorFlow installed it exits 2, saying how to install it.

Example:

    >>> from rnnfuse.cli import main
    >>> main(["build-ops"])  # doctest: +SKIP
    /home/me/.cache/rnnfuse/ops/...
    0
"""

from __future__ import annotations

import sys

from rnnfuse.cli.errors import CliError

NAME = "build-ops"
HELP = "compile rnnfuse's ops for TensorFlow now (no GPU needed) and print where the libraries went"
PARENTS = ()


def add_arguments(parser) -> None:
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")


def run(args) -> int:
    try:
        from rnnfuse.backends.tensorflow import op_build
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "tensorflow":
            raise
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
