"""Which kernels of two wavefront cubins differ in their machine code (SASS).

A change meant for one kernel (an opt-in variant) must leave every other
kernel's SASS as it was. This disassembles both cubins with nvdisasm (the
CUDA toolkit's, or the nvidia-cuda-nvdisasm wheel's; $NVDISASM overrides),
splits them by kernel, renumbers the local labels in order of appearance
(their numbers shift with code elsewhere in the file) and prints each
kernel as `same` or `DIFFERS`; exit status 1 if one differs that is not
named in --expect.

    nvcc -std=c++17 -O3 -cubin -gencode=arch=compute_90a,code=sm_90a \\
        rnnfuse/backends/cuda/csrc/wavefront.cu -o /tmp/new.cubin   # and /tmp/old.cubin from main
    python3 tools/sass_diff.py /tmp/old.cubin /tmp/new.cubin --expect rnnfuse_wf_forward_v2
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys


def kernels(sass: str) -> dict[str, str]:
    """{kernel: its SASS with local labels renumbered} of nvdisasm's output.

    >>> k = kernels(".text.a:\\n BRA `(.L_x_7)\\n.L_x_7:\\n.text.b:\\n BRA `(.L_x_9)\\n.L_x_9:\\n")
    >>> k["a"] == k["b"], sorted(k)
    (True, ['a', 'b'])
    """
    parts = re.split(r"^\.text\.(\w+):", sass, flags=re.M)
    out = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        body = re.split(r"^//-{5,}", body, flags=re.M)[0]  # not the next section's header
        labels: dict[str, str] = {}
        renumber = lambda m: labels.setdefault(m.group(0), f".L{len(labels)}")  # noqa: E731
        out[name] = re.sub(r"\.L_x_\d+", renumber, body)
    return out


def disassemble(cubin: str) -> str:
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not tool:
        raise SystemExit("no nvdisasm: install the CUDA toolkit or the nvidia-cuda-nvdisasm "
                         "wheel, or set NVDISASM to its path")
    return subprocess.run([tool, "-c", cubin], check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--expect", action="append", default=[],
                    help="a kernel name prefix allowed to differ (repeatable)")
    args = ap.parse_args(argv)
    old, new = kernels(disassemble(args.old)), kernels(disassemble(args.new))
    unexpected = sorted(n for n in set(old) ^ set(new) if not any(n.startswith(p) for p in args.expect))
    for name in sorted(set(old) & set(new)):
        same = old[name] == new[name]
        print(("same    " if same else "DIFFERS ") + name)
        if not same and not any(name.startswith(p) for p in args.expect):
            unexpected.append(name)
    for name in sorted(set(old) ^ set(new)):
        print(f"only in {'old' if name in old else 'new'}: {name}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
