import time, jax, jax.numpy as jnp, numpy as np
bf16, f32, e4, e5 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2
M = K = N = 8192
ka, kb = jax.random.split(jax.random.key(0))
a = jax.random.normal(ka, (M, K), f32).astype(e4)
b = jax.random.normal(kb, (N, K), f32).astype(e4)
b5 = jax.random.normal(kb, (N, K), f32).astype(e5)
sa = jnp.float32(0.5); sb = jnp.float32(0.25)
TN = (((1,), (1,)), ((), ()))
NN = (((1,), (0,)), ((), ()))
def v_bf16scale(a, b, sa, sb):
    return jax.lax.dot_general(a.astype(bf16) * sa.astype(bf16), b.astype(bf16) * sb.astype(bf16), TN, preferred_element_type=f32).astype(bf16)
def v_outscale(a, b, sa, sb):
    return (jax.lax.dot_general(a.astype(bf16), b.astype(bf16), TN, preferred_element_type=f32) * (sa * sb)).astype(bf16)
def v_outscale_bf16out(a, b, sa, sb):
    return jax.lax.dot_general(a.astype(bf16), b.astype(bf16), TN, preferred_element_type=bf16) * (sa*sb).astype(bf16)
def v_f32scale(a, b, sa, sb):
    return jax.lax.dot_general(a.astype(f32) * sa, b.astype(f32) * sb, TN, preferred_element_type=f32).astype(bf16)
def v_barrier_bf16scale(a, b, sa, sb):
    a, b = jax.lax.optimization_barrier((a, b))
    return v_bf16scale(a, b, sa, sb)
def v_e5(a, b, sa, sb):
    return v_bf16scale(a, b5, sa, sb)
def v_nn_bf16scale(a, b, sa, sb):
    return jax.lax.dot_general(a.astype(bf16) * sa.astype(bf16), b.astype(bf16) * sb.astype(bf16), NN, preferred_element_type=f32).astype(bf16)
def v_bf16(a, b, sa, sb):
    return jax.lax.dot_general(a.astype(bf16), b.astype(bf16), TN, preferred_element_type=f32).astype(bf16)
for name, f in list(globals().items()):
    if not name.startswith("v_"): continue
    jf = jax.jit(f)
    hlo = jf.lower(a, b, sa, sb).compile().as_text()
    f8 = hlo.count("__cublas$lt$matmul$f8")
    out = jf(a, b, sa, sb); out.block_until_ready()
    ts = []
    for _ in range(10):
        t = time.perf_counter(); jf(a, b, sa, sb).block_until_ready(); ts.append(time.perf_counter() - t)
    print(f"{name:24s} f8_gemms={f8} {2*M*N*K/np.median(ts)/1e12:8.0f} TFLOP/s")
