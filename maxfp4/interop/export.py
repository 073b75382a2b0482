"""``python -m maxfp4.export RUN_DIR [--out DIR] [--format hf|native] [--dtype bf16|fp32] [--step N]
[--shard-size 5GB] [--force]``.

Writes a checkpoint's parameters for use outside maxfp4.

``--format hf`` (the default): a Hugging Face model directory that ``transformers`` loads with
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``:
dense models as ``LlamaForCausalLM``, hybrid models as ``NemotronHForCausalLM`` (names and
layouts: :mod:`maxfp4.interop.hf`; its E layers carry the routers' aux-loss-free bias from the
train state, in FP32), attention + MoE as ``MixtralForCausalLM`` (which has no router bias: a
nonzero one is dropped, saying so in one line on stderr); ``config.json`` (with the run, checkpoint and step under
``maxfp4``), safetensors (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json`` above ``--shard-size``), and the tokenizer files
(:mod:`maxfp4.data.tokenizer_hf`). A model the architecture cannot hold is refused in one line
naming the feature.

``--format native``: ``model.safetensors`` with maxfp4's own names (dotted pytree paths, block
parameters stacked with the layer axis first), ``config.yaml`` (the model section) and the
run's ``tokenizer.model``.

Only the parameters (and the routers' bias) are read, no optimizer state, onto the host CPU. Bad input is one line on
stderr and exit code 2; nothing is written until the parameters have been read, and each file
is written under a temporary name, made readable by all (0644) and renamed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from typing import Any, Sequence

import numpy as np

from maxfp4.config import saved_model_config
from maxfp4.errors import UserError, exit_code_of
from maxfp4.files import atomic_path, write_text_atomic

DTYPES = ("bf16", "fp32")
FORMATS = ("hf", "native")
SAFETENSORS_DTYPES = {"bf16": "BF16", "fp32": "F32"}
TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
FILE_MODE = 0o644


class ExportError(UserError):
    """An export that cannot be done: one line naming the path or value."""


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes (decimal units as Hugging Face's)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 5GB, 500MB or 1000000")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(float(match.group(1)) * scale)
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive size")
    return size


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m maxfp4.export",
                                     description="Export a run's parameters (Hugging Face or maxfp4 layout).")
    parser.add_argument("run_dir", help="run directory (<output_dir>/<run name>)")
    parser.add_argument("--out", help="directory to write (must not exist, unless --force; default: beside the run, "
                                      "<run dir>-step<N>-<format>)")
    parser.add_argument("--format", default="hf", choices=FORMATS,
                        help="hf: a directory transformers loads (default); native: maxfp4's names and layout")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES, help="tensor dtype (default bf16)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--shard-size", type=parse_size, default=parse_size("5GB"),
                        help="hf: largest safetensors file before sharding (default 5GB)")
    parser.add_argument("--force", action="store_true", help="write into an existing --out directory")
    return parser.parse_args(argv)


def flat_params(params: Any) -> dict[str, np.ndarray]:
    """``{"blocks.w_qkv": array, ...}`` in the order of the pytree."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(x) for path, x in leaves}


def export(run_dir: str, out: str | None = None, *, fmt: str = "hf", dtype: str = "bf16", step: int | None = None,
           force: bool = False, shard_size: int = 5 * 10**9) -> str:
    """Export ``run_dir``'s checkpoint (newest, or ``step``) into ``out``; returns the path of
    the written config (hf) or safetensors file (native). ``out`` None: ``<run dir>-step<N>-<fmt>``."""
    import jax

    from maxfp4.checkpoint import checkpoint_dir, finalized_steps, one_line_reason, read_params, saved_config
    from maxfp4.model import abstract_params

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    if not os.path.isdir(run_dir):
        raise ExportError(f"run directory {run_dir}: not found; expected <output_dir>/<run name> of a run")
    checkpoints = checkpoint_dir(run_dir)
    steps = finalized_steps(run_dir)
    if not steps:
        raise ExportError(f"run directory {run_dir}: no complete checkpoint in {checkpoints}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ExportError(f"--step {step}: no such checkpoint in {checkpoints}; expected one of "
                          f"{', '.join(map(str, steps))}")
    out = out or f"{os.path.normpath(run_dir)}-step{step}-{fmt}"
    if os.path.exists(out) and not force:
        raise ExportError(f"--out {out}: already exists; expected a new directory (or --force to write into it)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"--out {out}: is a file; expected a directory")
    saved = saved_config(run_dir, step=step)
    if saved is None:
        raise ExportError(f"run directory {run_dir}: no saved config (checkpoint config item or config.yaml)")
    model_cfg = saved_model_config(saved[0].get("model", {}), saved[1])
    if fmt == "hf":
        from maxfp4.interop.hf import check_maps
        check_maps(model_cfg)  # before reading anything
        tokenizer = _run_tokenizer(saved[0], run_dir)

    # Host memory, whatever accelerator the run used: the export needs no device.
    abstract = abstract_params(model_cfg, jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0]))
    try:
        params = read_params(run_dir, step, abstract)
        bias_LX = _router_bias(run_dir, step, model_cfg) if fmt == "hf" else None
    except Exception as error:  # noqa: BLE001 - damaged or foreign checkpoint: say which
        raise ExportError(f"checkpoint {checkpoints}/{step}: unreadable ({one_line_reason(error)})") from None

    os.makedirs(out, exist_ok=True)
    if fmt == "native":
        return _export_native(run_dir, out, model_cfg, params, step, dtype)
    seq_len = int((saved[0].get("data") or {}).get("seq_len") or 0) or 2048
    # The model section and seq_len too, so maxfp4's own tools (python -m maxfp4.sample) read the export.
    # Names, not this machine's paths: the export is copied to other machines and shared.
    provenance = {"run": os.path.basename(os.path.normpath(run_dir)),
                  "checkpoint": os.path.relpath(os.path.join(checkpoints, str(step)), run_dir),
                  "step": step, "dtype": dtype, "model": _plain_model(model_cfg), "seq_len": seq_len}
    return _export_hf(out, model_cfg, params, abstract, tokenizer, dtype=dtype, shard_size=shard_size,
                      max_positions=seq_len, provenance=provenance, bias_LX=bias_LX)


# ----------------------------------------------------------------------------- hf

def _run_tokenizer(saved: dict, run_dir: str):
    """The tokenizer the run trained on (data.tokenizer, the one trained into the run directory,
    or prepared data's), or None (synthetic data has none)."""
    from maxfp4.data.tokenizer import TOKENIZER_FILENAME, Tokenizer

    data = saved.get("data") or {}
    candidates = [data.get("tokenizer") or "", os.path.join(run_dir, TOKENIZER_FILENAME)]
    if data.get("source") == "array_record":
        candidates += [os.path.join(p, TOKENIZER_FILENAME) for p in data.get("paths") or []]
    for path in candidates:
        if path and os.path.isfile(path):
            return Tokenizer(path)
    return None


def _router_bias(run_dir: str, step: int, model_cfg) -> np.ndarray | None:
    """The checkpoint's routers' bias f32[L, X] (None without E blocks); for Mixtral, which
    cannot hold it, one line on stderr when it is nonzero."""
    import jax

    from maxfp4.interop.hf import MIXTRAL, architecture
    from maxfp4.interop.sample import checkpoint_router_bias

    if "E" not in model_cfg.pattern:
        return None
    bias_LX = np.asarray(checkpoint_router_bias(run_dir, step, model_cfg, jax.local_devices(backend="cpu")[0]))
    if architecture(model_cfg) == MIXTRAL and np.any(bias_LX):
        # Dropped rather than refused: the bias only breaks near-ties in the choice of experts
        # (the router and experts export whole), and the default model.moe.bias_update_rate > 0
        # would otherwise leave no attention + MoE model exportable to transformers.
        print(f"warning: MixtralForCausalLM has no router bias: the aux-loss-free bias (max |bias| "
              f"{np.max(np.abs(bias_LX)):.3g}) is dropped, so transformers picks experts by the router's scores "
              f"alone (--format native keeps the parameters; python -m maxfp4.sample RUN uses the bias)",
              file=sys.stderr)
    return bias_LX


def _export_hf(out: str, model_cfg, params, shapes, tokenizer, *, dtype: str, shard_size: int, max_positions: int,
               provenance: dict, bias_LX: np.ndarray | None = None) -> str:
    """``bias_LX``: the routers' bias f32[L, X] of the train state (None: a model without E
    blocks, or an export of the parameters alone)."""
    import itertools

    from maxfp4.data.tokenizer_hf import write_hf_tokenizer
    from maxfp4.interop.hf import (CONFIG_FILE, INDEX_FILE, SINGLE_FILE, check_covers, hf_config, hf_tensor_shapes,
                                   hf_tensors)
    from maxfp4.interop.hf_router_bias import hf_router_bias

    check_covers(model_cfg, params)
    bias = hf_router_bias(model_cfg, bias_LX) if bias_LX is not None else []
    named_shapes = hf_tensor_shapes(model_cfg, shapes) + [(name, b.shape) for name, b in bias]
    in_f32 = frozenset(name for name, _ in bias)  # FP32 whatever --dtype (maxfp4.interop.hf_router_bias.ROUTER_BIAS)
    nbytes = {name: int(np.prod(shape)) * (4 if dtype == "fp32" or name in in_f32 else 2)
              for name, shape in named_shapes}
    files = plan_shards(list(nbytes.items()), shard_size)
    total = sum(nbytes.values())
    shape_of = dict(named_shapes)
    metadata = {"format": "pt", "maxfp4.step": str(provenance["step"])}  # transformers requires format=pt
    tensors = itertools.chain(hf_tensors(model_cfg, params), bias)
    names = [SINGLE_FILE] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for file_name, members in zip(names, files):
        _write_atomically(os.path.join(out, file_name),
                          lambda tmp, m=members: write_safetensors(tmp, [(n, shape_of[n]) for n in m], tensors,
                                                                   SAFETENSORS_DTYPES[dtype], metadata, in_f32))
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, members in zip(names, files) for n in members}}
        _write_text_file(os.path.join(out, INDEX_FILE), json.dumps(index, indent=2) + "\n")
    ids = (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) if tokenizer else (-1, -1, -1)
    config = hf_config(model_cfg, max_positions=max_positions, dtype=TORCH_DTYPES[dtype], bos_id=ids[0],
                       eos_id=ids[1], pad_id=ids[2], provenance=provenance)
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, out, _write_text_file, max_length=max_positions)
    else:
        print("warning: the run has no tokenizer (synthetic data?); no tokenizer files written", file=sys.stderr)
    path = os.path.join(out, CONFIG_FILE)
    _write_text_file(path, json.dumps(config, indent=2) + "\n")  # last: a complete config means a complete export
    return path


def plan_shards(sizes: list[tuple[str, int]], shard_size: int) -> list[list[str]]:
    """Tensor names per file, in order: a file is closed before the tensor that would take it past
    ``shard_size`` (a single larger tensor gets a file of its own)."""
    files: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if files[-1] and used + size > shard_size:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def write_safetensors(path: str, layout: list[tuple[str, tuple[int, ...]]], tensors, dtype: str,
                      metadata: dict[str, str], in_f32: frozenset[str] = frozenset()) -> None:
    """Write a safetensors file whose tensors are ``layout`` (name, shape), taking the arrays
    one at a time from the iterator ``tensors`` (which yields them in this order); those named in
    ``in_f32`` are F32 whatever ``dtype``. The header is known from the shapes, so no file is ever
    held in memory; BF16 is written as its raw bytes (round to nearest even), so the writer needs
    no BF16 support from any library."""
    dtype_of = {name: "F32" if name in in_f32 else dtype for name, _ in layout}
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape in layout:
        size = int(np.prod(shape)) * (2 if dtype_of[name] == "BF16" else 4)
        header[name] = {"dtype": dtype_of[name], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little"))
        fh.write(text)
        for name, shape in layout:
            got_name, array = next(tensors)
            if got_name != name or tuple(array.shape) != tuple(shape):
                raise AssertionError(f"{got_name} {array.shape} written where {name} {shape} was planned")
            fh.write(_raw_bytes(np.asarray(array, np.float32), dtype_of[name]))


def _raw_bytes(a_f32: np.ndarray, dtype: str) -> bytes:
    a = np.ascontiguousarray(a_f32, dtype="<f4")
    if dtype == "F32":
        return a.tobytes()
    import ml_dtypes

    return np.ascontiguousarray(a.astype(ml_dtypes.bfloat16)).view("<u2").tobytes()


# ----------------------------------------------------------------------------- native

def _export_native(run_dir: str, out: str, model_cfg, params, step: int, dtype: str) -> str:
    import ml_dtypes
    import yaml
    from safetensors.numpy import save_file

    from maxfp4.data.tokenizer import TOKENIZER_FILENAME

    target = ml_dtypes.bfloat16 if dtype == "bf16" else np.float32
    tensors = {name: np.ascontiguousarray(x.astype(target)) for name, x in flat_params(params).items()}
    metadata = {"format": "maxfp4", "step": str(step), "model.kind": model_cfg.kind,
                "model.pattern": model_cfg.pattern, "dtype": dtype,
                "layout": "block parameters stacked, layer axis first"}
    path = os.path.join(out, "model.safetensors")
    _write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    model_yaml = yaml.safe_dump({"model": _plain_model(model_cfg)}, sort_keys=False)
    _write_text_file(os.path.join(out, "config.yaml"), model_yaml)
    tokenizer = os.path.join(run_dir, TOKENIZER_FILENAME)
    if os.path.isfile(tokenizer):
        _write_atomically(os.path.join(out, TOKENIZER_FILENAME), lambda tmp: shutil.copyfile(tokenizer, tmp))
    return path


def _plain_model(model_cfg) -> dict:
    from maxfp4.config import Config

    return Config(model=model_cfg).to_dict()["model"]


def _write_text_file(path: str, text: str) -> None:
    write_text_atomic(path, text, file_mode=FILE_MODE)  # shared files, as _write_atomically says


def _write_atomically(path: str, write) -> None:
    # A crash mid-export leaves the previous file (with --force) or none, never half of one.
    # Readable by all: the files are meant to be shared (some writers create them 0600).
    with atomic_path(path, file_mode=FILE_MODE) as tmp:
        write(tmp)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def run() -> None:
        path = export(args.run_dir, args.out, fmt=args.format, dtype=args.dtype, step=args.step,
                      force=args.force, shard_size=args.shard_size)
        print(f"wrote {path}", flush=True)

    return exit_code_of(run)


if __name__ == "__main__":
    sys.exit(main())
