"""The rates the planner charges: each precision's effective GEMM rate, attention's and the SSD
kernels' rates, and each GPU's memory and bandwidths (docs/PLANNING.md states each)."""

from __future__ import annotations

from maxfp4.metrics import DEVICE_PEAKS_TFLOPS
from maxfp4.precision.catalog import SPECS

# The recipe each column of the plan stands for; bytes and peak classes come from its catalog
# entry. The memory functions also take any recipe's name (``mxfp8``).
PLAN_RECIPES = {"bf16": "bf16", "fp8": "fp8_delayed", "nvfp4": "nvfp4"}
PRECISIONS = tuple(PLAN_RECIPES)

# Effective GEMM rates in TFLOP/s on one H200 (docs/PERFORMANCE.md, one linear layer at
# M = K = N = 8192, forward + both gradients, quantization passes included): bf16 recipe and
# fp8_delayed as measured; emulated nvfp4 runs BF16 GEMMs, its quantization passes are charged
# as memory traffic (maxfp4.plan.cost.NVFP4_QUANT_BYTES).
MEASURED_H200_TFLOPS = {"bf16": 666.0, "fp8": 1079.0, "nvfp4": 666.0}
# Native FP4 GEMMs (B200) run at the datasheet FP4 peak times the efficiency FP8 reached on H200.
FP4_EFFICIENCY = MEASURED_H200_TFLOPS["fp8"] / DEVICE_PEAKS_TFLOPS["H200"]["fp8"]
# cuDNN flash attention, model FLOPs (causal half) per second on one H200: the Llama-3-8B BF16
# profile spends 283 ms on 1.06e14 attention FLOPs a GPU (docs/PERFORMANCE.md, "What bounds each").
ATTENTION_H200_TFLOPS = 370.0
# cuDNN's kernels on a context rank (maxfp4.parallel.context: each chunk's own keys, causal, with
# an S x S segment bias, and its document's earlier keys as a padded prefix, merged by their
# log-sum-exp), causal FLOPs per second on one H200, by head dim (a flash kernel does twice the
# FLOPs per byte of a tile at 128 as at 64). 64: fitted to dense-1p3b at context=2, 1 x 32,768
# tokens, full remat on two H200s (1,076.2 ms, 2026-11-28; the same batch as 2 x 16,384 tokens,
# 700.3 ms, comes out within 1%). 128: fitted to Llama-3-8B at 32,768 tokens over two H200s and
# 65,536 over four, BF16 and FP8 (3,241.6, 4,555.7 and 3,990.1 ms, 2026-11-29: -5%, +1%, +2%).
# Other head dims: linear between the two, held at the ends.
SPLIT_ATTENTION_H200_TFLOPS = {64: 275.0, 128: 385.0}
# XLA's attention (model.attention=xla) materialises the scores; it is bound by their traffic.
# Fitted to the one step measured with it alone, dense-1p3b fsdp=2 at 16 x 1024 with full remat
# on two H200s (303.1 ms, 2026-11-28): the rest of that step as the model charges it leaves
# ~147 ms for 3.3e12 attention FLOPs a GPU. Other GPUs scale it by HBM bandwidth.
XLA_ATTENTION_H200_TFLOPS = 22.5
# Mamba-2's SSD and convolution kernels, charged per SSD matmul FLOP: ~1.8 ms a layer at
# mamba2-1p3b's shapes on one H200 (the profile's kernel times), i.e. ~70 TFLOP/s; they are
# bound by memory traffic and occupancy, so other GPUs scale it by HBM bandwidth.
SSD_H200_TFLOPS = 70.0
GPUS: dict[str, dict[str, float]] = {
    # memory GB (1e9 bytes), HBM bandwidth TB/s, NVLink GB/s per GPU (one direction)
    "h100": {"memory_gb": 80.0, "hbm_tbs": 3.35, "nvlink_gbs": 450.0},
    "h200": {"memory_gb": 141.0, "hbm_tbs": 4.8, "nvlink_gbs": 450.0},
    "b200": {"memory_gb": 180.0, "hbm_tbs": 8.0, "nvlink_gbs": 900.0},
}

def gemm_tflops(gpu: str, precision: str) -> float:
    """Effective GEMM rate: the H200 measurement scaled by the datasheet peak of ``gpu``."""
    peaks = DEVICE_PEAKS_TFLOPS[gpu.upper()]
    peak_class = SPECS[PLAN_RECIPES[precision]].peak
    if peak_class == "fp4" and "fp4" in peaks:
        return peaks["fp4"] * FP4_EFFICIENCY
    peak_key = "bf16" if peak_class == "fp4" else peak_class  # emulated FP4 runs BF16 GEMMs
    return MEASURED_H200_TFLOPS[precision] * peaks[peak_key] / DEVICE_PEAKS_TFLOPS["H200"][peak_key]


def _bf16_peak_ratio(gpu: str) -> float:
    return DEVICE_PEAKS_TFLOPS[gpu.upper()]["bf16"] / DEVICE_PEAKS_TFLOPS["H200"]["bf16"]


def attention_tflops(gpu: str, xla: bool = False) -> float:
    if xla:
        return XLA_ATTENTION_H200_TFLOPS * GPUS[gpu]["hbm_tbs"] / GPUS["h200"]["hbm_tbs"]
    return ATTENTION_H200_TFLOPS * _bf16_peak_ratio(gpu)


def split_attention_tflops(gpu: str, head_dim: int) -> float:
    """cuDNN's kernels on a context rank (causal FLOPs) at ``head_dim``, scaled by the BF16 peak."""
    (lo, rate_lo), (hi, rate_hi) = sorted(SPLIT_ATTENTION_H200_TFLOPS.items())
    share = min(max((head_dim - lo) / (hi - lo), 0.0), 1.0)
    return (rate_lo + share * (rate_hi - rate_lo)) * _bf16_peak_ratio(gpu)


def ssd_tflops(gpu: str) -> float:
    return SSD_H200_TFLOPS * GPUS[gpu]["hbm_tbs"] / GPUS["h200"]["hbm_tbs"]


def datasheet_tflops(gpu: str, precision: str) -> float:
    peaks = DEVICE_PEAKS_TFLOPS[gpu.upper()]
    return peaks.get(SPECS[PLAN_RECIPES[precision]].peak, peaks["bf16"])
