"""Next-token selection from logits: greedy, or temperature sampling with optional top-k / top-p (nucleus) filtering."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingParams(NamedTuple):
    """Hashable (a static jit argument). temperature 0 = greedy; top_k / top_p None = no filtering."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None


def check_sampling_params(params: SamplingParams, vocab_size: int) -> None:
    """Raises ValueError naming the bad value."""
    if not params.temperature >= 0.0:
        raise ValueError(f"temperature={params.temperature!r}; it must be >= 0 (0 = greedy)")
    if params.top_k is not None and not (isinstance(params.top_k, int) and 1 <= params.top_k <= vocab_size):
        raise ValueError(f"top_k={params.top_k!r}; it must be an int in [1, vocab_size={vocab_size}] or None")
    if params.top_p is not None and not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p={params.top_p!r}; it must be in (0, 1] or None")


def filter_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, V] float32 divided by the temperature, with tokens outside top-k / top-p set to -inf."""
    logits = logits.astype(jnp.float32) / params.temperature
    if params.top_k is not None:
        kth_largest = jax.lax.top_k(logits, params.top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if params.top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V] descending
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # probability of the strictly larger tokens
        # The smallest kept logit: the last sorted token whose preceding mass is still below top_p (the first always).
        num_kept = jnp.maximum(jnp.sum(mass_before < params.top_p, axis=-1, keepdims=True), 1)  # [B, 1]
        threshold = jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1)  # [B, 1]
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def sample(logits: jax.Array, rng: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, V] -> next tokens [B] int32. Greedy (first maximum, like torch.argmax) when temperature == 0."""
    if params.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, filter_logits(logits, params), axis=-1).astype(jnp.int32)
