"""bench/diag_wavefront_variant.py's one-hot analysis on the CPU: fed an
exact LSTM step of its one-hot weights and coded h0 (two layers, so layer
1 reads [layer below, own] over K = 2H) it finds every product right; fed
a step whose product read two columns of the own h swapped (a core-matrix
mix-up) it finds exactly those gate rows wrong and names the column read.
The whole run, on the CPU with rnnfuse's reference in the kernel's place,
passes, and with one gate poisoned names its step, layer, row, gate and CTA.
The runs themselves need a Hopper GPU: `tools/gpu/batch.sh wavefront-wgmma-diag`.
"""

from __future__ import annotations

import doctest
import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

DIAG = Path(__file__).resolve().parents[2] / "bench" / "diag_wavefront_variant.py"


@pytest.fixture(scope="module")
def diag():
    sys.path.insert(0, str(DIAG.parent))
    saved = dict(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location("diag_wavefront_variant_under_test", DIAG)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:  # bench_wavefront installs stand-in packages for rnnfuse's modules
        sys.path.remove(str(DIAG.parent))
        for name in set(sys.modules) - set(saved):
            if name.startswith("rnnfuse") or name == "bench_wavefront":
                del sys.modules[name]
        sys.modules.update({k: v for k, v in saved.items() if k.startswith("rnnfuse")})
    return module


def one_step(diag, layers: int, code: str, swap=None):
    """(h0, hy, pre-activations) of one LSTM step of the one-hot weights on
    the CPU, h rounded to float16 between layers; `swap` (a, b): the
    product reads own-h columns a and b of layer 1 exchanged."""
    w = diag.onehot_weights(layers)
    h0 = diag.coded_h0(layers, code, torch.float16, "cpu")
    hy, pres = torch.empty_like(h0), []
    below = None
    for l in range(layers):
        own = h0[l].float()
        if swap is not None and l == 1:
            a, b = swap
            own = own.clone()
            own[:, [a, b]] = own[:, [b, a]]
        pre = own @ w[4 * l + 1].t()
        if l:
            pre = pre + below @ w[4 * l].t()
        i, f, g, o = pre.chunk(4, dim=1)
        act = torch.cat([i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()], dim=1)
        hy[l] = (o.sigmoid() * torch.tanh(i.sigmoid() * g.tanh())).half()
        below = hy[l].float()
        pres.append(diag.pre_activations(act))
    return h0, hy, torch.stack(pres)


def test_the_module_examples_hold(diag):
    assert doctest.testmod(diag).failed == 0


def test_an_exact_step_reads_every_input_right(diag):
    runs = {code: one_step(diag, 2, code) for code in ("k", "n")}
    report = diag.onehot_analysis(runs, 2)
    assert [(r["layer"], r["K"], r["mismatches"]) for r in report] == [(0, 512, 0), (1, 1024, 0)]
    assert all(r["ok_share_k"] == r["ok_share_n"] == 1.0 for r in report)


def test_a_swapped_pair_of_columns_is_found_and_named(diag):
    a, b = 17, 17 ^ 8  # neighbouring core matrices along K
    runs = {code: one_step(diag, 2, code, swap=(a, b)) for code in ("k", "n")}
    layer0, layer1 = diag.onehot_analysis(runs, 2)
    assert layer0["mismatches"] == 0
    cols = [diag.onehot_column(r, 1, 1024) for r in range(4 * diag.H)]
    readers = sum(c - diag.H in (a, b) for c in cols)  # gate rows reading either column
    assert layer1["mismatches"] == readers * diag.B
    first = layer1["first_mismatches"][0]
    want = first["want_k"] - diag.H
    assert want in (a, b)
    assert diag.H + (b if want == a else a) in first["k_read"]
    assert first["n_read"][0] == first["batch_row"]  # the right batch row, the wrong column


def reference_kernel(diag, poison=None):
    """A stand-in for the kernel's saving forward on the CPU: rnnfuse's
    reference; `poison` (layer, step, batch row, gate column): that gate NaN."""
    def kernel(mod, x, h0, c0, variant):
        params = diag.bw.wavefront.flat_params(mod).contiguous()
        y, hy, cy, (_, gates, cseq) = diag.bw.wavefront.reference_forward_saving(
            x, params, h0, c0, None, kind="lstm")
        if poison is not None and variant:
            gates[poison] = float("nan")
        return y, hy, cy, gates, cseq
    return kernel


def test_the_whole_run_passes_a_correct_kernel(diag, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(diag, "DEVICE", "cpu")
    monkeypatch.setattr(diag, "kernel", reference_kernel(diag))
    assert diag.run(2, str(tmp_path / "diag.json")) == 0
    rows = json.loads((tmp_path / "diag.json").read_text())["results"]
    assert len(rows) == 2 * len(diag.CASES) and {r["status"] for r in rows} == {"ok"}
    assert capsys.readouterr().out.splitlines()[-1] == f"diag: {len(rows)}/{len(rows)} ok"


def test_the_whole_run_places_the_first_bad_gate(diag, monkeypatch, tmp_path):
    monkeypatch.setattr(diag, "DEVICE", "cpu")
    # layer 2, step 1, batch row 5, gate f of unit 88 (CTA 5 of 16 units)
    monkeypatch.setattr(diag, "kernel", reference_kernel(diag, poison=(2, 1, 5, diag.H + 88)))
    assert diag.run(2, str(tmp_path / "diag.json")) == 1
    rows = json.loads((tmp_path / "diag.json").read_text())["results"]
    (bad,) = [r for r in rows if r["status"] != "ok" and r["layers"] == 4 and r["steps"] == 3]
    assert bad["variant"] == 2
    assert bad["first_bad"] == dict(step=1, layer=2, count=1, rows=[5],
                                    gates=dict(i=0, f=1, g=0, o=0), ctas=[5])


def test_every_case_is_a_plan_variant_two_takes(diag, wavefront_host):
    """CTAs of 16 units over K 512 or 1024 on a 132-SM Hopper GPU (a stack
    of 1 or 2 layers plans CTAs of 8 units there, which variant 2 refuses)."""
    from rnnfuse.backends.cuda import library

    lib = library.load(wavefront_host)
    for layers, steps, _, _ in diag.CASES:
        plan = lib.plan_layers("lstm", layers, diag.H, diag.B, steps, diag.H, **library.H200)
        assert {(p["units"], p["kpad"]) for p in plan} <= {(16, 512), (16, 1024)}
