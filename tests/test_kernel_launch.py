"""Pallas launches traced and lowered once per distinct launch (maxfp4.kernels.launch.pallas_call):
repeated launches of one kernel share one jitted call and lower to one function, launches that
differ in anything the kernel sees do not, and results are those of ``pl.pallas_call``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from maxfp4.kernels import launch


def _scale_kernel(x_ref, o_ref, *, factor):
    o_ref[...] = x_ref[...] * factor


def _launch(factor, rows=8, offset=0):
    # A fresh partial and fresh index-map lambdas every time, as the kernel modules build them.
    return launch.pallas_call(
        functools.partial(_scale_kernel, factor=factor), grid=(1,),
        in_specs=[pl.BlockSpec((rows,), lambda i: (i + offset,))],
        out_specs=pl.BlockSpec((rows,), lambda i: (i + offset,)),
        out_shape=jax.ShapeDtypeStruct((rows,), jnp.float32), interpret=True)


def test_equal_launches_share_one_call_and_differing_ones_do_not():
    assert _launch(2.0) is _launch(2.0)
    assert _launch(2.0) is not _launch(3.0)          # a kernel argument
    assert _launch(2.0) is not _launch(2.0, rows=4)  # a block shape and the output shape
    assert _launch(2.0) is not _launch(2.0, offset=1)  # a value an index map captures
    x = jnp.arange(8, dtype=jnp.float32)
    np.testing.assert_array_equal(_launch(3.0)(x), 3.0 * np.arange(8, dtype=np.float32))


class _Settings:
    """A value a kernel may read that has no hash (as a mutable settings object would)."""
    __hash__ = None

    def __init__(self, offset):
        self.offset = offset


def test_a_launch_capturing_an_unhashable_value_is_called_uncached_with_the_same_result():
    settings = _Settings(5.0)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + settings.offset

    kept = launch._jitted.cache_info().currsize
    f = launch.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)
    assert launch._jitted.cache_info().currsize == kept
    np.testing.assert_array_equal(f(jnp.ones(8, jnp.float32)), np.full(8, 6.0, np.float32))


def test_repeated_launches_in_a_program_lower_to_one_function():
    def program(x):
        for _ in range(6):  # as six unrolled blocks would
            x = _launch(2.0)(x)
        return x

    text = jax.jit(program).lower(jnp.ones(8, jnp.float32)).as_text()
    # One private function holds the launch; the program calls it six times.
    assert text.count("func.func private @wrapped(") == 1, text
    assert text.count("call @wrapped(") == 6, text
    np.testing.assert_array_equal(jax.jit(program)(jnp.ones(8, jnp.float32)), np.full(8, 64.0, np.float32))


def test_without_the_triton_backend_auto_takes_xla_and_forced_kernels_are_refused(monkeypatch):
    """jax 0.11 deprecates Pallas's Triton backend. On a GPU whose jax lacks it, every ``auto``
    kernel choice falls to the XLA form and a forced ``model.mamba.kernels=pallas`` is one line."""
    from maxfp4.config import ConfigError, load_config
    from maxfp4.kernels import support
    from maxfp4.model import fp8_mlp, mamba

    shapes = ["model.mamba.head_dim=16", "model.mamba.d_state=16", "model.mamba.chunk_size=16"]
    cfg = load_config("configs/hybrid-tiny.yaml", shapes)

    def choices():
        return (mamba.use_ssd_kernel(cfg.model), mamba.use_conv_kernel(cfg.model, 32, 192),
                mamba.use_norm_kernel(cfg.model, 32, 64), fp8_mlp._kernel_applies(4096, 14336, 1, "swiglu"))

    assert launch.triton_available()  # the jax installed here has the backend
    monkeypatch.setattr(launch, "on_gpu", lambda: True)
    monkeypatch.setattr(launch, "triton_available", lambda: True)
    assert choices() == (True, True, True, True)  # a GPU with the backend: every kernel
    monkeypatch.setattr(launch, "triton_available", lambda: False)
    assert choices() == (False, False, False, False)  # without it: XLA everywhere

    forced = load_config("configs/hybrid-tiny.yaml", [*shapes, "model.mamba.kernels=pallas"])
    monkeypatch.setattr(support, "on_gpu", lambda: True)
    monkeypatch.setattr(support, "triton_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^model.mamba.kernels='pallas': expected xla or auto: this jax has no "
                                          r"Pallas Triton backend"):
        support.check_mamba_kernels(forced.model, forced.data.seq_len)
