"""On GPU: the FP8 recipes compile all three GEMMs of a linear layer to cuBLASLt FP8 GEMMs with
the fast operand layout (both operands contracting on their minor dimension, "TN")."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.compiler import compiler_options
from maxfp4.precision.recipes import fp8_current_dot, fp8_delayed_dot

pytestmark = pytest.mark.gpu


def _f8_gemm_configs(hlo: str) -> list[dict]:
    configs = []
    for line in hlo.splitlines():
        if "__cublas$lt$matmul$f8" in line and "custom-call(" in line:
            m = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', line)
            configs.append(json.loads(m.group(1)) if m else {})
    return configs


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current"])
def test_all_three_gemms_are_cublaslt_fp8_tn(recipe):
    fn = fp8_delayed_dot if recipe == "fp8_delayed" else fp8_current_dot
    x = jax.random.normal(jax.random.key(0), (4, 512, 1024), jnp.bfloat16)
    w = 0.02 * jax.random.normal(jax.random.key(1), (1024, 2048), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (4, 512, 2048), jnp.bfloat16)
    scales = jnp.asarray([50.0, 5000.0, 1000.0], jnp.float32)

    def layer(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, (), scales, None), x, w)
        return (y,) + vjp(dy)[:2]

    # Compiled with the trainer's options (maxfp4.compiler): Triton GEMM fusions would take one GEMM.
    jitted = jax.jit(layer, compiler_options=compiler_options("gpu"))
    hlo = jitted.lower(x, w, dy).compile().as_text()
    configs = _f8_gemm_configs(hlo)
    assert len(configs) == 3, f"expected 3 FP8 GEMMs, found {len(configs)}"
    for c in configs:
        assert c.get("lhs_contracting_dimensions") == ["1"], c
        assert c.get("rhs_contracting_dimensions") == ["1"], c
    # And the numbers are right: compare with the same recipe's GEMMs run on the CPU.
    gpu = [np.asarray(a, np.float32) for a in jitted(x, w, dy)]
    cpu_dev = jax.devices("cpu")[0]
    cpu = [np.asarray(a, np.float32) for a in jax.jit(layer)(*(jax.device_put(a, cpu_dev) for a in (x, w, dy)))]
    for g, c in zip(gpu, cpu):
        assert np.linalg.norm(g - c) <= 1e-2 * np.linalg.norm(c)
