"""maxfp4's own forward pass as an lm-evaluation-harness model (``lm_eval.api.model.TemplateLM``).

lm-eval hands the model three kinds of requests; this module answers them with the parameter
pytree and the precision policy it is given (the run's, or BF16):

- ``loglikelihood`` (context, continuation): tokenized as lm-eval's ``TemplateLM`` does for the
  Hugging Face backend (the whole text encoded once and split after the context's tokens, trailing
  spaces moved to the continuation), every text starting with BOS as every training document does;
- ``loglikelihood_rolling`` (a text): lm-eval's disjoint rolling windows of ``max_length`` tokens,
  BOS in front of the first;
- ``generate_until`` (context, kwargs): greedy (or sampled, with ``do_sample``) decoding through
  :mod:`maxfp4.interop.decode` (its cached step; BF16 GEMMs whatever the policy), cut at the
  first ``until`` string.

Scoring runs rows of ``rows`` sequences padded to one of a few fixed lengths
(:func:`bucket_lengths`), so a whole evaluation compiles the forward pass once or twice; padded
positions get segment id 0 and are never scored.

Dimension letters: B rows, T positions, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from maxfp4.config import ModelConfig
from maxfp4.model import get_model
from maxfp4.parallel.mesh import traced_in_mesh
from maxfp4.precision import PrecisionPolicy

TokenPair = tuple[list[int], list[int]]  # (context ids, continuation ids)
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until tasks that name none


def bucket_lengths(max_length: int) -> tuple[int, ...]:
    """The padded row lengths: a quarter of the context for the short requests most tasks make
    (a multiple-choice question is tens of tokens), and the whole context for the rest."""
    short = max_length // 4
    return (short, max_length) if short >= 16 else (max_length,)


def make_scorer(model_cfg: ModelConfig, policy: PrecisionPolicy, mesh=None) -> Callable:
    """``score(params, scales, inputs_BT, targets_BT, valid_BT, scored_BT) -> (logprob_B, greedy_B)``:
    the summed log-probability (FP32) of the scored targets of each row, and whether each scored
    target is the model's argmax. Jitted; traced under ``mesh`` when the parameters are sharded."""
    forward = get_model(model_cfg).forward

    def score(params, scales, inputs_BT, targets_BT, valid_BT, scored_BT):
        positions_BT = jnp.broadcast_to(jnp.arange(inputs_BT.shape[1], dtype=jnp.int32), inputs_BT.shape)
        logits_BTV = forward(params, inputs_BT, positions_BT, valid_BT.astype(jnp.int32), cfg=model_cfg,
                             policy=policy, scales=scales, key=jax.random.key(0)).astype(jnp.float32)
        logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
        picked_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
        greedy_BT = jnp.argmax(logits_BTV, axis=-1) == targets_BT
        logprob_B = jnp.sum(jnp.where(scored_BT, picked_BT, 0.0), axis=1)
        return logprob_B, jnp.all(greedy_BT | ~scored_BT, axis=1)

    if mesh is None:
        return jax.jit(score)
    # Replicated results: every process reads the scores (each runs lm-eval over all requests).
    return jax.jit(traced_in_mesh(score, mesh), out_shardings=NamedSharding(mesh, PartitionSpec()))


class MaxFP4LM(TemplateLM):
    """lm-eval's view of a maxfp4 model. ``tokenizer``: :class:`maxfp4.data.tokenizer.Tokenizer`;
    ``max_length``: the longest context (``data.seq_len``); ``rows``: sequences per forward pass
    (a multiple of the devices the batch is split over); ``mesh``: the parameters' mesh, if any."""

    def __init__(self, params: Any, model_cfg: ModelConfig, tokenizer, *, policy: PrecisionPolicy,
                 scales: dict | None = None, max_length: int, rows: int = 8, mesh=None):
        super().__init__()
        if tokenizer.bos_id < 0:
            raise ValueError(f"tokenizer {tokenizer}: no BOS token; maxfp4 models read every text after BOS")
        self.params, self.model_cfg, self.maxfp4_tokenizer = params, model_cfg, tokenizer
        self.scales, self.rows, self.mesh = scales or {}, rows, mesh
        self._max_length = max_length
        self._score = make_scorer(model_cfg, policy, mesh)
        self._decode_step = None  # compiled on the first generation request

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        eos = self.maxfp4_tokenizer.eos_id
        return eos if eos >= 0 else self.maxfp4_tokenizer.bos_id

    @property
    def prefix_token_id(self) -> int:
        # An empty context and a rolling window's start condition on BOS, as training documents do.
        return self.maxfp4_tokenizer.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.maxfp4_tokenizer.encode(string)
        return ids if add_special_tokens is False else [self.prefix_token_id] + ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.maxfp4_tokenizer.decode(list(ids))

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        return self.score_pairs([(context, continuation) for _, context, continuation in requests])

    def score_pairs(self, pairs: Sequence[TokenPair]) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, whether greedy decoding gives it) of each
        pair. The input is left-truncated to ``max_length`` tokens, as lm-eval's HF backend does."""
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        rows = []
        for i, (context, continuation) in enumerate(pairs):
            if not continuation:
                raise ValueError("an empty continuation: lm-eval sends at least one token to score")
            tokens = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((i, tokens, min(len(continuation), len(tokens) - 1)))
        # Longest first, so each group of rows shares the smallest bucket its longest row fits.
        rows.sort(key=lambda r: -len(r[1]))
        buckets = bucket_lengths(self.max_length)
        for start in range(0, len(rows), self.rows):
            group = rows[start:start + self.rows]
            length = next(b for b in buckets if b >= len(group[0][1]) - 1)
            inputs, targets, valid, scored = (np.zeros((self.rows, length), dtype) for dtype in
                                              (np.int32, np.int32, bool, bool))
            for r, (_, tokens, n_scored) in enumerate(group):
                n = len(tokens) - 1
                inputs[r, :n], targets[r, :n], valid[r, :n] = tokens[:-1], tokens[1:], True
                scored[r, n - n_scored:n] = True
            arrays = [self._place(a) for a in (inputs, targets, valid, scored)]
            logprob_B, greedy_B = jax.device_get(self._score(self.params, self.scales, *arrays))
            for r, (i, _, _) in enumerate(group):
                out[i] = (float(logprob_B[r]), bool(greedy_B[r]))
        return out  # type: ignore[return-value]

    def _place(self, a_BT: np.ndarray):
        """A host array as the scorer takes it: on the mesh, the same whole array from every
        process (replicated; jit then splits the rows over the batch axes)."""
        if self.mesh is None:
            return a_BT
        return jax.make_array_from_process_local_data(NamedSharding(self.mesh, PartitionSpec()), a_BT, a_BT.shape)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for window in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text, add_special_tokens=False), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self.score_pairs(windows)):
            totals[index] += logprob
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from maxfp4.interop.decode import generate, make_step

        if self._decode_step is None:
            self._decode_step = make_step(self.model_cfg)
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
            # Keep the newest tokens of a long context, leaving room for the generation.
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new):]
            new = generate(self.params, ids, cfg=self.model_cfg, max_tokens=max(1, min(max_new, self.max_length - len(ids))),
                           length=self.max_length, temperature=temperature, top_p=float(kwargs.get("top_p", 1.0)),
                           stop_id=self.eot_token_id, step_fn=self._decode_step)
            if new and new[-1] == self.eot_token_id:
                new = new[:-1]
            text = self.tok_decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            out.append(text)
        return out
