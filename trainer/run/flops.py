"""Model FLOPs of a training step and the device peaks they are compared with (MFU).

MFU (PaLM, Chowdhery et al. 2022, app. B) = model FLOPs per second / peak FLOP/s:
only the FLOPs the model needs on the real (non-pad) tokens count, never padding,
rematerialisation or the optimizer. A training step is 3x its forward (one
forward, two backward matmuls) and a matmul of (n, k) x (k, m) is 2 n k m FLOPs.
Per sentence pair with s source and t target tokens (d = d_model, f = FFN width,
V = vocabulary, L_e / L_d encoder / decoder layers), forward multiply-adds:

    encoder layers   s L_e (4 d^2 + 2 d f)          q, k, v, o projections and the FFN
                     + L_e 2 s^2 d                  attention scores and values
    decoder layers   t L_d (6 d^2 + 2 d f)          self q, k, v, o, cross q, o, FFN
                     + s L_d 2 d^2                  cross-attention k, v (on the source)
                     + L_d 2 (t^2 + t s) d          self (counted full, as is usual) and cross
    head             t V d

This equals the formula of the reference GPU probes (`6 (enc b s + dec b t + V d b t)
+ 12 d b (L_e s^2 + L_d (t^2 + t s))`) when s = t.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from models.config import ModelConfig

# Dense peak FLOP/s per device: (bf16 tensor cores, fp32 without tensor cores), by name.
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 67e12),
    "H100 PCIe": (756e12, 51e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (70e12, 31.2e12),
    "L4": (121e12, 30.3e12),
}


def step_flops(
    config: ModelConfig, src_lengths: Sequence[int] | np.ndarray, tgt_lengths: Sequence[int] | np.ndarray
) -> float:
    """Model FLOPs of one training step (forward + backward) over these sentence pairs."""
    s = np.asarray(src_lengths, dtype=np.float64)
    t = np.asarray(tgt_lengths, dtype=np.float64)
    d, le, ld = config.d_model, config.encoder_layers, config.decoder_layers
    fe, fd, v = config.encoder_ffn_dim, config.decoder_ffn_dim, config.vocab_size
    macs = (
        s.sum() * le * (4 * d * d + 2 * d * fe)
        + le * 2 * d * (s * s).sum()
        + t.sum() * ld * (6 * d * d + 2 * d * fd)
        + s.sum() * ld * 2 * d * d
        + ld * 2 * d * (t * t + t * s).sum()
        + t.sum() * v * d
    )
    return float(6 * macs)


def peak_flops(device: torch.device, bf16: bool, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: `override_tflops` if set, else the table by CUDA device name.

    Returns None on CPUs and on GPUs the table does not know (then no MFU is logged).
    """
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (bf16_peak, fp32_peak) in PEAK_FLOPS.items():
        if key in name:
            return bf16_peak if bf16 else fp32_peak
    return None
