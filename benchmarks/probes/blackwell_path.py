"""Does the NVFP4 Blackwell path (``jax.nn.scaled_matmul`` on FP4 elements with E4M3 block
scales) lower, compile and agree with the emulated path on this GPU? Prints one line per stage.

    python benchmarks/probes/blackwell_path.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.precision import formats as F
from maxfp4.precision.recipes import block_scaled_fp4_available, nvfp4_gemm_tn


def main() -> None:
    device = jax.devices()[0]
    print(f"device {device.device_kind}, compute capability {getattr(device, 'compute_capability', '?')}, "
          f"block_scaled_fp4_available={block_scaled_fp4_available()}, jax {jax.__version__}")
    a = jax.random.normal(jax.random.key(0), (256, 512), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (384, 512), jnp.float32)
    qa, qb = F.quantize_nvfp4(a, two_d=False), F.quantize_nvfp4(b, two_d=True)
    emulated = np.asarray(jax.jit(lambda: nvfp4_gemm_tn(qa, qb, block_scaled=False))(), np.float32)
    fn = jax.jit(lambda: nvfp4_gemm_tn(qa, qb, block_scaled=True))
    try:
        lowered = fn.lower()
        print("lowering: ok;", "custom calls:", sorted({l.split('custom_call_target="')[1].split('"')[0]
                                                      for l in lowered.as_text().splitlines() if "custom_call_target" in l}))
    except Exception as e:  # noqa: BLE001 - a probe reports whatever stops it
        print(f"lowering: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return
    try:
        compiled = lowered.compile()
        targets = sorted({l.split('custom_call_target="')[1].split('"')[0]
                          for l in compiled.as_text().splitlines() if "custom_call_target" in l})
        print("compile: ok; custom calls after optimization:", targets)
    except Exception as e:  # noqa: BLE001
        print(f"compile: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return
    y = np.asarray(compiled(), np.float32)
    err = np.abs(y - emulated).max() / np.abs(emulated).max()
    print(f"run: ok; max |block-scaled - emulated| / max |emulated| = {err:.2e} (BF16 output rounding ~4e-3)")


if __name__ == "__main__":
    main()
