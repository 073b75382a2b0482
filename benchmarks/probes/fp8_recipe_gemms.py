import jax, jax.numpy as jnp
from maxfp4.precision.recipes import fp8_delayed_dot, fp8_current_dot
def count(fn, xshape, const):
    x = jax.random.normal(jax.random.key(0), xshape, jnp.bfloat16)
    w = 0.02 * jax.random.normal(jax.random.key(1), (1024, 2048), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), xshape[:-1] + (2048,), jnp.bfloat16)
    s = jnp.asarray([50.0, 5000.0, 1000.0], jnp.float32)
    if const:
        def layer(x, w, dy, s):
            y, vjp = jax.vjp(lambda x, w: fn(x, w, (), jnp.asarray([50.0, 5000.0, 1000.0]), None), x, w)
            return (y,) + vjp(dy)[:2]
    else:
        def layer(x, w, dy, s):
            y, vjp = jax.vjp(lambda x, w: fn(x, w, (), s, None), x, w)
            return (y,) + vjp(dy)[:2]
    hlo = jax.jit(layer).lower(x, w, dy, s).compile().as_text()
    lines = [l for l in hlo.splitlines() if "custom-call(" in l and "cublas" in l]
    return [("f8" if "f8" in l else "bf16") + ":" + l.split("=")[1].split("{")[0].strip()[:40] for l in lines]
for fn in (fp8_delayed_dot, fp8_current_dot):
    for shape in ((2048, 1024), (4, 512, 1024)):
        for const in (False, True):
            print(fn.__name__, shape, "const" if const else "runtime", count(fn, shape, const), flush=True)
