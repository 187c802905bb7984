"""Train a Keras model and its `rnnfuse.optimize` twin under torch DDP.

Keras' torch-backend recipe for several GPUs (keras.io, "Multi-GPU
distributed training with PyTorch"): every process builds the same Keras
model, wraps it in `torch.nn.parallel.DistributedDataParallel`, and trains
it with a torch optimizer on its shard of each global batch. rnnfuse needs
no change to that script: `rnnfuse.optimize(model)` returns a model whose
parameters are the original layers' own, so DDP all-reduces the same
gradients.

This script trains the original model and the optimized one from the same
start on the same data, and (rank 0) writes their losses, their final
weights' largest difference, each replica's FusedRNN path, and per-step
times to `--out`:

    torchrun --nproc_per_node=2 examples/ddp_train.py --out /tmp/ddp.json
    # one process, for the scaling baseline:
    torchrun --nproc_per_node=1 examples/ddp_train.py --out /tmp/ddp1.json
    # two processes sharing one GPU:
    torchrun --nproc_per_node=2 examples/ddp_train.py --one-gpu --out /tmp/ddp.json

On GPUs it uses NCCL, one GPU per process (keep NCCL_NVLS_ENABLE=0 where
NVLink multicast is off); on CPUs gloo (the CI test runs it that way).
`--one-gpu` puts every process on cuda:0 and all-reduces through gloo,
which takes CUDA tensors: NCCL refuses two ranks on one device. That checks
the multi-process recipe (each replica runs the fused call; losses and
weights match the original's) on a one-GPU machine; it measures no scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rnnfuse  # noqa: E402


def build(steps: int, features: int, units: int, layers: int) -> keras.Model:
    inp = keras.Input((steps, features))
    x = inp
    for i in range(layers):
        x = keras.layers.LSTM(units, return_sequences=i < layers - 1)(x)
    return keras.Model(inp, keras.layers.Dense(1)(x))


def train(model, x, y, *, rank, world, batch, epochs, lr, device):
    """SGD under DDP on this rank's shard of every global batch."""
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    local = batch // world
    losses, times = [], []
    for _ in range(epochs):
        for start in range(0, len(x), batch):
            xs = x[start + rank * local : start + (rank + 1) * local]
            ys = y[start + rank * local : start + (rank + 1) * local]
            xs = torch.as_tensor(xs, device=device)
            ys = torch.as_tensor(ys, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss = torch.mean((ddp(xs) - ys) ** 2)
            loss.backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
    return losses, times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--units", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--one-gpu", action="store_true",
                        help="every process on cuda:0, all-reduce through gloo")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if args.one_gpu and not cuda:
        parser.error("--one-gpu needs a CUDA GPU visible to torch")
    dist.init_process_group("nccl" if cuda and not args.one_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda:0" if args.one_gpu else f"cuda:{rank}")
        torch.cuda.set_device(device)
        # float32 without TF32, so the two models compare at float32 precision.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.samples, args.steps, args.features)).astype("float32")
    y = rng.standard_normal((args.samples, 1)).astype("float32")

    devices = [None] * world
    dist.all_gather_object(devices, str(device))
    report = {"world": world, "devices": devices, "backend": dist.get_backend()}
    for name in ("original", "optimized"):
        keras.utils.set_random_seed(0)
        with torch.device(device):
            model = build(args.steps, args.features, args.units, args.layers)
            trained = rnnfuse.optimize(model, tune=False) if name == "optimized" else model
        losses, times = train(
            trained, x, y, rank=rank, world=world, batch=args.batch,
            epochs=args.epochs, lr=0.05, device=device,
        )
        paths = [
            layer.last_path
            for layer in trained._flatten_layers(include_self=False)
            if isinstance(layer, rnnfuse.FusedRNN)
        ]
        gathered = [None] * world
        dist.all_gather_object(gathered, paths)
        report[name] = {
            "losses": losses,
            "weights": [keras.ops.convert_to_numpy(v).tolist() for v in model.weights],
            "replica_paths": gathered,
            "step_ms_median": 1e3 * statistics.median(times[2:] or times),
            "samples_per_s": args.batch / statistics.median(times[2:] or times),
        }
    if rank == 0:
        a, b = report["original"], report["optimized"]
        report["max_loss_diff"] = max(abs(p - q) for p, q in zip(a["losses"], b["losses"]))
        report["max_weight_diff"] = max(
            float(np.max(np.abs(np.asarray(p) - np.asarray(q))))
            for p, q in zip(a.pop("weights"), b.pop("weights"))
        )
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps({k: v for k, v in report.items() if k.startswith("max")}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
