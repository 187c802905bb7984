"""Plans that differ only in cuDNN's algorithm share one compiled tuning
step under JAX (`rnnfuse.backends.jax.shared_steps`), on the CPU with the
emulated core: one XLA compile for the twins, each step running its own
algorithm code, the switch's results and gradients those of the static
call, a refusal attributed to its candidate, and a committed plan's program
with no switch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rnnfuse
from builders import stack_model
from rnnfuse.backends.cuda.cudnn_core import E_NOT_SUPPORTED, CoreError
from rnnfuse.backends.jax import AheadOfTimeStep, cudnn_core
from rnnfuse.backends.jax.shared_steps import SwitchedStep
from rnnfuse.plan import Plan
from rnnfuse.tuning import tuner

WHOLE = Plan((2,))
STATIC, DYNAMIC = Plan((2,), "persistent_static+tc"), Plan((2,), "persistent_dynamic+tc")
TWINS = [WHOLE, STATIC, DYNAMIC]


def _group():
    model = stack_model("lstm", 2, units=3, steps=2)
    (group,) = rnnfuse.analyze(model).groups
    return group


def _shape(group):
    return (2, 2, group.input_size)


def _static_code(core, group, plan, training=False) -> int:
    """The algorithm attribute of `plan`'s own (unshared) step, traced."""
    (step,) = tuner._steps(group, [plan], _shape(group), "float32", training).values()
    core.calls.clear()
    step.trace()
    (code,) = {attrs["algorithm"] for _, attrs in core.calls}
    return code


def _primitives(jaxpr) -> list[str]:
    """Every primitive of `jaxpr`, its sub-jaxprs' (a switch's branches) included."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names += _primitives(inner)
    return names


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_twins_compile_once_each_runs_its_code_and_a_refusal_is_its_own(training, emulated_core,
                                                                       compiles):
    """The refused candidate first: the others' indices then map past it."""
    group = _group()
    twins = [STATIC, WHOLE, DYNAMIC]
    codes = {p.name: _static_code(emulated_core, group, p, training) for p in TWINS}
    assert len(set(codes.values())) == 3, codes
    refused_code = codes[STATIC.name]
    emulated_core.refuse = lambda c: (CoreError("persistent: no kernel for this shape",
                                                E_NOT_SUPPORTED)
                                      if c.algorithm == refused_code else None)
    # cuDNN's reserve sizes differ by algorithm: the switch's is the largest.
    emulated_core.extra_reserve = {codes[DYNAMIC.name]: 64}
    emulated_core.record_runs = True
    steps = tuner._steps(group, twins, _shape(group), "float32", training)
    assert all(isinstance(s, SwitchedStep) for s in steps.values())
    before = len(compiles)
    kept, refused = tuner._first_calls(steps, {p.name: p for p in twins})
    assert len(compiles) - before == 1, "one XLA program for the three twins"
    assert sorted(kept) == [WHOLE.name, DYNAMIC.name]
    assert list(refused) == [STATIC.name]
    assert refused[STATIC.name].startswith("not timed: standard ran for persistent_static+tc")
    assert "cuDNN refused persistent_static+tc" in refused[STATIC.name]
    targets = ("forward_training", "backward_data", "backward_weights") if training else ("forward",)
    for name in kept:
        emulated_core.ran.clear()
        float(kept[name]())
        assert sorted(emulated_core.ran) == sorted(
            (f"rnnfuse_cudnn_ffi_{t}", codes[name]) for t in targets), name
    assert len(compiles) - before == 1


def test_the_switch_gives_the_static_calls_outputs_and_gradients(emulated_core):
    emulated_core.extra_reserve = {5: 40}
    emulated_core.record_runs = True
    configs = tuple(cudnn_core.CoreConfig("lstm", 2, 3, 4, algorithm=a) for a in (0, 5))
    rng = np.random.default_rng(0)
    n = int(emulated_core._params(configs[0]))
    x, hx, cx, params = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                         for s in ((2, 2, 4), (2, 2, 3), (2, 2, 3), (n,)))
    lengths = jnp.full((2,), 2, jnp.int32)

    def loss(x, hx, cx, params, index=None, config=configs):
        y, hy, cy = cudnn_core.rnn(x, hx, cx, params, lengths, config=config, training=True,
                                   index=index)
        return jnp.sum(y**2) + jnp.sum(hy**3) + jnp.sum(cy), (y, hy, cy)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    switched = jax.jit(grad)
    for i, config in enumerate(configs):
        emulated_core.ran.clear()
        got = switched(x, hx, cx, params, jnp.asarray(i, jnp.int32))
        assert {code for _, code in emulated_core.ran} == {config.algorithm}
        want = jax.jit(lambda *a, c=config: grad(*a, config=c))(x, hx, cx, params)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_a_committed_plans_program_has_no_switch_a_tuning_one_has(emulated_core):
    group = _group()
    code = _static_code(emulated_core, group, STATIC, training=True)
    (step,) = tuner._steps(group, [STATIC], _shape(group), "float32", True).values()
    assert isinstance(step, AheadOfTimeStep)
    emulated_core.calls.clear()
    committed = _primitives(jax.make_jaxpr(step._fn)(*step._args).jaxpr)
    assert "cond" not in committed
    assert [(t.removeprefix("rnnfuse_cudnn_ffi_"), a["algorithm"]) for t, a in emulated_core.calls] == [
        ("forward_training", code), ("backward_data", code), ("backward_weights", code)]
    shared = tuner._steps(group, TWINS, _shape(group), "float32", True)[STATIC.name]
    program = shared._program
    assert "cond" in _primitives(jax.make_jaxpr(program._fn)(*program._args).jaxpr)


class _Program:
    """A shared program whose call with index 1 fails as the core's FFI
    handler fails when cuDNN refuses the algorithm as the step runs."""

    def trace(self):
        pass

    def compile(self):
        pass

    def __call__(self, index):
        if int(index) == 1:
            raise RuntimeError("UNIMPLEMENTED: rnnfuse cuDNN training forward: "
                               "CUDNN_STATUS_NOT_SUPPORTED (core code 2)")
        if int(index) == 2:
            raise ValueError("a bug in the step")
        return jnp.float32(1.0)


def test_cudnn_refusing_an_algorithm_when_the_step_runs_refuses_that_candidate_only():
    program = _Program()
    steps = {p.name: SwitchedStep(program, {}, i, p.algorithm, (jnp.asarray(i, jnp.int32),))
             for i, p in enumerate(TWINS[:2])}
    kept, refused = tuner._first_calls(steps, {p.name: p for p in TWINS})
    assert list(kept) == [WHOLE.name]
    assert refused == {STATIC.name: (
        "not timed: cuDNN refused persistent_static+tc when the step ran (UNIMPLEMENTED: "
        "rnnfuse cuDNN training forward: CUDNN_STATUS_NOT_SUPPORTED (core code 2))")}
    other = SwitchedStep(program, {}, 2, DYNAMIC.algorithm, (jnp.asarray(2, jnp.int32),))
    with pytest.raises(ValueError, match="a bug in the step"):
        tuner._first_calls({DYNAMIC.name: other}, {DYNAMIC.name: DYNAMIC})
