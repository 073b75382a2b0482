"""``python -m maxfp4.export RUN_DIR --out DIR [--dtype bf16|fp32] [--step N] [--force]``.

Writes a checkpoint's parameters for use outside maxfp4 (inference, conversion, evaluation):

- ``model.safetensors``: one tensor per parameter, named by its dotted pytree path
  (``embed``, ``blocks.w_qkv``, ``lm_head``). Block parameters stay stacked with the layer axis
  first, as the model scans them: ``blocks.w_qkv[i]`` is block i (dense); for hybrid models
  ``mamba.*[i]``, ``attention.*[i]`` and ``mlp.*[i]`` are the i-th block of that kind in
  ``model.pattern``. The header metadata records the step, the model kind and the pattern.
- ``config.yaml``: the model section of the run's config (shapes and the meaning of each name).
- ``tokenizer.model``: the run's SentencePiece model, if it has one.

Only the parameters are read (no optimizer state), onto the host CPU. Bad input is one line on
stderr and exit code 2; nothing is written until the parameters have been read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any, Sequence

import numpy as np

from maxfp4.errors import UserError, exit_code_of

DTYPES = ("bf16", "fp32")


class ExportError(UserError):
    """An export that cannot be done: one line naming the path or value."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m maxfp4.export",
                                     description="Export a run's parameters as safetensors.")
    parser.add_argument("run_dir", help="run directory (<output_dir>/<run name>)")
    parser.add_argument("--out", required=True, help="directory to write (must not exist, unless --force)")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES, help="tensor dtype (default bf16)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--force", action="store_true", help="write into an existing --out directory")
    return parser.parse_args(argv)


def _model_config(saved: dict[str, Any], where: str):
    """The run's ModelConfig; only the model section matters for the parameter shapes."""
    from maxfp4.config import ConfigError, config_from_dict

    try:
        return config_from_dict({"model": saved.get("model", {})}).model
    except ConfigError as e:
        raise ExportError(f"{where}: the saved model config is not usable ({e})") from None


def flat_params(params: Any) -> dict[str, np.ndarray]:
    """``{"blocks.w_qkv": array, ...}`` in the order of the pytree."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(x) for path, x in leaves}


def export(run_dir: str, out: str, *, dtype: str = "bf16", step: int | None = None, force: bool = False) -> str:
    """Export ``run_dir``'s checkpoint (newest, or ``step``) into ``out``; returns the
    safetensors path."""
    import jax
    import ml_dtypes
    import yaml
    from safetensors.numpy import save_file

    from maxfp4.checkpoint import checkpoint_dir, finalized_steps, one_line_reason, read_params, saved_config
    from maxfp4.data.tokenizer import TOKENIZER_FILENAME
    from maxfp4.model import get_model

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if not os.path.isdir(run_dir):
        raise ExportError(f"run directory {run_dir}: not found; expected <output_dir>/<run name> of a run")
    if os.path.exists(out) and not force:
        raise ExportError(f"--out {out}: already exists; expected a new directory (or --force to write into it)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"--out {out}: is a file; expected a directory")
    checkpoints = checkpoint_dir(run_dir)
    steps = finalized_steps(run_dir)
    if not steps:
        raise ExportError(f"run directory {run_dir}: no complete checkpoint in {checkpoints}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"--step {step}: no such checkpoint in {checkpoints}; expected one of "
                          f"{', '.join(map(str, steps))}")
    saved = saved_config(run_dir, step=step)
    if saved is None:
        raise ExportError(f"run directory {run_dir}: no saved config (checkpoint config item or config.yaml)")
    model_cfg = _model_config(*saved)

    # Host memory, whatever accelerator the run used: the export needs no device.
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    shapes = jax.eval_shape(lambda k: get_model(model_cfg).init_params(model_cfg, k), jax.random.key(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), shapes)
    try:
        params = read_params(run_dir, step, abstract)
    except Exception as error:  # noqa: BLE001 - damaged or foreign checkpoint: say which
        raise ExportError(f"checkpoint {checkpoints}/{step}: unreadable ({one_line_reason(error)})") from None

    target = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32
    tensors = {name: np.ascontiguousarray(x.astype(target)) for name, x in flat_params(params).items()}
    metadata = {"format": "maxfp4", "step": str(step), "model.kind": model_cfg.kind,
                "model.pattern": model_cfg.pattern, "dtype": dtype,
                "layout": "block parameters stacked, layer axis first"}

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "model.safetensors")
    _write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    model_yaml = yaml.safe_dump({"model": _plain_model(model_cfg)}, sort_keys=False)
    _write_atomically(os.path.join(out, "config.yaml"), lambda tmp: _write_text(tmp, model_yaml))
    tokenizer = os.path.join(run_dir, TOKENIZER_FILENAME)
    if os.path.isfile(tokenizer):
        _write_atomically(os.path.join(out, TOKENIZER_FILENAME), lambda tmp: shutil.copyfile(tokenizer, tmp))
    return path


def _plain_model(model_cfg) -> dict:
    from maxfp4.config import Config

    return Config(model=model_cfg).to_dict()["model"]


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _write_atomically(path: str, write) -> None:
    # A crash mid-export leaves the previous file (with --force) or none, never half of one.
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def run() -> None:
        path = export(args.run_dir, args.out, dtype=args.dtype, step=args.step, force=args.force)
        print(f"wrote {path}", flush=True)

    return exit_code_of(run)


if __name__ == "__main__":
    sys.exit(main())
