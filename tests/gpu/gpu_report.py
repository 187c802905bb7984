"""The GPU tests' numbers for the closing note: one line on stdout
(`GPU_REPORT <name> <json>`) and, with RNNFUSE_REPORT_DIR set, <name>.json
there.

    >>> report("example", {"max_diff": 0.0})  # doctest: +ELLIPSIS
    <BLANKLINE>
    GPU_REPORT example {"max_diff": 0.0}
"""

from __future__ import annotations

import json
import os


def report(name: str, data: dict) -> None:
    """Prints `data` as one GPU_REPORT line and writes it to $RNNFUSE_REPORT_DIR/<name>.json."""
    print(f"\nGPU_REPORT {name} {json.dumps(data)}")
    folder = os.environ.get("RNNFUSE_REPORT_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=1)
