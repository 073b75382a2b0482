"""On two GPUs (nvidia-h200-x2), the tensor axis's layouts with the GPU's kernels (cuDNN
attention, the Mamba-2 Pallas kernels, the Mosaic grouped GEMMs of an E block) and NCCL's
collectives: mesh.sequence_parallel against the same tensor split without it (the residual stream
split over tensor along the sequence must not change the math beyond the order of the sums over
tensor), and expert tensor parallelism against the tokens split. Each comparison runs in a
process of its own with XLA's excess precision off (tests/test_gpu_pipeline.py)."""

import pytest

from tests.test_gpu_pipeline import GPU_HYBRID, _in_own_process

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", ["bf16", "fp8_delayed"])
def test_sequence_parallel_with_the_gpu_kernels_gives_the_tensor_splits_loss_and_gradients(recipe):
    # Bounds: the CPU test's (tests/test_sequence_parallel.py: loss 1e-5, gradients 5e-3), four
    # times wider for FP8 delayed scaling, whose scales amplify a BF16 rounding moved by the sums'
    # order; amaxes to 1e-2 (one rounding of the values they are the largest of).
    overrides = GPU_HYBRID + [f"precision.default={recipe}", "mesh.fsdp=1"]
    diff = _in_own_process(overrides, ["mesh.tensor=2", "mesh.sequence_parallel=true"], ["mesh.tensor=2"])
    wide = 4 if recipe == "fp8_delayed" else 1
    assert diff["loss"] <= 1e-5 * wide, diff
    assert max(diff["grads"].values()) <= 5e-3 * wide, diff["grads"]
    assert diff["amaxes"] <= 1e-2, diff


def test_expert_tensor_parallelism_with_the_mosaic_grouped_gemms_gives_the_token_splits_loss_and_gradients():
    # Each expert's 256 hidden units halved over tensor: 128, which the Mosaic kernels still tile.
    # Against the default (the tensor group's tokens split, whole experts): the experts' sums run
    # in another order, so the CPU test's gradient bound (tests/test_moe.py: 3e-2) and a loss to 1e-4.
    overrides = GPU_HYBRID + ["precision.default=bf16", "mesh.fsdp=1", "mesh.tensor=2"]
    diff = _in_own_process(overrides, ["model.moe.expert_tensor_parallel=true"], [])
    assert diff["loss"] <= 1e-4, diff
    assert max(diff["grads"].values()) <= 3e-2, diff["grads"]
