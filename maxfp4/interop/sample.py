"""``python -m maxfp4.sample RUN [--prompt TEXT] [--max-tokens N] [--temperature T] [--top-p P] [--seed S]``:
what a trained model writes after a prompt.

RUN is a run directory (its newest complete checkpoint is read, parameters only) or a directory
written by ``python -m maxfp4.export``. The prompt is tokenized with the run's tokenizer and
starts with BOS, as every training document does. Generation keeps a cache (attention keys and
values, Mamba-2 convolution windows and SSM states) and runs one compiled step per token, the
prompt included (:mod:`maxfp4.interop.decode`); every linear layer runs in BF16 whatever the run
trained with. The text goes to stdout, one line about what was sampled to stderr. Bad input is
one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from maxfp4.config import saved_model_config
from maxfp4.errors import UserError, exit_code_of

EXPORT_WEIGHTS = "model.safetensors"  # --format native
HF_CONFIG = "config.json"  # --format hf, the default


class SampleError(UserError):
    """A run, export or option that sampling cannot use: one line naming it."""


@dataclass(frozen=True)
class LoadedModel:
    cfg: Any  # ModelConfig
    params: Any
    tokenizer: Any  # maxfp4.data.tokenizer.Tokenizer
    context: int | None  # data.seq_len the model trained on; None for a native export (not recorded there)
    source: str  # "<dir> step N", for the header line
    trained_with: str  # the run's precision.default, or "" when unknown


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m maxfp4.sample",
                                     description="Continue a prompt with a trained model.")
    parser.add_argument("run", help="run directory (<output_dir>/<run name>) or an export directory")
    parser.add_argument("--prompt", default="The", help='text to continue (default "The")')
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    # Lower temperatures sent the quickstart's small model into runs of one space token; 1.0 with
    # the tail cut at 0.9 shows what it learned.
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="softmax temperature; 0 = greedy, always the most likely token (default 1.0)")
    parser.add_argument("--top-p", type=float, default=0.9,
                        help="sample from the most likely tokens holding this probability (default 0.9; 1 = all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    return parser.parse_args(argv)


def check_options(args: argparse.Namespace) -> None:
    if not args.prompt:
        raise SampleError('--prompt is empty; expected some text to continue, e.g. --prompt "The"')
    if args.max_tokens < 1:
        raise SampleError(f"--max-tokens {args.max_tokens}: expected an integer >= 1")
    if not args.temperature >= 0:
        raise SampleError(f"--temperature {args.temperature}: expected a number >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise SampleError(f"--top-p {args.top_p}: expected a number in (0, 1]")


def _abstract_params(model_cfg, device):
    import jax

    from maxfp4.model import abstract_params

    return abstract_params(model_cfg, jax.sharding.SingleDeviceSharding(device))


def _tokenizer(path: str, vocab_size: int, what: str):
    from maxfp4.data.tokenizer import load_checked

    if not os.path.isfile(path):
        raise SampleError(f"{what} {path}: not found; sampling needs the run's SentencePiece model "
                          f"(runs with data.source=synthetic have none)")
    return load_checked(path, vocab_size, what)


def checkpoint_router_bias(run_dir: str, step: int, model_cfg, device):
    """f32[blocks, experts] from a checkpoint's precision state (maxfp4.model.router_state)."""
    import jax
    import jax.numpy as jnp

    from maxfp4.checkpoint import read_state_part

    like = {"precision": {"router": {"bias": jax.ShapeDtypeStruct(
        (len(model_cfg.pattern), model_cfg.moe.experts), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))}}}
    return read_state_part(run_dir, step, like)["precision"]["router"]["bias"]


def load_run(run_dir: str, device) -> LoadedModel:
    """The newest complete checkpoint's parameters, the run's model config, data.seq_len and tokenizer."""
    from maxfp4.checkpoint import checkpoint_dir, finalized_steps, one_line_reason, read_params, saved_config
    from maxfp4.config import DataConfig
    from maxfp4.data.tokenizer import TOKENIZER_FILENAME

    steps = finalized_steps(run_dir)
    if not steps:
        raise SampleError(f"run directory {run_dir}: no complete checkpoint in {checkpoint_dir(run_dir)}; "
                          f"expected a run that has saved one (at its end, or every checkpoint.every steps)")
    saved = saved_config(run_dir, step=steps[-1])
    if saved is None:
        raise SampleError(f"run directory {run_dir}: no saved config (checkpoint config item or config.yaml)")
    raw, where = saved
    model_cfg = saved_model_config(raw.get("model", {}), where)
    data = raw.get("data", {})
    tokenizer_path = data.get("tokenizer") or os.path.join(run_dir, TOKENIZER_FILENAME)
    tokenizer = _tokenizer(tokenizer_path, model_cfg.vocab_size, "tokenizer")
    try:
        params = read_params(run_dir, steps[-1], _abstract_params(model_cfg, device))
        if "E" in model_cfg.pattern:  # the routers' aux-loss-free bias rides along into decoding
            from maxfp4.model.router_state import BIAS
            params = {**params, BIAS: checkpoint_router_bias(run_dir, steps[-1], model_cfg, device)}
    except Exception as error:  # noqa: BLE001 - damaged or foreign checkpoint: say which
        raise SampleError(f"checkpoint {checkpoint_dir(run_dir)}/{steps[-1]}: unreadable "
                          f"({one_line_reason(error)})") from None
    return LoadedModel(model_cfg, params, tokenizer, int(data.get("seq_len", DataConfig().seq_len)),
                       f"{run_dir} step {steps[-1]}", str(raw.get("precision", {}).get("default", "")))


def load_export(export_dir: str, device) -> LoadedModel:
    """An export's parameters (any dtype, widened to FP32), its model config and tokenizer."""
    import jax
    import numpy as np
    import yaml
    from safetensors.numpy import load_file

    from maxfp4.checkpoint_layout import from_former_layout
    from maxfp4.data.tokenizer import TOKENIZER_FILENAME

    config_path = os.path.join(export_dir, "config.yaml")
    if not os.path.isfile(config_path):
        raise SampleError(f"export directory {export_dir}: no config.yaml; expected the output of maxfp4.export")
    with open(config_path, encoding="utf-8") as fh:
        model_cfg = saved_model_config((yaml.safe_load(fh) or {}).get("model", {}), config_path)
    tokenizer = _tokenizer(os.path.join(export_dir, TOKENIZER_FILENAME), model_cfg.vocab_size, "export tokenizer")
    weights = os.path.join(export_dir, EXPORT_WEIGHTS)
    try:
        tensors = load_file(weights)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file: say which
        raise SampleError(f"{weights}: unreadable ({type(error).__name__}: {error})") from None
    abstract = _abstract_params(model_cfg, device)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    arrays = []
    for path, spec in leaves:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if name in tensors:  # an export of an earlier layout (maxfp4.checkpoint_layout)
            tensors[name] = from_former_layout(tuple(name.split(".")), tensors[name], spec.shape, model_cfg)
        if name not in tensors or tensors[name].shape != spec.shape:
            found = tensors[name].shape if name in tensors else "missing"
            raise SampleError(f"{weights}: tensor {name} is {found}; expected shape {spec.shape} "
                              f"for the model in {config_path}")
        arrays.append(jax.device_put(np.asarray(tensors[name], np.float32), spec.sharding))
    return LoadedModel(model_cfg, jax.tree_util.tree_unflatten(treedef, arrays), tokenizer, None, export_dir, "")


def load_hf_export(export_dir: str, device) -> LoadedModel:
    """A Hugging Face export of maxfp4 (``python -m maxfp4.export``'s default): the model section
    it records in config.json, its tensors converted back (maxfp4.interop.hf), its tokenizer.json."""
    import json

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from maxfp4.interop.hf import ModelDir, read_params as read_hf_params
    from maxfp4.interop.hf_router_bias import read_router_bias as read_hf_router_bias

    config_path = os.path.join(export_dir, HF_CONFIG)
    try:
        with open(config_path, encoding="utf-8") as fh:
            recorded = json.load(fh).get("maxfp4") or {}
    except (OSError, ValueError) as error:
        raise SampleError(f"{config_path}: unreadable ({type(error).__name__}: {error})") from None
    if "model" not in recorded:
        raise SampleError(f"{config_path}: not written by maxfp4.export (no maxfp4.model section); "
                          f"expected an export of a maxfp4 run")
    model_cfg = saved_model_config(recorded["model"], config_path)
    tokenizer = _tokenizer(os.path.join(export_dir, "tokenizer.json"), model_cfg.vocab_size, "export tokenizer")
    abstract = _abstract_params(model_cfg, device)
    whole = NamedSharding(Mesh(np.array([device]), ("one",)), PartitionSpec())  # the reader places by mesh
    params = read_hf_params(model_cfg, export_dir, jax.tree.map(lambda _: whole, abstract), abstract)
    bias_LX = read_hf_router_bias(model_cfg, ModelDir(export_dir))
    if bias_LX is not None:  # NemotronH's E layers carry the run's router bias (Mixtral: zeros)
        from maxfp4.model.router_state import BIAS
        params = {**params, BIAS: jax.device_put(bias_LX, device)}
    return LoadedModel(model_cfg, params, tokenizer, recorded.get("seq_len"), export_dir, "")


def load_model(path: str) -> LoadedModel:
    import jax

    device = jax.devices()[0]  # one device holds the whole model: sampling is one row
    if os.path.isfile(os.path.join(path, HF_CONFIG)):
        return load_hf_export(path, device)
    if os.path.isfile(os.path.join(path, EXPORT_WEIGHTS)):
        return load_export(path, device)
    if not os.path.isdir(path):
        raise SampleError(f"{path}: not found; expected a run directory (<output_dir>/<run name>) or an export")
    return load_run(path, device)


def prompt_ids(model: LoadedModel, prompt: str) -> list[int]:
    """BOS then the prompt's tokens, as the data pipeline starts every document."""
    tok = model.tokenizer
    return ([tok.bos_id] if tok.bos_id >= 0 else []) + tok.encode(prompt)


def sample(args: argparse.Namespace, out=None, err=None) -> str:
    """The prompt and its continuation (also written to ``out``)."""
    from maxfp4.interop.decode import generate

    out, err = out or sys.stdout, err or sys.stderr
    check_options(args)
    model = load_model(args.run)
    ids = prompt_ids(model, args.prompt)
    context = model.context or len(ids) + args.max_tokens
    if len(ids) >= context:
        raise SampleError(f"--prompt is {len(ids)} tokens with BOS; expected at most {context - 1}, so that one "
                          f"can follow within data.seq_len={context}, the longest context the run trained on")
    trained = f"; trained with {model.trained_with}" if model.trained_with not in ("", "bf16") else ""
    err.write(f"sampling {model.source} with BF16 GEMMs{trained}: {len(ids)} prompt tokens, up to "
              f"{args.max_tokens} new, temperature {args.temperature:g}, top-p {args.top_p:g}, seed {args.seed}\n")
    err.flush()
    new = generate(model.params, ids, cfg=model.cfg, max_tokens=args.max_tokens, length=context,
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop_id=model.tokenizer.eos_id)
    text = model.tokenizer.decode(ids + new)
    out.write(text + "\n")
    out.flush()
    if len(new) < args.max_tokens and (not new or new[-1] != model.tokenizer.eos_id):
        err.write(f"stopped after {len(new)} tokens: the context is full (data.seq_len={context})\n")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_code_of(sample, args)


if __name__ == "__main__":
    sys.exit(main())
