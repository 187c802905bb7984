"""Where an opt-in forward variant of the wavefront kernel goes wrong, in one short run.

Runs the variant (and variant 0 beside it, as the control) on a few tiny
LSTM stacks (3 or 4 layers of 512 units, batch 64, 1 to 3 steps) through
the saving forward, which stores every layer's activated gates and c at
every step, and reports per case:

- `first_bad`: the earliest (step, layer) whose gates are NaN or more than
  TOL from the reference's (rnnfuse's reference_forward_saving: float32
  sums, h rounded to the element type between steps, as the kernel does),
  with its bad batch rows, gates (i, f, g, o) and CTAs (16 units each for
  variant 2); variant 0's rows show what a correct kernel's errors are;
- `cells`: every (step, layer)'s NaN count and largest finite gate error;
- one-hot cases (`weights="onehot"`, one step, float16): every gate row r
  of layer l has a single weight 1 at input column c(r) = (5 r + 3 l) % K
  (K = H for layer 0, 2H above: [layer below, own]), biases and x are 0,
  and h0 is coded by column (k + 1) / 2048 or by batch row (n + 1) / 256,
  so each pre-activation, recovered from its activated gate, says which
  (n, k) the product read: `onehot` gives the share read right and the
  first mismatches with the columns and rows whose value they hold. This
  isolates the product (wgmma's operands, descriptors and fragments) from
  the synchronisation and the pointwise step.

    python3 bench/diag_wavefront_variant.py --variant 2 --out $OUT/diag_v2.json

Needs a Hopper GPU, torch and this repository (bench_wavefront.py's
helpers; the library is built into the cache as there).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_wavefront as bw  # noqa: E402

H, B = 512, 64
DEVICE = "cuda"  # the tests run the whole script on "cpu" with a stand-in kernel
TOL = {"float16": 5e-3, "bfloat16": 3e-2}  # above a correct step's abs gate error
# At least 3 layers: on 132 SMs a stack of 1 or 2 plans CTAs of 8 units,
# which variant 2 refuses.
CASES = [
    # layers, steps, dtype, weights
    (3, 1, "float16", "onehot"),
    (3, 2, "float16", "random"),
    (4, 3, "float16", "random"),
    (4, 2, "bfloat16", "random"),
]


def onehot_column(r: int, layer: int, k: int) -> int:
    """The input column gate row r of `layer` reads in the one-hot cases.

    >>> [onehot_column(r, 0, 512) for r in (0, 1, 103)], onehot_column(3, 1, 1024)
    ([0, 5, 3], 18)
    """
    return (5 * r + 3 * layer) % k


def onehot_weights(layers: int, units: int = H) -> list[torch.Tensor]:
    """[w_ih, w_hh, b_ih, b_hh] per layer (float32, CPU) of the one-hot
    cases: row r of layer l is 1 at column onehot_column(r, l, K) of its
    inputs [layer below (l > 0), own h], every bias and layer 0's w_ih 0."""
    out = []
    for l in range(layers):
        kin = 0 if l == 0 else units
        w = torch.zeros(4 * units, kin + units)
        rows = torch.arange(4 * units)
        w[rows, (5 * rows + 3 * l) % (kin + units)] = 1.0
        w_ih = w[:, :kin] if l else torch.zeros(4 * units, units)
        out += [w_ih.contiguous(), w[:, kin:].contiguous(), torch.zeros(4 * units),
                torch.zeros(4 * units)]
    return out


def pre_activations(gates: torch.Tensor) -> torch.Tensor:
    """LSTM gate pre-activations [..., 4H] from the activated gates (i, f, o
    sigmoid, g tanh), in float64.

    >>> a = torch.tensor([[0.1, -0.2, 0.3, 0.05]], dtype=torch.float64)
    >>> i, f, g, o = a.chunk(4, dim=1)
    >>> act = torch.cat([i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()], 1)
    >>> bool(torch.allclose(pre_activations(act), a))
    True
    """
    g = gates.double()
    i, f, c, o = g.chunk(4, dim=-1)
    logit = lambda s: torch.log(s) - torch.log1p(-s)  # noqa: E731
    return torch.cat([logit(i), logit(f), torch.atanh(c), logit(o)], dim=-1)


def candidates(values: torch.Tensor, got: float, tol: float = 1e-4, limit: int = 6) -> list[int]:
    """Indices of `values` (1-D) within tol of `got`, the first `limit`.

    >>> candidates(torch.tensor([0.5, 0.25, 0.5]), 0.50001)
    [0, 2]
    """
    return torch.nonzero((values.double() - got).abs() <= tol).flatten()[:limit].tolist()


def bad_summary(bad: torch.Tensor, units: int = H, cta_units: int = 16) -> dict:
    """Where the True entries of a [B, 4H] mask are: batch rows, gates, CTAs.

    >>> m = torch.zeros(4, 4 * 32, dtype=torch.bool); m[1, 32 + 17] = True
    >>> bad_summary(m, units=32)
    {'count': 1, 'rows': [1], 'gates': {'i': 0, 'f': 1, 'g': 0, 'o': 0}, 'ctas': [1]}
    """
    rows = torch.nonzero(bad.any(dim=1)).flatten().tolist()
    per_gate = bad.view(bad.shape[0], 4, units).sum(dim=(0, 2)).tolist()
    unit_bad = bad.view(bad.shape[0], 4, units).any(dim=0).any(dim=0)
    ctas = sorted({u // cta_units for u in torch.nonzero(unit_bad).flatten().tolist()})
    return dict(count=int(bad.sum()), rows=rows[:24], gates=dict(zip("ifgo", per_gate)),
                ctas=ctas[:24])


def inputs(layers, steps, dtype_name, weights, code, seed):
    """(module, x, h0, c0) of one case; `code` ("k" or "n"): the one-hot
    cases' coding of h0."""
    dtype = bw.DTYPES[dtype_name]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    mod = torch.nn.LSTM(H, H, layers).to(DEVICE)
    with torch.no_grad():
        for w, v in zip(mod._flat_weights, onehot_weights(layers)):
            if weights == "random":  # bench_wavefront.make_module's draw
                v = (torch.rand(w.shape, generator=gen, device=DEVICE) * 2 - 1) / math.sqrt(H)
            w.copy_(v)
    if weights == "random":
        x = torch.randn(steps, B, H, generator=gen, device=DEVICE).to(dtype)
        h0 = (torch.randn(layers, B, H, generator=gen, device=DEVICE) * 0.5).to(dtype)
        c0 = (torch.randn(layers, B, H, generator=gen, device=DEVICE) * 0.5).to(dtype)
        return mod.to(dtype), x, h0, c0
    h0 = coded_h0(layers, code, dtype, DEVICE)
    x = torch.zeros(steps, B, H, dtype=dtype, device=DEVICE)
    return mod.to(dtype), x, h0, torch.zeros_like(h0)


def coded_h0(layers: int, code: str, dtype, device) -> torch.Tensor:
    """[layers, B, H] h0 of the one-hot cases: (k + 1) / 2048 at column k
    (code "k") or (n + 1) / 256 at batch row n (code "n"), exact in float16.

    >>> coded_h0(1, "k", torch.float16, "cpu")[0, 5, :3].tolist()
    [0.00048828125, 0.0009765625, 0.00146484375]
    >>> coded_h0(1, "n", torch.float16, "cpu")[0, 5, 9].item()
    0.0234375
    """
    n = torch.arange(B, device=device, dtype=torch.float64)[:, None].expand(B, H)
    k = torch.arange(H, device=device, dtype=torch.float64)[None, :].expand(B, H)
    coded = (k + 1) / 2048 if code == "k" else (n + 1) / 256
    return coded.expand(layers, B, H).to(dtype).contiguous()


def kernel(mod, x, h0, c0, variant):
    """(y, hy, cy, gates, c) of the kernel's saving forward (outputs
    NaN-poisoned first: bench_wavefront.kernel_forward)."""
    out = bw.kernel_forward("lstm", mod, x, h0, c0, None, variant=variant, saving=True)
    torch.cuda.synchronize()
    return out


def onehot_report(layers, variant, seed):
    """Per layer: the share of (gate row, batch row) whose pre-activation is
    the (n, k) the one-hot weights select, and the first mismatches with the
    columns (k-coded run) and rows (n-coded run) holding the value read."""
    runs = {}
    for code in ("k", "n"):
        mod, x, h0, c0 = inputs(layers, 1, "float16", "onehot", code, seed)
        y, hy, cy, gates, _ = kernel(mod, x, h0, c0, variant)
        runs[code] = (h0, hy, pre_activations(gates[:, 0]))  # [L, B, 4H]
    return onehot_analysis(runs, layers)


def onehot_analysis(runs: dict, layers: int) -> list[dict]:
    """onehot_report's numbers from each coding's run: {"k" or "n": (h0,
    hy [L, B, H] of the one step, pre-activations [L, B, 4H])}."""
    out = []
    for l in range(layers):
        k_total = H if l == 0 else 2 * H
        cols = torch.tensor([onehot_column(r, l, k_total) for r in range(4 * H)],
                            device=runs["k"][0].device)
        layer = dict(layer=l, K=k_total)
        wrong = None
        for code, (h0, hy, pre) in runs.items():
            xin = h0[l].double() if l == 0 else torch.cat([hy[l - 1], h0[l]], dim=1).double()
            want = xin[:, cols]  # [B, 4H]
            ok = (pre[l] - want).abs() <= 1e-4
            layer[f"ok_share_{code}"] = round(float(ok.double().mean()), 6)
            layer[f"nan_{code}"] = int(torch.isnan(pre[l]).sum())
            wrong = ~ok if wrong is None else wrong | ~ok
        samples = []
        for n, r in torch.nonzero(wrong)[:8].tolist():
            s = dict(batch_row=n, gate_row=r, gate="ifgo"[r // H], unit=r % H,
                     want_k=int(cols[r]))
            for code, (h0, hy, pre) in runs.items():
                xin = h0[l] if l == 0 else torch.cat([hy[l - 1], h0[l]], dim=1)
                got = float(pre[l, n, r])
                s[f"got_{code}"] = got if math.isfinite(got) else str(got)
                if code == "k":  # the columns of this batch row holding that value
                    s["k_read"] = candidates(xin[n], got) if math.isfinite(got) else []
                else:  # the batch rows holding it in column want_k
                    column = xin[:, int(cols[r])]
                    s["n_read"] = candidates(column, got) if math.isfinite(got) else []
            samples.append(s)
        layer["mismatches"] = int(wrong.sum())
        layer["first_mismatches"] = samples
        out.append(layer)
    return out


def random_report(layers, steps, dtype_name, variant, seed):
    """first_bad and every (step, layer)'s NaN count and largest finite
    gate error against the reference."""
    mod, x, h0, c0 = inputs(layers, steps, dtype_name, "random", None, seed)
    y, hy, cy, gates, _ = kernel(mod, x, h0, c0, variant)
    params = bw.wavefront.flat_params(mod).contiguous()
    ref = bw.wavefront.reference_forward_saving(x, params, h0, c0, None, kind="lstm")[3][1]
    cells, first = [], None
    for t in range(steps):
        for l in range(layers):
            g, r = gates[l, t].double(), ref[l, t].double()
            err = (g - r).abs()
            bad = torch.isnan(g) | (err > TOL[dtype_name])
            finite = err[torch.isfinite(err)]
            cells.append(dict(step=t, layer=l, nan=int(torch.isnan(g).sum()),
                              max_err=float(finite.max()) if finite.numel() else None))
            if first is None and bool(bad.any()):
                first = dict(step=t, layer=l, **bad_summary(bad))
    return dict(first_bad=first, cells=cells,
                y_nan=int(torch.isnan(y).sum()), hy_nan=int(torch.isnan(hy).sum()))


@torch.no_grad()
def run(variant: int, out: str) -> int:
    rows, failed = [], False
    for i, (layers, steps, dtype_name, weights) in enumerate(CASES):
        for v in (0, variant):
            row = dict(layers=layers, steps=steps, dtype=dtype_name, weights=weights, variant=v)
            try:
                if weights == "onehot":
                    row["onehot"] = onehot_report(layers, v, seed=i)
                    ok = all(x["mismatches"] == 0 for x in row["onehot"])
                else:
                    row.update(random_report(layers, steps, dtype_name, v, seed=i))
                    ok = row["first_bad"] is None
            except Exception as exc:  # noqa: BLE001 - record and go on
                row["error"], ok = f"{type(exc).__name__}: {exc}", False
            row["status"] = "ok" if ok else "BAD"
            failed |= not ok
            rows.append(row)
            shown = {k: row[k] for k in row if k not in ("cells",)}
            print(json.dumps(shown)[:1500], flush=True)
            if out:
                meta = bw._meta() if DEVICE == "cuda" else {}
                with open(out, "w") as f:
                    json.dump(dict(meta=meta, results=rows), f, indent=1)
    print(f"diag: {sum(r['status'] == 'ok' for r in rows)}/{len(rows)} ok", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", type=int, default=2, help="the forward step's variant")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    return run(args.variant, args.out)


if __name__ == "__main__":
    sys.exit(main())
