"""Every module of the package imports first in a fresh interpreter (an import cycle shows only
when a module of the cycle is the first one imported), and the config, the JAX-free part of
the precision package and the pipeline's schedule and stage rules (which the planner reads)
import without JAX."""

import os
import pathlib
import subprocess
import sys

import maxfp4

ROOT = pathlib.Path(maxfp4.__file__).parent
JAX_FREE = ("maxfp4.config", "maxfp4.precision.catalog", "maxfp4.precision.policy",
            "maxfp4.parallel.pipeline_schedule", "maxfp4.parallel.pipeline_stages", "maxfp4.plan.stages")

# One interpreter for all modules, keeping JAX loaded between them (starting it is most of the
# cost): before each module every maxfp4 module is dropped, so each is imported first.
FIRST_IMPORTS = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "maxfp4" or m.startswith("maxfp4.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _modules() -> list[str]:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT.parent, timeout=300)


def test_every_module_imports_first():
    modules = _modules()
    assert len(modules) > 50 and "maxfp4.kernels.rht" in modules and "maxfp4.precision.recipes.mx" in modules
    proc = _run(FIRST_IMPORTS, *modules)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_config_and_policy_import_without_jax():
    for name in JAX_FREE:
        proc = _run(f"import sys, {name}; print('jax' in sys.modules, 'maxfp4.precision.registry' in sys.modules)")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split() == ["False", "False"], name
    # Validating a config (its precision section included) needs no JAX either.
    proc = _run("import sys; from maxfp4.config import load_config; "
                "load_config('configs/precision/nvfp4.yaml', ['precision.recipes={nvfp4: {rht: false}}']); "
                "print('jax' in sys.modules)")
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stderr[-2000:]
