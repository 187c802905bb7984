"""Every entry point of one model runs the plan decided for its group, mode
and bucket (torch on the CPU): after `fit` decides (online, on its own
steps), a user's own training loop -- a direct call and `backward()` --
and `train_on_batch` run the committed plan, looked up, not timed again.
The device is faked and each race step's seconds come from a fixed median.
"""

from __future__ import annotations

import numpy as np
import torch

import rnnfuse
from builders import fused_layers, race_online, stack_model
from rnnfuse.plan import Plan
from rnnfuse.tuning import first_batch
from torch_checks import FAKE_GPU_ENV

MEDIANS = {"per-layer": 3.0, "fused": 1.0, "split 1+1+1": 2.0}


def test_after_fit_decides_a_custom_loop_runs_the_decided_plan_untimed(fake_gpu_online, plans_run):
    model = stack_model("gru", 3, steps=6)
    fast = rnnfuse.optimize(model, cache=False)
    ran = []
    state = race_online(fast, MEDIANS, ran)
    state.environment = dict(FAKE_GPU_ENV)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, *model.input_shape[1:])).astype("float32")
    y = np.asarray(model.predict(x, verbose=0))
    fast.compile(optimizer="sgd", loss="mse")
    fast.fit(x, y, batch_size=4, epochs=4, verbose=0)
    (layer,) = fused_layers(fast)
    (record,) = first_batch.decisions(fast)
    assert record["chosen"] == "fused" and layer.plan == Plan((3,))
    raced = list(ran)
    plans_run.clear()
    # A user's own step: a direct call, a loss, backward() and an update.
    optimizer = torch.optim.SGD([w.value for w in fast.trainable_weights], lr=0.01)
    for start in (0, 4):
        optimizer.zero_grad()
        loss = ((fast(x[start:start + 4], training=True) - torch.as_tensor(y[start:start + 4])) ** 2).mean()
        loss.backward()
        optimizer.step()
    fast.train_on_batch(x[:4], y[:4])
    assert ran == raced and not fake_gpu_online, "fit's decision was timed again"
    assert len(first_batch.decisions(fast)) == 1
    assert plans_run == ["fused"] * 3
