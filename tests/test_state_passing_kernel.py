"""The SSD's state passing between chunks (``state_passing_kernel``, interpret mode on CPU)
against a NumPy float64 loop written from the recurrence, forward and gradients (float64, bound
1e-12 relative to the largest magnitude: a handful of multiply-adds per element).

Gradients of sum(entry * w), from the recurrence by hand (the kernel's are another derivation):
d end[z] = w[z + 1] + decay[z + 1] * d end[z + 1] (d end[K-1] = 0), d states[z] = d end[z],
d decay[z] = sum over (n, p) of d end[z] * end[z - 1].
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.kernels.ssd import _entry_states_unrolled
from maxfp4.kernels.state_passing import entry_states, state_passing_supported


def _numpy_reference(states, decay, w):
    b, k, g, n, r, p = states.shape
    d = decay[:, :, :, None, :, None]  # [B, K, G, 1, R, 1]
    end = np.zeros_like(states)
    entry = np.zeros_like(states)
    for z in range(k):
        prev = end[:, z - 1] if z else np.zeros_like(states[:, 0])
        entry[:, z] = prev
        end[:, z] = states[:, z] + d[:, z] * prev
    dend = np.zeros_like(states)
    for z in reversed(range(k - 1)):
        dend[:, z] = w[:, z + 1] + d[:, z + 1] * dend[:, z + 1]
    ddecay = np.sum(dend * entry, axis=(3, 5))
    return entry, dend, ddecay


def _rel(got, expected):
    expected = np.asarray(expected)
    return float(np.max(np.abs(np.asarray(got) - expected)) / np.max(np.abs(expected)))


@pytest.mark.parametrize("k", [1, 5, 8, 40])  # 5: padded to 8 inside; 40: to 64, 8 turns of the loop
def test_entry_states_match_numpy_loop(x64, k):
    b, g, n, r, p = 2, 2, 3, 4, 8
    rng = np.random.default_rng(k)
    states = rng.standard_normal((b, k, g, n, r, p))
    decay = rng.uniform(0.2, 1.0, (b, k, g, r))
    decay[0, k // 2] = 0.0  # a segment starts in that chunk: nothing crosses it
    w = rng.standard_normal((b, k, g, n, r, p))
    entry_ref, dstates_ref, ddecay_ref = _numpy_reference(states, decay, w)

    def loss(fn):
        return lambda s, d: jnp.sum(fn(s, d) * w)

    kernel = lambda s, d: entry_states(s, d, interpret=True)  # noqa: E731
    for fn in (kernel, _entry_states_unrolled):
        entry = jax.jit(fn)(states, decay)
        assert entry.shape == states.shape and entry.dtype == jnp.float64
        assert np.all(np.asarray(entry)[:, 0] == 0)  # nothing enters the first chunk
        if k == 1:
            continue
        assert _rel(entry, entry_ref) < 1e-12
        dstates, ddecay = jax.jit(jax.grad(loss(fn), argnums=(0, 1)))(states, decay)
        assert _rel(dstates, dstates_ref) < 1e-12
        assert _rel(ddecay, ddecay_ref) < 1e-12


def test_zero_decay_blocks_the_state():
    """A chunk with decay 0 hands on exactly its own state: nothing earlier reaches later chunks."""
    b, k, g, n, r, p = 1, 4, 1, 2, 2, 4
    rng = np.random.default_rng(0)
    states = rng.standard_normal((b, k, g, n, r, p)).astype(np.float32)
    decay = np.full((b, k, g, r), 0.9, np.float32)
    decay[:, 2] = 0.0
    entry = np.asarray(entry_states(jnp.asarray(states), jnp.asarray(decay), interpret=True))
    np.testing.assert_array_equal(entry[:, 3], states[:, 2])


def test_supported_shapes():
    assert state_passing_supported(64, 64) and state_passing_supported(1, 16)
    assert not state_passing_supported(3, 64) and not state_passing_supported(4, 24)


def _lowered_for_cuda(fn, *shapes) -> str:
    """``fn`` lowered for CUDA on this machine: Triton's lowering needs no GPU, only its compute
    capability (benchmarks/cuda_lowering.py gives an H100's where jax asks for it)."""
    spec = importlib.util.spec_from_file_location("cuda_lowering", "benchmarks/cuda_lowering.py")
    cuda_lowering = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_lowering)
    cuda_lowering.triton_targets_hopper()
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def test_the_triton_kernels_do_not_grow_with_the_chunk_count():
    """The kernels loop over the chunks: their program (and Triton's compile time) is the same at
    64 chunks (8k tokens a device at chunk 128) as at 256 (32k). Unrolled over K, it grew 4.4x."""
    from maxfp4.kernels.state_passing import entry_states_backward, entry_states_forward
    sizes = []
    for k in (64, 256):
        states = jax.ShapeDtypeStruct((1, k, 8, 128, 16, 64), jnp.float32)  # nemotron-h-8b's groups
        decay = jax.ShapeDtypeStruct((1, k, 8, 16), jnp.float32)
        entry = jax.ShapeDtypeStruct(states.shape, jnp.bfloat16)
        forward = _lowered_for_cuda(lambda s, d: entry_states_forward(s, d, jnp.bfloat16, False), states, decay)
        backward = _lowered_for_cuda(lambda d, e, g: entry_states_backward(d, e, g, jnp.bfloat16, False),
                                     decay, entry, entry)
        sizes.append((len(forward), len(backward)))
    (f64, b64), (f256, b256) = sizes
    assert abs(f256 - f64) < 0.01 * f64 and abs(b256 - b64) < 0.01 * b64, sizes
