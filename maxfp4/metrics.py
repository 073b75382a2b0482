"""Model FLOPs, device peaks, and the metrics sinks (JSONL, TensorBoard, progress line).

FLOPs per token (docs/METRICS.md): 6 x matmul parameters (every linear layer, LM head included,
the embedding lookup excluded) + causal attention 6 x L x T x d_attn (12 x L x T x d_attn for
the score and value products forward and backward, halved because causal attention skips half).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax

from maxfp4.config import ModelConfig
from maxfp4.precision import PrecisionPolicy
from maxfp4.precision.policy import BLOCK_CLASSES

# Dense datasheet peaks in TFLOP/s per device, by precision.
DEVICE_PEAKS_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0},
}
RECIPE_PRECISION = {"bf16": "bf16", "fp8_delayed": "fp8", "fp8_current": "fp8", "fp8_block": "fp8",
                    "mxfp8": "fp8", "nvfp4": "fp4", "mxfp4": "fp4"}


def matmul_params_by_class(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of one block's linear layers, by layer class (and the LM head)."""
    d, h, n, k, f = cfg.d_model, cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff
    return {
        "attn_qkv": d * (n + 2 * k) * h,
        "attn_out": n * h * d,
        "mlp_up": 2 * d * f,
        "mlp_down": f * d,
        "lm_head": d * cfg.vocab_size,
    }


def matmul_params(cfg: ModelConfig) -> int:
    per = matmul_params_by_class(cfg)
    return cfg.n_layers * sum(v for c, v in per.items() if c != "lm_head") + per["lm_head"]


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6.0 * cfg.n_layers * seq_len * cfg.n_heads * cfg.resolved_head_dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    return 6.0 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)


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
    precision's peak (a precision the device lacks, such as FP4 on Hopper, at BF16)."""
    per = matmul_params_by_class(cfg)

    def peak_for(recipe: str) -> float:
        return peaks.get(RECIPE_PRECISION.get(recipe, "bf16"), peaks["bf16"])

    seconds = attention_flops_per_token(cfg, seq_len) / peaks["bf16"]
    total = attention_flops_per_token(cfg, seq_len)
    for layer in range(cfg.n_layers):
        for cls in BLOCK_CLASSES:
            if cls in per:
                fl = 6.0 * per[cls]
                seconds += fl / peak_for(policy.recipe_for(cls, layer))
                total += fl
    fl = 6.0 * per["lm_head"]
    seconds += fl / peak_for(policy.lm_head)
    total += fl
    return total / seconds


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
            parts.append(f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
