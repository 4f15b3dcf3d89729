"""KDA's short convolution: a depthwise causal convolution of width W over the q | k | v projections, continuing
from a window of the previous W-1 inputs (HF `ShortConvolution`; the decode cache's `conv_state`).

    out, new_window = causal_conv(inputs [B, T, C], window [B, W-1, C], kernel [W, C], segment_ids=None)
    mixed = conv_silu_step(token [B, C], window [B, W-1, C], kernel [W, C])   # one decode token: silu(conv)

The packed decode kernel (pallas_decode.py) computes `conv_silu_step` itself when given the window and the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(inputs, window, kernel, segment_ids=None):
    """Depthwise causal convolution continuing from `window`.

    inputs: [B, T, C]; window: [B, W-1, C] (the previous W-1 inputs); kernel: [W, C]; segment_ids: [B, T] or None
    (a tap that reaches into another segment contributes nothing: packed documents do not see each other).
    Returns (outputs [B, T, C] float32, new window [B, W-1, C]).
    """
    width = kernel.shape[0]
    seq_len = inputs.shape[1]
    padded = jnp.concatenate([window.astype(inputs.dtype), inputs], axis=1)  # [B, W-1+T, C]
    kernel = kernel.astype(jnp.float32)
    if segment_ids is not None:
        padded_ids = jnp.concatenate([jnp.repeat(segment_ids[:, :1], width - 1, axis=1), segment_ids], axis=1)
    out = 0.0
    for tap in range(width):
        term = padded[:, tap:tap + seq_len].astype(jnp.float32) * kernel[tap]
        if segment_ids is not None:
            term = jnp.where((padded_ids[:, tap:tap + seq_len] == segment_ids)[..., None], term, 0.0)
        out = out + term
    return out, padded[:, seq_len:]


def check_conv_inputs(token, window, kernel) -> None:
    """Validates one decode token's convolution inputs: token [B, C], window [B, W-1, C], kernel [W, C]."""
    if window is None or kernel is None:
        raise ValueError("the short convolution needs both its window and its kernel; got "
                         f"window={None if window is None else tuple(window.shape)}, "
                         f"kernel={None if kernel is None else tuple(kernel.shape)}")
    if token.ndim != 2 or window.ndim != 3 or kernel.ndim != 2:
        raise ValueError(f"expected token [B, C], conv window [B, W-1, C] and conv kernel [W, C]; got shapes "
                         f"{tuple(token.shape)}, {tuple(window.shape)}, {tuple(kernel.shape)}")
    batch, channels = token.shape
    width = kernel.shape[0]
    if tuple(kernel.shape) != (width, channels) or tuple(window.shape) != (batch, width - 1, channels):
        raise ValueError(f"conv window must be [B, W-1, C] = [{batch}, {width - 1}, {channels}] and conv kernel "
                         f"[W, C] = [{width}, {channels}] for token [B, C] = [{batch}, {channels}] and W = {width}; "
                         f"got {tuple(window.shape)} and {tuple(kernel.shape)}")


def conv_silu_step(token, window, kernel):
    """silu(causal_conv) of one decode token: token [B, C] -> [B, C] in token's dtype (the layer's `mixed_qkv`)."""
    check_conv_inputs(token, window, kernel)
    out, _ = causal_conv(token[:, None], window, kernel)
    return jax.nn.silu(out[:, 0]).astype(token.dtype)
