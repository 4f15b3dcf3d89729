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

import contextlib
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

from MaxText import sharding
from MaxText.inference import speculative as spec
from MaxText.inference.compile_options import decode_compiler_options
from MaxText.inference.sampling import SamplingParams, check_sampling_params, sample
from MaxText.layers.models import KimiLinearForCausalLM, init_cache

DECODE_PROGRAM = "jit__decode_fn"  # the XLA module name of generate's decode loop (a profile's program to read)
MIN_BUCKET = 64  # sequence lengths are padded to a power of two >= this, so few distinct shapes get compiled


def _bucket(length: int, limit: int | None = None) -> int:
    """The next power of two >= max(length, MIN_BUCKET), capped at `limit` (never below `length`)."""
    size = max(MIN_BUCKET, 1 << (max(length, 1) - 1).bit_length())
    return max(length, min(size, limit)) if limit is not None else size


class GenerationStats(NamedTuple):
    """Timings of the last `generate` call (wall seconds; the first call of a new shape includes compilation)."""
    prefill_tokens: int  # real (unpadded) prompt tokens
    prefill_seconds: float
    decode_tokens: int  # decode steps x batch rows (rows that already stopped included: they are computed);
    #                     speculative: the tokens the rows emitted
    decode_seconds: float
    # Speculative decoding (all 0 for plain decoding):
    num_draft_tokens: int = 0  # k, draft tokens per verify step
    verify_steps: int = 0  # verify forwards (each scores k + 1 tokens per row)
    draft_tokens: int = 0  # draft tokens proposed to rows still generating
    accepted_draft_tokens: int = 0  # of those, the ones equal to the model's own greedy choice
    accepted_length_counts: tuple[int, ...] = ()  # [k + 1]: row-steps whose drafts matched 0, 1, ..., k tokens

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / max(self.decode_seconds, 1e-9)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 for plain decoding)."""
        return self.accepted_draft_tokens / max(self.draft_tokens, 1)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a row gains per verify forward, 1 + accepted drafts per row-step (1.0 for plain decoding)."""
        row_steps = self.draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0
        return 1.0 + self.accepted_draft_tokens / row_steps if row_steps else 1.0


class Engine:
    """Runs a KimiLinearForCausalLM with fixed params. `config`: a frozen config from `MaxText.pyconfig`.

    `params`: the param tree (`{'model': ..., 'lm_head': ...}`, or the same under a top-level 'params' key), boxed
    or not. Every leaf is checked against the shape the config implies (the error names the param) and cast to the
    dtype the model creates it with (`weight_dtype`; the router's correction bias stays float32).
    `last_stats` holds the GenerationStats of the latest `generate` call (None before the first).
    """

    def __init__(self, config: ml_collections.FrozenConfigDict, params: Mapping[str, Any],
                 mesh: jax.sharding.Mesh | None = None):
        self.config = config
        self.model = KimiLinearForCausalLM(config)
        # Sharding (MaxText/sharding.py): params on their logical-axis shardings, batch rows over data (and fsdp),
        # the decode cache by the layers' CACHE_LOGICAL_AXES; the default mesh comes from the ici_* / dcn_* keys.
        self.mesh = sharding.create_mesh(config) if mesh is None else mesh
        sharding.check_mesh_fits_model(config, self.mesh)
        self.param_shardings = sharding.param_shardings(config, self.mesh)
        self.params = jax.device_put(self._checked_params(params), self.param_shardings)
        self.last_stats: GenerationStats | None = None
        self._speculative_decoders: dict[tuple, spec.SpeculativeDecoder] = {}  # by drafter key
        rows = functools.partial(sharding.batch_sharding, self.mesh, config)  # [B, ...] arrays of ndim dims
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        cache_shardings = sharding.cache_shardings(self._abstract_cache(), self.mesh, config)
        self._forward = sharding.jit_in_mesh(
            functools.partial(self.model.apply, model_mode="train"), self.mesh, config,
            in_shardings=({"params": self.param_shardings}, rows(2)), out_shardings=rows(3))
        # Cache shardings go by leaf name and rank, so they fit every state_slots (the KDA ring's S).
        self._prefill = sharding.jit_in_mesh(self._prefill_fn, self.mesh, config, static_argnames=("state_slots",),
                                             in_shardings=(self.param_shardings, rows(2), rows(2)),
                                             out_shardings=(rows(2), cache_shardings))
        # The cache is donated into the decode loop (reused in place where the backend supports donation).
        self._decode = sharding.jit_in_mesh(
            self._decode_fn, self.mesh, config, static_argnames=("max_new_tokens", "sampling"),
            donate_argnames=("cache",), compiler_options=decode_compiler_options(config, decode_loop=True),
            in_shardings=(self.param_shardings, cache_shardings, rows(2), replicated, replicated),
            out_shardings=(rows(2), replicated, cache_shardings))

    @classmethod
    def from_checkpoint(cls, path: str, **config_overrides) -> "Engine":
        """Loads the config and params written by `MaxText.convert_hf_checkpoint` (or training) at `path`."""
        from MaxText import checkpointing  # imported lazily: Orbax is only needed here

        config, params = checkpointing.load_for_inference(path, sharded=True, **config_overrides)
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
        logits = self._forward({"params": self.params}, jnp.asarray(self._rows_for_mesh(padded)))
        return np.asarray(logits[:batch, :length], dtype=np.float32)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 eos_id: int | None = None, speculative: str | None = None, num_draft_tokens: int = 4,
                 draft_engine: "Engine | None" = None, profile_dir: str | None = None) -> list[list[int]]:
        """Generates up to `max_new_tokens` tokens after each prompt; returns the new token ids per prompt.

        temperature 0 is greedy (identical to generating each prompt alone); > 0 samples with optional top-k /
        top-p filtering from a PRNG seeded by `seed`. A row stops after its first `eos_id`, which it includes.
        speculative: None / 'none' (plain decoding), 'ngram' (prompt lookup) or 'draft_model' (`draft_engine`, an
        Engine of a smaller model with the same vocabulary) verifies `num_draft_tokens` drafts per forward
        (inference/speculative.py); greedy only, the same tokens as plain greedy; stats in `last_stats`.
        profile_dir: write a `jax.profiler` trace of the decoding (after the prefill, until the new tokens are on
        the host) under this directory (its decode loop is the XLA program DECODE_PROGRAM).
        Raises ValueError, before any compute, for an empty prompt list or prompt, a token id outside
        [0, vocab_size), a prompt longer than max_target_length - max_new_tokens (- num_draft_tokens when
        speculative), or bad sampling / speculative arguments.
        """
        sampling = SamplingParams(float(temperature), top_k, None if top_p is None else float(top_p))
        speculative = None if speculative == "none" else speculative
        draft_positions = 0 if speculative is None else num_draft_tokens  # verify writes k positions past the last
        if speculative is not None:
            spec.check_request(self.config, speculative, num_draft_tokens, draft_engine, sampling.temperature)
        self._check_request(prompts, max_new_tokens + draft_positions, sampling, eos_id)
        if draft_engine is not None:
            draft_engine._check_request(prompts, max_new_tokens + draft_positions, sampling, eos_id)
        if max_new_tokens == 0:
            return [[] for _ in prompts]
        longest = max(len(p) for p in prompts)
        # Cache positions: plain decoding writes L + max_new_tokens - 1; a verify step writes k past its row's tokens.
        limits = [engine.config.max_target_length - max_new_tokens - draft_positions + (speculative is None)
                  for engine in (self, draft_engine) if engine is not None]
        length = _bucket(longest, min(limits))
        tokens = np.zeros((len(prompts), length), np.int32)
        segment_ids = np.zeros((len(prompts), length), np.int32)
        for row, prompt in enumerate(prompts):  # left padding: every row's last prompt token is at length - 1
            tokens[row, length - len(prompt):] = prompt
            segment_ids[row, length - len(prompt):] = 1
        tokens, segment_ids = self._rows_for_mesh(tokens), self._rows_for_mesh(segment_ids)
        start = time.perf_counter()
        state_slots = 1 if speculative is None else spec.state_slots(num_draft_tokens)
        first_logits, cache = jax.block_until_ready(
            self._prefill(self.params, jnp.asarray(tokens), jnp.asarray(segment_ids), state_slots=state_slots))
        prefilled = time.perf_counter()
        with jax.profiler.trace(profile_dir) if profile_dir else contextlib.nullcontext():
            if speculative is not None:  # the draft model's prefill counts as decode time
                result = self._speculative_decoder(speculative, num_draft_tokens, draft_engine).generate(
                    jnp.asarray(tokens), jnp.asarray(segment_ids), first_logits, cache,
                    -1 if eos_id is None else eos_id, max_new_tokens)
                rows = [_until_eos(row.tolist(), eos_id) for row in result.tokens[:len(prompts)]]
                self.last_stats = GenerationStats(
                    sum(len(p) for p in prompts), prefilled - start, sum(len(row) for row in rows),
                    time.perf_counter() - prefilled, num_draft_tokens, result.verify_steps, result.draft_tokens,
                    result.accepted_draft_tokens, result.accepted_length_counts)
                return rows
            new_tokens, num_steps, _ = self._decode(self.params, cache, first_logits, jax.random.PRNGKey(seed),
                                                    jnp.int32(-1 if eos_id is None else eos_id),
                                                    max_new_tokens=max_new_tokens, sampling=sampling)
            new_tokens = np.asarray(new_tokens)[:len(prompts), :int(num_steps)]
            decoded = time.perf_counter()  # before the profiler (if any) writes its trace
        self.last_stats = GenerationStats(sum(len(p) for p in prompts), prefilled - start, new_tokens.size,
                                          decoded - prefilled)
        return [_until_eos(row.tolist(), eos_id) for row in new_tokens]

    def _speculative_decoder(self, method: str, num_draft_tokens: int, draft_engine) -> spec.SpeculativeDecoder:
        """The (compiled once, then reused) speculative loop for this drafter."""
        drafter = spec.make_drafter(method, num_draft_tokens, draft_engine, self.config.ngram_max_size)
        if drafter.key not in self._speculative_decoders:
            self._speculative_decoders[drafter.key] = spec.SpeculativeDecoder(self, drafter)
        return self._speculative_decoders[drafter.key]

    # ------------------------------------------------------------------------------------------- jitted steps

    def _prefill_fn(self, params, tokens, segment_ids, *, state_slots: int = 1):
        """tokens, segment_ids [B, L] -> (last-position logits [B, V] float32, the filled cache). The cache is created
        here with `state_slots` KDA state-ring slots per row (1 for plain decoding; speculative decoding needs one
        per verified token more: `speculative.state_slots`)."""
        cache = init_cache(self.config, tokens.shape[0], state_slots)
        logits, variables = self.model.apply({"params": params, "cache": cache}, tokens, model_mode="prefill",
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

        def step_fn(state):
            step, token, cache, done, out = state
            logits, variables = self.model.apply({"params": params, "cache": cache}, token[:, None],
                                                 model_mode="autoregressive", mutable=["cache"])
            token = sample(logits[:, -1], jax.random.fold_in(rng, step), sampling)  # [B]
            out = jax.lax.dynamic_update_slice(out, token[:, None], (0, step))
            return step + 1, token, variables["cache"], done | (token == eos_id), out

        def steps_while_room(state, steps_per_iteration: int):
            """Iterations of `steps_per_iteration` steps while they fit in max_new_tokens and a row is not done."""
            def keep_going(state):
                step, _, _, done, _ = state
                return (step + steps_per_iteration <= max_new_tokens) & ~jnp.all(done)

            def iteration(state):
                for _ in range(steps_per_iteration):
                    state = step_fn(state)
                return state

            return jax.lax.while_loop(keep_going, iteration, state)

        state = (jnp.int32(1), first, cache, first == eos_id, out)
        unroll = self.config.decode_loop_unroll
        state = steps_while_room(state, unroll)
        if unroll > 1:  # the last < unroll steps one at a time: no step past max_new_tokens
            state = steps_while_room(state, 1)
        num_steps, _, cache, _, out = state
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
        for path, expected_leaf in want.items():
            if tuple(np.shape(got[path])) != tuple(expected_leaf.shape):
                raise ValueError(f"param {path} has shape {tuple(np.shape(got[path]))}; the config implies "
                                 f"{tuple(expected_leaf.shape)}")
        # jax.Arrays keep their placement (a sharded restore); host arrays stay on the host until device_put shards
        # them, so no device ever holds a whole large param.
        cast = {path: got[path].astype(expected_leaf.dtype) if isinstance(got[path], jax.Array)
                else np.asarray(got[path], dtype=expected_leaf.dtype) for path, expected_leaf in want.items()}
        return flax.traverse_util.unflatten_dict(cast, sep="/")

    def _abstract_cache(self):
        """The decode cache's structure (ShapeDtypeStructs of a 1-row cache); nothing is allocated."""
        return jax.eval_shape(lambda: init_cache(self.config, 1))

    def _rows_for_mesh(self, rows: np.ndarray) -> np.ndarray:
        """[B, ...] -> [B', ...]: the last row repeated until B' is a multiple of the mesh's batch shards (the extra
        rows are computed like the row they copy, and dropped from every result)."""
        multiple = sharding.batch_multiple(self.mesh, self.config)
        extra = -rows.shape[0] % multiple
        return np.concatenate([rows, np.repeat(rows[-1:], extra, axis=0)]) if extra else rows

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
