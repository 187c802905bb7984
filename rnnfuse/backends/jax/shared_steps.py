"""`Timing.timed_steps` under JAX: plans that differ only in cuDNN's
algorithm share one compiled step, whose core calls switch over the
algorithms (`AlgorithmSwitch`) by a traced index each step passes. A
committed plan's step never switches (its algorithm stays static).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

__all__ = ["AlgorithmSwitch", "SwitchedStep", "timed_steps"]


class AlgorithmSwitch:
    """A step's runtime algorithm: traced int32 `index` picks one of
    `algorithms`; `refused` gets, by position, why one cannot run.

    >>> switch = AlgorithmSwitch(0, (None, "persistent_static+tc"), {})
    >>> switch.configs(lambda a: (None, "standard config", "cuDNN said no"))
    ('standard config', None)
    >>> switch.refused
    {1: 'not timed: standard ran for persistent_static+tc (cuDNN said no)'}
    """

    def __init__(self, index, algorithms: Sequence[str | None], refused: dict):
        self.index, self.algorithms, self.refused = index, tuple(algorithms), refused

    def configs(self, choice) -> tuple[Any, Any]:
        """(config, None) where one config serves every candidate that runs,
        else (the distinct configs, the index of the one to run), from
        `choice(Algorithm or None)` -> (algorithm run, config, note)."""
        from rnnfuse.plan import Algorithm

        chosen: dict[int, Any] = {}
        replaced: list = []
        failure = None
        for i, name in enumerate(self.algorithms):
            asked = None if name is None else Algorithm.parse(name)
            try:
                ran, config, note = choice(asked)
            except NotImplementedError as err:
                failure = failure or err
                self.refused.setdefault(i, str(err))
                continue
            ran_name = (ran or Algorithm()).name
            if asked is not None and not asked.is_standard and ran_name != asked.name:
                self.refused.setdefault(i, f"not timed: {ran_name} ran for {name} ({note})")
                replaced.append(config)
                continue
            chosen[i] = config
        distinct = list(dict.fromkeys(chosen.values())) or list(dict.fromkeys(replaced))
        if not distinct:
            raise failure
        if len(distinct) == 1:
            return distinct[0], None
        table = [distinct.index(chosen[i]) if i in chosen else 0
                 for i in range(len(self.algorithms))]
        if table == list(range(len(table))):
            return tuple(distinct), self.index
        return tuple(distinct), jnp.asarray(table, jnp.int32)[self.index]


def timed_steps(make_run, x, variables: Sequence[Any], training: bool,
                algorithms: Sequence[str | None], dtype: str) -> dict | None:
    """{algorithm: step}, all on ONE jitted program of `make_run()` called
    with an `AlgorithmSwitch`; None where the core cannot run `dtype` here.

    >>> timed_steps(lambda: None, None, [], False, [None], "int8") is None
    True
    """
    from rnnfuse.backends.jax import AheadOfTimeStep, _square_loss, cudnn_core

    if cudnn_core.core_reason(str(dtype)) is not None:
        return None
    run = make_run()
    names = tuple(algorithms)
    refused: dict[int, str] = {}

    def switched(inputs, training, index):
        return run(inputs, training, algorithm=AlgorithmSwitch(index, names, refused))

    variables = list(variables)
    loss = _square_loss(variables, switched, training, jnp.mean)
    fn = jax.jit(jax.value_and_grad(loss) if training else loss)
    values = [v.value for v in variables]
    program = AheadOfTimeStep(fn, (values, x, jnp.asarray(0, jnp.int32)), training)
    return {name: SwitchedStep(program, refused, i, name, (values, x, jnp.asarray(i, jnp.int32)))
            for i, name in enumerate(names)}


class SwitchedStep:
    """One candidate's step on the shared `AheadOfTimeStep`: NotImplementedError
    where the trace refused it, or cuDNN did in its first call (awaited)."""

    def __init__(self, program, refused: dict, position: int, name: str | None, args: tuple):
        self._program, self._refused, self._position = program, refused, position
        self._name, self._args, self._checked = name, args, False

    def trace(self) -> None:
        self._program.trace()
        why = self._refused.get(self._position)
        if why is not None:
            raise NotImplementedError(why)

    def compile(self) -> None:
        self.trace()
        self._program.compile()

    def __call__(self):
        if self._checked:
            return self._program(*self._args)
        self.trace()
        try:
            out = jax.block_until_ready(self._program(*self._args))
        except Exception as exc:  # noqa: BLE001 - only cuDNN refusing the algorithm is one
            why = _refusal_when_run(self._name, exc)
            if why is None:
                raise
            raise NotImplementedError(why) from exc
        self._checked = True
        return out


def _refusal_when_run(name: str | None, exc: Exception) -> str | None:
    """Why cuDNN refused algorithm `name` as the step ran, or None.

    >>> _refusal_when_run("persistent_static+tc", RuntimeError(
    ...     "UNIMPLEMENTED: rnnfuse cuDNN forward: no plan (core code 2)"))
    'not timed: cuDNN refused persistent_static+tc when the step ran (UNIMPLEMENTED: rnnfuse cuDNN forward: no plan (core code 2))'
    """
    lines = str(exc).strip().splitlines() or [""]
    line = next((ln.strip() for ln in lines if "rnnfuse cuDNN" in ln), "")
    if name is None or "UNIMPLEMENTED" not in line:
        return None
    return f"not timed: cuDNN refused {name} when the step ran ({line[:300]})"
