"""Model FLOPs, device peaks, and the metrics sinks (JSONL, TensorBoard, progress line).

FLOPs per token (docs/METRICS.md): 6 x matmul parameters (every linear layer, LM head included,
the embedding lookup excluded) + causal attention 6 x L_attn x T x d_attn (12 x ... for the
score and value products forward and backward, halved because causal attention skips half)
+ the SSD matmul FLOPs of Mamba-2 blocks.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import jax

from maxfp4.config import ModelConfig
from maxfp4.precision.catalog import SPECS
from maxfp4.precision.policy import PrecisionPolicy

# Dense datasheet peaks in TFLOP/s per device, by peak class (maxfp4.precision.catalog.PEAK_CLASSES).
DEVICE_PEAKS_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0, "fp4": 9000.0},
}


def block_linear_params(cfg: ModelConfig) -> list[dict[str, int]]:
    """Matmul parameters of each block's linear layers, by layer class (from the same layer
    shapes the model is built with)."""
    from maxfp4.model import get_model, linear_shapes
    params = {c: k * n for c, (k, n) in linear_shapes(cfg).items()}
    if cfg.kind != "hybrid":
        return [{c: params[c] for c in get_model(cfg).block_layer_classes}] * cfg.n_layers
    from maxfp4.model.hybrid import TYPE_CLASSES, TYPES
    return [{c: params[c] for c in TYPE_CLASSES[TYPES[ch]]} for ch in cfg.pattern]


def block_matmul_params(cfg: ModelConfig) -> int:
    """Matmul parameters of all blocks' linear layers (the LM head not included)."""
    return sum(sum(b.values()) for b in block_linear_params(cfg))


def matmul_params(cfg: ModelConfig) -> int:
    return block_matmul_params(cfg) + cfg.d_model * cfg.vocab_size


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    blocks = cfg.pattern.count("*") if cfg.kind == "hybrid" else cfg.n_layers
    return 6.0 * blocks * seq_len * cfg.n_heads * cfg.resolved_head_dim


def ssd_flops_per_token(cfg: ModelConfig) -> float:
    """Matmul FLOPs of the chunked SSD, forward and backward (3x forward), per Mamba-2 block:
    causal C.B^T within a chunk (G*Q*N), its product with x (H*Q*P), chunk states and
    state-to-output (2 x 2*N*P per head); the inter-chunk recurrence is negligible."""
    if cfg.kind != "hybrid":
        return 0.0
    from maxfp4.model.mamba import dims
    md = dims(cfg)
    q = cfg.mamba.chunk_size
    forward = md["G"] * q * md["N"] + md["H"] * (q * md["P"] + 4 * md["N"] * md["P"])
    return 3.0 * forward * cfg.pattern.count("M")


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len) + ssd_flops_per_token(cfg)


def device_peaks(device: jax.Device) -> dict[str, float] | None:
    """Peaks for a known accelerator; None on CPU and unknown devices (no MFU printed)."""
    kind = getattr(device, "device_kind", "")
    for name, peaks in DEVICE_PEAKS_TFLOPS.items():
        if name in kind:
            return peaks
    return None


def policy_peak_tflops(cfg: ModelConfig, seq_len: int, policy: PrecisionPolicy,
                       peaks: dict[str, float]) -> float:
    """The peak a perfect run of this policy could reach: each GEMM's FLOPs charged at its
    precision's peak (a precision the device lacks, such as FP4 on Hopper, at BF16); attention
    and SSD products at BF16."""
    def peak_for(recipe: str) -> float:
        return peaks.get(SPECS[recipe].peak, peaks["bf16"])

    unquantized = attention_flops_per_token(cfg, seq_len) + ssd_flops_per_token(cfg)
    total, seconds = unquantized, unquantized / peaks["bf16"]
    for layer, classes in enumerate(block_linear_params(cfg)):
        for cls, params in classes.items():
            total += 6.0 * params
            seconds += 6.0 * params / peak_for(policy.recipe_for(cls, layer))
    head = 6.0 * cfg.d_model * cfg.vocab_size
    return (total + head) / (seconds + head / peak_for(policy.lm_head))


def format_duration(seconds: float) -> str:
    """``H:MM:SS``, with days in front past 24 hours (``3d 04:05:06``): plain arithmetic, as
    ``time.gmtime`` wraps at a day and raises past year 9999 (a run of 10**12 steps)."""
    if not math.isfinite(seconds):
        return "unknown"
    total = max(int(seconds), 0)
    days, rest = divmod(total, 86400)
    text = f"{rest // 3600:02d}:{rest // 60 % 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


class MetricsLogger:
    """Writes metrics.jsonl and TensorBoard events (when ``enabled``), and a progress line."""

    def __init__(self, run_dir: str, *, total_steps: int, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self._jsonl = None
        self._tb = None
        if enabled:
            self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
            from tensorboardX import SummaryWriter  # pure-Python event writer, no TensorFlow
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)) and v is not None:
                self._tb.add_scalar(k, v, record["step"])
        self._tb.flush()
        self.stream.write(self.progress_line(record) + "\n")
        self.stream.flush()

    def progress_line(self, r: dict[str, Any]) -> str:
        parts = [f"step {r['step']:>6d}/{self.total_steps}", f"loss {r['loss']:.4f}"]
        if "eval_loss" in r:
            parts.append(f"eval {r['eval_loss']:.4f}")
        if r.get("step_time_s") is None:
            parts.append("compiled and ran the first step")
            return " | ".join(parts)
        parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
        parts.append(f"{r['tflops_per_device']:.1f} TFLOP/s/dev")
        if r.get("mfu") is not None:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        eta = r.get("eta_s")
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
