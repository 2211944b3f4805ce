"""Every tensor the project creates for a training step or an evaluation lives on the model's device.

Without a GPU, the ``meta`` device plays it (``tests/scripts/device_placement_check.py``): a tensor left on the
CPU fails there as it would on CUDA (an op mixing devices, a CPU tensor all-reduced, megatron's optimizer given
parameters that were never moved). Every method, bf16 and fp32."""

from tests.helpers import run

RUNS = [
    ["method=none"],
    ["method=none", "train.precision=bf16"],
    ["method=dmc", "method.target_cr=2"],
    ["method=dmc", "method.accumulation=window", "method.variant=c", "train.precision=bf16"],
    ["method=dmc", "method.variant=hardc", "method.rope_order=pre", "method.cr_loss=released"],
    ["method=dmc", "method.zero_out_steps=2"],
    ["method=fixed_pooling", "method.pool=2"],
    ["method=less", "method.budget=16", "train.precision=bf16"],
]


def test_every_method_keeps_its_tensors_on_the_model_device():
    args = [arg for overrides in RUNS for arg in ["--", *overrides]][1:]
    out = run(["tests/scripts/device_placement_check.py", *args]).stdout
    assert [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("ok ")] == \
        [" ".join(overrides) for overrides in RUNS]
