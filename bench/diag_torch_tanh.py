"""Why a float32 tanh RNN on cuDNN (through PyTorch) is 2e-4 from float64.

tests/gpu/test_gpu_torch.py found the fused rnn_tanh stack 2.2e-4 (relative)
from a float64 run of the same model, while Keras' own float32 loop is
6e-6 from it; relu, LSTM and GRU are at 1e-6. This script isolates it with
plain PyTorch modules (no Keras, no rnnfuse): float32 on cuDNN (TF32 off,
and on for contrast), on PyTorch's native CUDA kernels (cuDNN disabled) and
on the CPU, each against float64 on the CPU, for 1 step / 1 layer (one
activation) up to 50 steps / 3 layers.

    python3 bench/diag_torch_tanh.py   # on the GPU machine, PyTorch only
"""

import json
import sys

import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def module(kind, layers):
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}.get(kind, torch.nn.RNN)
    kw = {"nonlinearity": kind.split("_")[1]} if kind.startswith("rnn_") else {}
    torch.manual_seed(0)
    m = cls(16, 32, num_layers=layers, batch_first=True, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(-0.5, 0.5)
    return m


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max())


def errors(kind, layers, steps, where, tf32=False):
    m = module(kind, layers)
    x = torch.randn(8, steps, 16, generator=torch.Generator().manual_seed(1))
    ref = module(kind, layers).double()(x.double())[0]
    dev = "cuda" if where != "cpu" else "cpu"
    m32 = m.to(dev)
    # cudnn.flags() resets every flag it is not given: allow_tf32 too.
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=where == "cudnn", allow_tf32=tf32):
        y = m32(x.to(dev))[0]
    return rel(y, ref)


def main():
    settings = {"cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}
    rnn_prec = getattr(getattr(torch.backends.cudnn, "rnn", None), "fp32_precision", None)
    settings["cudnn.rnn.fp32_precision"] = rnn_prec
    settings["cudnn.version"] = torch.backends.cudnn.version()
    print(settings)
    rows = []
    for kind in ("rnn_tanh", "rnn_relu", "lstm", "gru"):
        for layers, steps in ((1, 1), (1, 50), (3, 50)):
            row = dict(kind=kind, layers=layers, steps=steps)
            for where in ("cudnn", "cuda_native", "cpu"):
                row[where] = errors(kind, layers, steps, where)
            row["cudnn_tf32"] = errors(kind, layers, steps, "cudnn", tf32=True)
            rows.append(row)
            print(" ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(settings=settings, rows=rows), f, indent=1, default=str)


if __name__ == "__main__":
    main()
