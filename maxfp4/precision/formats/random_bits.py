"""Random bits for stochastic rounding, as Blackwell's conversion instructions take them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


SR_BITS = 8  # random bits per element in stochastic rounding (see round_e2m1)

_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = 0x1BD11BDA


def threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32, 20 rounds (Salmon et al., SC 2011), on uint32 arrays that broadcast: the
    hash behind ``jax.random`` (tests check the two agree bit for bit). Written out because the
    Pallas kernels of ``maxfp4.kernels.rht`` draw their random bits inside the kernel, where the hash's
    integer work runs while the kernel waits on memory, and Triton has no lowering for JAX's
    threefry primitive. The XLA path draws with ``jax.random.bits`` (:func:`random_words`):
    the same bits."""
    def rotl(v, r):
        return (v << jnp.uint32(r)) | (v >> jnp.uint32(32 - r))

    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(_THREEFRY_PARITY))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ rotl(x2, r)
        x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x1, x2


def random_word_key(key: jax.Array) -> jax.Array:
    """The uint32[2] threefry key of a PRNG key: a threefry key's own data, otherwise (another
    implementation's key) two words drawn from it."""
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    if data.shape != (2,) or data.dtype != jnp.uint32:
        data = jax.random.bits(key, (2,), jnp.uint32)
    return data


def random_words_at(word_key: jax.Array, index: jax.Array) -> jax.Array:
    """The uint32 word number ``index`` (uint32) of the stream of ``word_key``: threefry of the
    64-bit counter (0, index), its two halves xor-ed, as ``jax.random.bits`` forms word
    ``index`` of a uint32 draw."""
    b1, b2 = threefry2x32(word_key[0], word_key[1], jnp.zeros_like(index), index)
    return b1 ^ b2


def check_word_count(words_shape: tuple[int, ...]) -> None:
    """Word indices are uint32 counters (the kernels hash them as such): fewer than 2^32 words."""
    if int(np.prod(words_shape)) >= 2**32:
        raise ValueError(f"stochastic rounding: {words_shape} words exceed the 32-bit counter")


def random_words(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The uint32 words behind :func:`random_bytes` of ``shape``: ``shape[:-1] + (n // 4,)``,
    ``jax.random.bits`` of the threefry key ``random_word_key(key)`` (for a threefry key, the
    key itself), which is word ``i`` = ``random_words_at(random_word_key(key), i)`` of the
    flattened shape. ``jax.random`` draws them here because XLA fuses its draw into the
    quantizer that reads it; drawn with :func:`threefry2x32` directly, XLA wrote the words out
    in a pass of their own (70 us for a [16384, 5632] dY on an H100)."""
    *lead, n = shape
    words_shape = (*lead, n // 4)
    check_word_count(words_shape)
    threefry_key = jax.random.wrap_key_data(random_word_key(key), impl="threefry2x32")
    return jax.random.bits(threefry_key, words_shape, jnp.uint32)


def byte_of_word(words: jax.Array, byte: int | jax.Array) -> jax.Array:
    """Byte ``byte`` (0 is the low byte) of every uint32 word, as uint32."""
    return (words >> (jnp.uint32(SR_BITS) * jnp.uint32(byte))) & jnp.uint32(0xFF)


def random_bytes(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform 8-bit random numbers (as uint32) of ``shape``, the last axis divisible by 4:
    one 32-bit word is drawn per 4 consecutive elements of the last axis and element ``i`` takes
    byte ``i % 4`` of word ``i // 4`` (low byte first). A quarter of the words of one draw per
    element: the counter-based generator's hash is what stochastic rounding's fusion spends its
    time on (H100 profile, 2026-11-25)."""
    words = random_words(key, shape)[..., None]
    return byte_of_word(words, jnp.arange(4, dtype=jnp.uint32)).reshape(shape)
