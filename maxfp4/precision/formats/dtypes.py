"""Element types, their largest values, block sizes and the float32 limits the formats use."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


FP8_E4M3 = jnp.float8_e4m3fn
FP8_E5M2 = jnp.float8_e5m2
FP4_E2M1 = jnp.float4_e2m1fn
E8M0 = jnp.float8_e8m0fnu

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0

NVFP4_BLOCK = 16
MX_BLOCK = 32

F32_MAX = float(np.finfo(np.float32).max)
# The largest global encode scale whose reciprocal, S_dec, is a normal float32 (module docstring).
NVFP4_S_ENC_MAX = 2.0**126
# S_dec below this: 1 / (s * S_dec) is formed from S_dec * 2^64, so s * S_dec is never subnormal.
DEC_SHIFT_BELOW = 2.0**-64
DEC_SHIFT = 2.0**64
