"""Verdicts of whether a Mosaic GPU kernel lowers, kept beside JAX's compilation cache
(maxfp4.kernels.lowering_verdicts): a process stores the check's verdict, a later process with
the same cache directory reads it instead of lowering the kernel again, and the name of a
verdict changes with whatever the lowering depends on. Each process is a real Python process
with its own JAX cache directory, as a restarted run has."""

import json
import os
import subprocess
import sys

from maxfp4.kernels import lowering_verdicts

# The gated norm's forward at a small shape (lowers in ~1 s): the verdict, then the files stored.
CHECK = """
import json, os, sys, logging
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from maxfp4.kernels import gated_norm_mosaic as m, ssd_mosaic
sds = jax.ShapeDtypeStruct
u, zx, s = sds((1, 16, 1024), jnp.bfloat16), sds((1, 16, 1536), jnp.bfloat16), sds((1024,), jnp.float32)
act = jnp.dtype(jnp.bfloat16)
ok = ssd_mosaic.lowers(m._forward, u, zx, s, groups=1, eps=1e-5, out_dtype=act, store_dtype=act, fp8=False,
                       interpret=False)
print(json.dumps({"lowers": ok, "files": sorted(os.listdir(os.path.join(sys.argv[1], "maxfp4-mosaic-lowers")))}))
"""


def _check(cache_dir) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", CHECK, str(cache_dir)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_later_process_reads_the_stored_verdict_instead_of_lowering(tmp_path):
    first, _ = _check(tmp_path)
    assert first["lowers"] is True and len(first["files"]) == 1
    stored = tmp_path / lowering_verdicts.FOLDER / first["files"][0]
    assert json.loads(stored.read_text())["lowers"] is True
    # A verdict planted in the file is what the next process answers (it did not lower the
    # kernel, which would have said True), with the stored reason in its warning line.
    stored.write_text(json.dumps({"lowers": False, "why": "planted verdict"}))
    second, log = _check(tmp_path)
    assert second["lowers"] is False and second["files"] == first["files"]
    assert "does not lower" in log and "planted verdict" in log
    # An unreadable verdict counts as none: the kernel is lowered and the verdict stored again.
    stored.write_text("{not json")
    third, _ = _check(tmp_path)
    assert third["lowers"] is True and json.loads(stored.read_text())["lowers"] is True


def test_a_verdict_is_named_by_the_kernel_its_operands_and_the_versions():
    key = ("_forward", (((1, 16, 1024), "bfloat16"),), (("groups", 1),))
    name = lowering_verdicts.verdict_name("maxfp4.kernels.gated_norm_mosaic._forward", key)
    assert name == lowering_verdicts.verdict_name("maxfp4.kernels.gated_norm_mosaic._forward", key)
    other_shape = ("_forward", (((1, 32, 1024), "bfloat16"),), (("groups", 1),))
    other_static = ("_forward", (((1, 16, 1024), "bfloat16"),), (("groups", 2),))
    assert len({name, lowering_verdicts.verdict_name("maxfp4.kernels.gated_norm_mosaic._forward", other_shape),
                lowering_verdicts.verdict_name("maxfp4.kernels.gated_norm_mosaic._forward", other_static),
                lowering_verdicts.verdict_name("maxfp4.kernels.gated_norm_mosaic._backward", key)}) == 4


def test_nothing_is_stored_without_a_cache_directory(tmp_path):
    """A process without a JAX cache directory (the suite's own has one) stores and reads nothing."""
    code = ("from maxfp4.kernels import lowering_verdicts as v; assert v.directory() is None; "
            "v.remember('x.json', True); assert v.recalled('x.json') is None; print('none')")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(env, PYTHONPATH=os.getcwd()))
    assert done.returncode == 0 and done.stdout.strip() == "none", done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
