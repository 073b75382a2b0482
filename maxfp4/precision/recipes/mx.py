"""OCP Microscaling recipes: ``mxfp8`` and ``mxfp4``.

Every operand of every GEMM in blocks of 32 along that GEMM's contraction dimension with an E8M0
power-of-two scale, round to nearest even, no state. Emulated as BF16 GEMMs of exactly
dequantized operands (:func:`mx_gemm_tn`): they compute what the format computes (up to
summation order) at BF16 GEMM speed on Hopper and CPU; Blackwell has native MX GEMMs.

Every linear layer makes three GEMMs; dimension letters M tokens, K input, N output features:

=======  =====================  ==========================  ============================
GEMM     formula                operand A (blocked along)   operand B (blocked along)
=======  =====================  ==========================  ============================
fprop    ``Y  = X W``           X[M,K]    (K)               W[K,N]    (K)
dgrad    ``dX = dY W^T``        dY[M,N]   (N)               W[K,N]    (N)
wgrad    ``dW = X^T dY``        X^T[K,M]  (M)               dY^T[N,M] (M)
=======  =====================  ==========================  ============================

Every operand is blocked along the contraction dimension of the GEMM it enters, so the block
sizes constrain M, K and N (see each recipe). M is checked only when the call is differentiated
(the forward pass alone never blocks along M).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxfp4.precision import catalog
from maxfp4.precision import formats as F
from maxfp4.precision.recipes import COMPUTE_DTYPE, GEMM_IN, TN, Recipe, check_multiple, dtype_token, flat, unflat

_MX_ELEMENT = {"mxfp8": F.FP8_E4M3, "mxfp4": F.FP4_E2M1}


def mx_gemm_tn(a_MK: jax.Array, b_NK: jax.Array, elem) -> jax.Array:
    """``a[M,K] @ b[N,K]^T`` with both operands MX-quantized (``elem`` elements) in blocks along
    K; FP32 result.

    The dequantized operands ``q * 2**e`` are exact in BF16, so a BF16 GEMM with FP32
    accumulation is the MX GEMM up to summation order:

    * E2M1 elements have at most 2 significant bits, E4M3 elements at most 4 (1 implicit + 3
      stored; subnormals fewer); BF16 holds 8. Multiplying by the power of two ``2**e`` adds no
      bits, so ``q * 2**e`` is exact in BF16 as long as it stays inside BF16's (= FP32's) normal
      exponent range.
    * Overflow is impossible: ``e = floor(log2(block_amax)) - emax_elem`` with ``block_amax`` a
      finite FP32, so ``|q| * 2**e <= max_elem * 2**(floor(log2(amax)) - emax_elem)``, which is
      ``1.75 * 2**floor(log2(amax)) < 2**128`` for E4M3 (448 = 1.75 * 2**8) and ``1.5 * ...``
      for E2M1 (6 = 1.5 * 2**2).
    * Underflow needs a tiny block: the smallest nonzero element is ``2**-9`` (E4M3 subnormal)
      or ``0.5`` (E2M1) times ``2**e``, i.e. at least ``2**(floor(log2(amax)) - 17)`` for MXFP8;
      that is a normal BF16 unless ``block_amax < 2**-109`` (~1.5e-33), far below any activation,
      weight or BF16 gradient a model produces. Below it the smallest elements would be flushed
      to zero (or rounded as BF16 subnormals), an absolute error under ``2**-126`` -- the same
      thing XLA on CPU does to FP32 subnormals anyway.
    """
    a = F.qdq_mx(a_MK.astype(jnp.float32), elem).astype(COMPUTE_DTYPE)
    b = F.qdq_mx(b_NK.astype(jnp.float32), elem).astype(COMPUTE_DTYPE)
    return jax.lax.dot_general(a, b, TN, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mx(x, w, name):
    return _mx_forward(x, w, name)  # undifferentiated: no residuals, no constraint on M


def _mx_forward(x, w, name):
    elem = _MX_ELEMENT[name]
    y = mx_gemm_tn(flat(x), w.T, elem).astype(COMPUTE_DTYPE)  # X and W blocked along K
    return unflat(y, x.shape[:-1])


def _mx_fwd(x, w, name):
    m = flat(x).shape[0]
    check_multiple(name, "the token count M (wgrad contracts over it)", m, F.MX_BLOCK, x.shape)
    # MX blocks are 1D, so W blocked along K (fprop) and along N (dgrad) are different
    # quantizations: keep W itself (FP32 master weights) and quantize it again in the backward.
    return _mx_forward(x, w, name), (checkpoint_name(flat(x), GEMM_IN), w, dtype_token(x.dtype))


def _mx_bwd(name, res, dy):
    x_MK, w, x_token = res
    elem = _MX_ELEMENT[name]
    dy_MN = flat(dy).astype(jnp.float32)
    # dgrad: dY[M,N] blocked along N times W[K,N] blocked along N.
    dx = mx_gemm_tn(dy_MN, w, elem).astype(COMPUTE_DTYPE)
    # wgrad: X^T[K,M] and dY^T[N,M], both blocked along M (tokens).
    dw = mx_gemm_tn(x_MK.T, dy_MN.T, elem)  # FP32
    return unflat(dx, dy.shape[:-1]).astype(x_token.dtype), dw


_mx.defvjp(_mx_fwd, _mx_bwd)


def _mx_dot(name, x, w):
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"{name}: expected x[..., K] and w[K, N], got {x.shape} and {w.shape}")
    check_multiple(name, "the contraction dimension K", w.shape[0], F.MX_BLOCK, w.shape)
    check_multiple(name, "the output dimension N (dgrad contracts over it)", w.shape[1], F.MX_BLOCK,
                    w.shape)
    return _mx(x, w, name)


def mxfp8_dot(x, w, options=(), scales=None, key=None):
    """OCP MXFP8 training (E4M3 elements for X, W and dY alike, as in the OCP MX training recipe):
    every operand of every GEMM in blocks of 32 along that GEMM's contraction dimension with an
    E8M0 power-of-two scale, round to nearest even. K, N and (when differentiated) M must be
    multiples of 32. Emulated as a BF16 GEMM of exactly dequantized operands (see
    :func:`mx_gemm_tn`); Blackwell has a native MXFP8 GEMM, Hopper and stock XLA do not."""
    del options, scales, key
    return _mx_dot("mxfp8", x, w)


def mxfp4_dot(x, w, options=(), scales=None, key=None):
    """OCP MXFP4 training: as :func:`mxfp8_dot` with E2M1 elements (no Hadamard transform, no
    stochastic rounding: the plain format, for comparison with ``nvfp4``)."""
    del options, scales, key
    return _mx_dot("mxfp4", x, w)


MXFP8 = Recipe(catalog.MXFP8, mxfp8_dot)
MXFP4 = Recipe(catalog.MXFP4, mxfp4_dot)
