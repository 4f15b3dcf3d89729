"""The inference engine: full-sequence logits, and batched generation (prefill once, then jitted decode steps).

    engine = Engine(config, params)                     # or Engine.from_checkpoint(path, **config_overrides)
    logits = engine.logits([[1, 2, 3]])                 # float32 numpy [B, T, vocab]
    new    = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=32)   # list of lists of new token ids

Generation left-pads the batch (padding is masked: KDA keeps a zero state through it, MLA never attends to it), runs
one prefill, then a `jax.lax.while_loop` of decode steps inside one jitted call that takes the cache donated; it stops
when every row has produced `eos_id` or after `max_new_tokens`. Each row's output ends at its first `eos_id`
(included). Requests are validated before any compute.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from MaxText.inference.sampling import SamplingParams, check_sampling_params, sample
from MaxText.layers.models import KimiLinearForCausalLM

MIN_BUCKET = 64  # sequence lengths are padded to a power of two >= this, so few distinct shapes get compiled


def _bucket(length: int, limit: int | None = None) -> int:
    """The next power of two >= max(length, MIN_BUCKET), capped at `limit` (never below `length`)."""
    size = max(MIN_BUCKET, 1 << (max(length, 1) - 1).bit_length())
    return max(length, min(size, limit)) if limit is not None else size


class GenerationStats(NamedTuple):
    """Timings of the last `generate` call (wall seconds; the first call of a new shape includes compilation)."""
    prefill_tokens: int  # real (unpadded) prompt tokens
    prefill_seconds: float
    decode_tokens: int  # decode steps x batch rows (rows that already stopped included: they are computed)
    decode_seconds: float

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / max(self.decode_seconds, 1e-9)


class Engine:
    """Runs a KimiLinearForCausalLM with fixed params. `config`: a frozen config from `MaxText.pyconfig`.

    `params`: the param tree (`{'model': ..., 'lm_head': ...}`, or the same under a top-level 'params' key), boxed
    or not. Every leaf is checked against the shape the config implies (the error names the param) and cast to the
    dtype the model creates it with (`weight_dtype`; the router's correction bias stays float32).
    `last_stats` holds the GenerationStats of the latest `generate` call (None before the first).
    """

    def __init__(self, config: ml_collections.FrozenConfigDict, params: Mapping[str, Any]):
        self.config = config
        self.model = KimiLinearForCausalLM(config)
        self.params = self._checked_params(params)
        self.last_stats: GenerationStats | None = None
        self._forward = jax.jit(functools.partial(self.model.apply, model_mode="train"))
        self._prefill = jax.jit(self._prefill_fn)
        # The cache is donated into the decode loop (reused in place where the backend supports donation).
        self._decode = jax.jit(self._decode_fn, static_argnames=("max_new_tokens", "sampling"),
                               donate_argnames=("cache",))

    @classmethod
    def from_checkpoint(cls, path: str, **config_overrides) -> "Engine":
        """Loads the config and params written by `MaxText.convert_hf_checkpoint` (or training) at `path`."""
        from MaxText import checkpointing  # imported lazily: Orbax is only needed here

        config, params = checkpointing.load_for_inference(path, **config_overrides)
        return cls(config, params)

    # ------------------------------------------------------------------------------------------- public API

    def logits(self, token_ids) -> np.ndarray:
        """token_ids: [B, T] ints (array-like; a flat [T] sequence is one row) -> float32 numpy [B, T, vocab].

        A full-sequence forward (model_mode='train', no cache). Rows are right-padded to a compile bucket; the model
        is causal, so the padding never changes the returned positions.
        """
        rows = [token_ids] if len(token_ids) and np.ndim(token_ids[0]) == 0 else list(token_ids)
        if len({len(row) for row in rows}) > 1:
            raise ValueError(f"token_ids rows have different lengths {[len(row) for row in rows]}; logits() takes "
                             f"equal-length rows (generate() pads prompts of different lengths)")
        tokens = np.asarray(token_ids)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or tokens.shape[1] == 0 or tokens.shape[0] == 0:
            raise ValueError(f"token_ids must be a non-empty [B, T] array of token ids, got shape {tokens.shape}")
        self._check_token_ids(tokens.tolist())
        batch, length = tokens.shape
        padded = np.zeros((batch, _bucket(length)), np.int32)
        padded[:, :length] = tokens
        logits = self._forward({"params": self.params}, jnp.asarray(padded))
        return np.asarray(logits[:, :length], dtype=np.float32)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 eos_id: int | None = None) -> list[list[int]]:
        """Generates up to `max_new_tokens` tokens after each prompt; returns the new token ids per prompt.

        temperature 0 is greedy (identical to generating each prompt alone); > 0 samples with optional top-k /
        top-p filtering from a PRNG seeded by `seed`. A row stops after its first `eos_id`, which it includes.
        Raises ValueError, before any compute, for an empty prompt list or prompt, a token id outside
        [0, vocab_size), a prompt longer than max_target_length - max_new_tokens, or bad sampling arguments.
        """
        sampling = SamplingParams(float(temperature), top_k, None if top_p is None else float(top_p))
        self._check_request(prompts, max_new_tokens, sampling, eos_id)
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        longest = max(len(p) for p in prompts)
        length = _bucket(longest, self.config.max_target_length - max_new_tokens + 1)
        tokens = np.zeros((len(prompts), length), np.int32)
        segment_ids = np.zeros((len(prompts), length), np.int32)
        for row, prompt in enumerate(prompts):  # left padding: every row's last prompt token is at length - 1
            tokens[row, length - len(prompt):] = prompt
            segment_ids[row, length - len(prompt):] = 1
        start = time.perf_counter()
        first_logits, cache = jax.block_until_ready(
            self._prefill(self.params, jnp.asarray(tokens), jnp.asarray(segment_ids)))
        prefilled = time.perf_counter()
        new_tokens, num_steps, _ = self._decode(self.params, cache, first_logits, jax.random.PRNGKey(seed),
                                                jnp.int32(-1 if eos_id is None else eos_id),
                                                max_new_tokens=max_new_tokens, sampling=sampling)
        new_tokens = np.asarray(new_tokens)[:, :int(num_steps)]
        self.last_stats = GenerationStats(sum(len(p) for p in prompts), prefilled - start,
                                          new_tokens.size, time.perf_counter() - prefilled)
        return [_until_eos(row.tolist(), eos_id) for row in new_tokens]

    # ------------------------------------------------------------------------------------------- jitted steps

    def _prefill_fn(self, params, tokens, segment_ids):
        """tokens, segment_ids [B, L] -> (last-position logits [B, V] float32, the filled cache)."""
        logits, variables = self.model.apply({"params": params}, tokens, model_mode="prefill",
                                             decoder_segment_ids=segment_ids, logits_to_keep=1, mutable=["cache"])
        return logits[:, -1], variables["cache"]

    def _decode_fn(self, params, cache, first_logits, rng, eos_id, *, max_new_tokens: int, sampling: SamplingParams):
        """Samples the first token from the prefill logits, then decodes until every row is done.

        Returns (tokens [B, max_new_tokens] int32, the number of valid columns, the final cache: it reuses the
        donated input cache's buffers). A row that is done keeps being computed (the batch is static) but its later
        tokens are discarded by the caller.
        """
        batch = first_logits.shape[0]
        first = sample(first_logits, jax.random.fold_in(rng, 0), sampling)  # [B]
        out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first)

        def keep_going(state):
            step, _, _, done, _ = state
            return (step < max_new_tokens) & ~jnp.all(done)

        def step_fn(state):
            step, token, cache, done, out = state
            logits, variables = self.model.apply({"params": params, "cache": cache}, token[:, None],
                                                 model_mode="autoregressive", mutable=["cache"])
            token = sample(logits[:, -1], jax.random.fold_in(rng, step), sampling)  # [B]
            out = jax.lax.dynamic_update_slice(out, token[:, None], (0, step))
            return step + 1, token, variables["cache"], done | (token == eos_id), out

        state = (jnp.int32(1), first, cache, first == eos_id, out)
        num_steps, _, cache, _, out = jax.lax.while_loop(keep_going, step_fn, state)
        return out, num_steps, cache

    # ------------------------------------------------------------------------------------------- validation

    def _checked_params(self, params: Mapping[str, Any]):
        """Unboxes, checks every leaf's path and shape against the model, and casts to the model's dtypes."""
        params = nn.unbox(params)
        if isinstance(params, Mapping) and set(params) == {"params"}:
            params = params["params"]
        dummy = jnp.zeros((1, 1), jnp.int32)
        expected = nn.unbox(jax.eval_shape(lambda: self.model.init(jax.random.PRNGKey(0), dummy,
                                                                   model_mode="train"))["params"])
        want = flax.traverse_util.flatten_dict(flax.core.unfreeze(expected), sep="/")
        got = flax.traverse_util.flatten_dict(flax.core.unfreeze(dict(params)), sep="/")
        missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or unexpected:
            raise ValueError(f"params do not match the config: missing {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                             f"{' ...' if len(unexpected) > 8 else ''}")
        for path, spec in want.items():
            if tuple(np.shape(got[path])) != tuple(spec.shape):
                raise ValueError(f"param {path} has shape {tuple(np.shape(got[path]))}; the config implies "
                                 f"{tuple(spec.shape)}")
        cast = {path: jnp.asarray(got[path], dtype=spec.dtype) for path, spec in want.items()}
        return flax.traverse_util.unflatten_dict(cast, sep="/")

    def _check_token_ids(self, prompts: Sequence[Sequence[int]]) -> None:
        vocab = self.config.vocab_size
        for row, prompt in enumerate(prompts):
            for position, token in enumerate(prompt):
                if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)) \
                        or not 0 <= token < vocab:
                    raise ValueError(f"prompt {row} holds token id {token!r} at position {position}; token ids must "
                                     f"be ints in [0, vocab_size={vocab})")

    def _check_request(self, prompts, max_new_tokens, sampling: SamplingParams, eos_id) -> None:
        cfg = self.config
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r:.80}")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}; it must be an int >= 0")
        for row, prompt in enumerate(prompts):
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
                raise ValueError(f"prompt {row} is {prompt!r:.80}; expected a list of token ids")
            if len(prompt) == 0:
                raise ValueError(f"prompt {row} is empty; every prompt needs at least one token")
            if len(prompt) + max_new_tokens > cfg.max_target_length:
                raise ValueError(f"prompt {row} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} that "
                                 f"is {len(prompt) + max_new_tokens} > max_target_length={cfg.max_target_length}")
        self._check_token_ids(prompts)
        check_sampling_params(sampling, cfg.vocab_size)
        if eos_id is not None and not (isinstance(eos_id, (int, np.integer)) and 0 <= eos_id < cfg.vocab_size):
            raise ValueError(f"eos_id={eos_id!r}; it must be an int in [0, vocab_size={cfg.vocab_size}) or None")


def _until_eos(tokens: list[int], eos_id: int | None) -> list[int]:
    """The tokens up to and including the first `eos_id` (all of them when there is none)."""
    if eos_id is not None and eos_id in tokens:
        return tokens[:tokens.index(eos_id) + 1]
    return tokens
