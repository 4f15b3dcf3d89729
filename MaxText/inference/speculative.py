"""Greedy speculative decoding: drafters, and the jitted draft -> verify -> commit loop.

Each step, per batch row (`last` = the newest token, not yet in the cache):
    drafts  = drafter.propose(...)                                   k tokens            [B, k]
    logits  = model(concat(last, drafts), model_mode='verify')       one forward         [B, k+1, V]
    n       = longest prefix of drafts equal to argmax(logits)       accepted drafts     0..k
    emit      drafts[:n] and the bonus token argmax(logits[n])       n + 1 tokens
    cache   = commit_verified_cache(cache, n + 1)                    last, drafts[:n] are now in the cache
so the tokens are exactly those of plain greedy decoding, n + 1 per forward instead of 1. Rows accept different
lengths; a row that has finished (eos, or max_new_tokens reached) commits 0 tokens and emits nothing. The caches (the
target's and the draft model's) are created with `state_slots(k)` = k + 2 KDA state-ring slots per row, so the verify
writes each token's state to its own slot and the commit only moves the row's committed slot (no state is copied).

Drafters (both see the same greedy rule, so any drafter only changes speed, never the output):
  NgramDrafter       prompt lookup: the latest earlier occurrence of the row's last `max_ngram`..1 tokens is continued
                     (periodically, when the match runs into the present). No model.
  DraftModelDrafter  a smaller KimiLinear model (its own config and params, same vocabulary): k greedy one-token
                     steps (verify + commit, on its cache's own buffers, then rewound), then one 'verify' + commit over
                     the verified tokens keeps its cache in step with the target's.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.inference.compile_options import decode_compiler_options
from MaxText.layers import kda
from MaxText.layers.models import commit_verified_cache, rewind_cache
from MaxText.pyconfig import MAX_DRAFT_TOKENS

logger = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model")
NO_TOKEN = -1  # history entries that hold no token (left padding, the unwritten tail)


def state_slots(num_draft_tokens: int) -> int:
    """KDA state-ring slots per row the caches need: each verify scores the last token and k drafts."""
    return kda.verify_state_slots(num_draft_tokens + 1)


class NgramDrafter:
    """Prompt-lookup drafting over the row's own history (prompt + generated tokens). Stateless."""

    def __init__(self, num_draft_tokens: int, max_ngram: int = 3):
        self.num_draft_tokens, self.max_ngram = num_draft_tokens, max_ngram
        self.key = ("ngram", num_draft_tokens, max_ngram)

    def params(self):
        return ()

    def init_state(self, tokens, segment_ids):
        return ()

    def propose(self, params, state, last, history, length):
        """history [B, S] int32 (NO_TOKEN where empty), length [B] (tokens in it, `last` included) -> (drafts [B, k],
        state).

        The longest suffix (max_ngram tokens down to 1) that occurred earlier wins, its latest occurrence first; the
        drafts are what followed it. A row with no match drafts its last token repeated.
        """
        batch, size = history.shape
        positions = jnp.arange(size, dtype=jnp.int32)
        match_end = jnp.full((batch,), -1, jnp.int32)  # the position where the matched earlier occurrence ends
        for n in range(self.max_ngram, 0, -1):
            offsets = jnp.arange(n, dtype=jnp.int32)
            suffix = jnp.take_along_axis(history, jnp.maximum(length[:, None] - 1 - offsets, 0), axis=1)  # [B, n]
            matches = (positions[None] < length[:, None] - 1) & jnp.all(suffix != NO_TOKEN, axis=1)[:, None]
            for i in range(n):  # history[p - i] == suffix[i]
                shifted = jnp.pad(history, ((0, 0), (i, 0)), constant_values=NO_TOKEN)[:, :size]
                matches &= shifted == suffix[:, i:i + 1]
            latest = jnp.max(jnp.where(matches, positions[None], -1), axis=1)  # [B]
            match_end = jnp.where(match_end < 0, latest, match_end)
        # What followed the match, extended periodically past the present (period = length - 1 - match_end).
        period = jnp.maximum(length - 1 - match_end, 1)
        steps = jnp.arange(self.num_draft_tokens, dtype=jnp.int32)
        source = match_end[:, None] + 1 + steps[None] % period[:, None]  # [B, k]
        drafts = jnp.take_along_axis(history, jnp.clip(source, 0, size - 1), axis=1)
        return jnp.where((match_end >= 0)[:, None] & (drafts != NO_TOKEN), drafts, last[:, None]), state

    def update(self, params, state, verified_tokens, accepted_len):
        return state


class DraftModelDrafter:
    """Drafts with a second (small) model held by an `Engine`; its cache holds the same committed tokens as the
    target's."""

    def __init__(self, draft_engine, num_draft_tokens: int):
        self.engine, self.num_draft_tokens = draft_engine, num_draft_tokens
        self.key = ("draft_model", num_draft_tokens, id(draft_engine))

    def params(self):
        return self.engine.params

    def init_state(self, tokens, segment_ids):
        """The draft model's cache after prefilling the same (left-padded) prompt batch (with the verify's ring)."""
        return self.engine._prefill(self.engine.params, tokens, segment_ids,
                                    state_slots=state_slots(self.num_draft_tokens))[1]

    def propose(self, params, cache, last, history, length):
        """k greedy draft-model steps from `last` -> (drafts [B, k], its cache with the same committed tokens).

        Each step is a one-token 'verify' + commit: its KDA state goes to the next ring slot, never to the committed
        one (k < S = k + 2), so the steps run on the cache's own buffers and `rewind_cache` then restores every row's
        committed position; nothing of the cache is copied (a scratch copy would cost a whole cache per step).
        """
        model, config = self.engine.model, self.engine.config
        one_token = jnp.ones_like(last)

        def step(carry, _):
            token, scratch = carry
            logits, variables = model.apply({"params": params, "cache": scratch}, token[:, None],
                                            model_mode="verify", mutable=["cache"])
            token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            return (token, commit_verified_cache(config, variables["cache"], one_token)), token

        (_, advanced), drafts = jax.lax.scan(step, (last, cache), None, length=self.num_draft_tokens)
        return drafts.T, rewind_cache(config, advanced, cache)  # [B, k]

    def update(self, params, cache, verified_tokens, accepted_len):
        """Puts the accepted verified tokens into the draft cache: one 'verify' forward, then commit."""
        _, variables = self.engine.model.apply({"params": params, "cache": cache}, verified_tokens,
                                               model_mode="verify", logits_to_keep=1, mutable=["cache"])
        return commit_verified_cache(self.engine.config, variables["cache"], accepted_len)


class SpeculativeResult(NamedTuple):
    tokens: np.ndarray  # [B, N] int32: each row's emitted tokens (rows that stopped early: garbage after their eos)
    verify_steps: int  # verify forwards run
    draft_tokens: int  # draft tokens proposed to rows still generating
    accepted_draft_tokens: int  # of those, the ones equal to the target's greedy choice
    accepted_length_counts: tuple[int, ...]  # [k + 1]: row-steps that matched 0, 1, ..., k drafts


def make_drafter(method: str, num_draft_tokens: int, draft_engine=None, ngram_max_size: int = 3):
    if method == "ngram":
        return NgramDrafter(num_draft_tokens, ngram_max_size)
    return DraftModelDrafter(draft_engine, num_draft_tokens)


def check_request(target_config, method, num_draft_tokens, draft_engine, temperature: float) -> None:
    """Raises ValueError, naming the bad value, for a speculative request the engine cannot honour."""
    if method not in METHODS:
        raise ValueError(f"speculative={method!r}; expected one of {METHODS} (or None / 'none' for plain decoding)")
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)) \
            or not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"num_draft_tokens={num_draft_tokens!r}; it must be an int in [1, {MAX_DRAFT_TOKENS}]")
    if temperature != 0.0:
        raise ValueError(f"speculative={method!r} with temperature={temperature}: speculative decoding is greedy only "
                         f"(no rejection sampling); use temperature=0")
    if method == "ngram" and draft_engine is not None:
        raise ValueError("draft_engine is only used with speculative='draft_model', not 'ngram'")
    if method == "draft_model":
        if draft_engine is None:
            raise ValueError("speculative='draft_model' needs draft_engine=Engine(draft_config, draft_params)")
        if draft_engine.config.vocab_size != target_config.vocab_size:
            raise ValueError(f"the draft model's vocab_size={draft_engine.config.vocab_size} differs from the "
                             f"target's {target_config.vocab_size}; drafts must be target token ids")


class SpeculativeDecoder:
    """The jitted greedy draft -> verify -> commit loop of one target engine with one drafter."""

    def __init__(self, engine, drafter):
        self.engine, self.drafter = engine, drafter
        self._run = jax.jit(self._run_fn, static_argnames=("max_new_tokens",), donate_argnames=("cache", "state"),
                            compiler_options=decode_compiler_options(engine.config))

    def generate(self, tokens, segment_ids, first_logits, cache, eos_id: int, max_new_tokens: int):
        """Decodes after a prefill: tokens / segment_ids [B, L] (left-padded prompts), first_logits [B, V] and cache
        from the target's prefill. Returns a SpeculativeResult."""
        prompt_len = tokens.shape[1]
        history = np.full((tokens.shape[0], prompt_len + max_new_tokens), NO_TOKEN, np.int32)
        history[:, :prompt_len] = np.where(np.asarray(segment_ids) != 0, np.asarray(tokens), NO_TOKEN)
        state = self.drafter.init_state(tokens, segment_ids)
        out, num_steps, counts, _, _ = self._run(
            self.engine.params, self.drafter.params(), cache, state, first_logits, jnp.asarray(history),
            jnp.int32(prompt_len), jnp.int32(eos_id), max_new_tokens=max_new_tokens)
        counts = np.asarray(counts).tolist()
        result = SpeculativeResult(np.asarray(out), int(num_steps), self.drafter.num_draft_tokens * sum(counts),
                                   sum(n * c for n, c in enumerate(counts)), tuple(counts))
        logger.info("speculative (%s, k=%d): %d verify steps, acceptance %.1f%% (%d / %d draft tokens), row-steps "
                    "by drafts matched 0..k: %s", self.drafter.key[0], self.drafter.num_draft_tokens,
                    result.verify_steps, 100.0 * result.accepted_draft_tokens / max(result.draft_tokens, 1),
                    result.accepted_draft_tokens, result.draft_tokens, counts)
        return result

    def _run_fn(self, params, drafter_params, cache, state, first_logits, history, prompt_len, eos_id, *,
                max_new_tokens: int):
        model, config, drafter = self.engine.model, self.engine.config, self.drafter
        k = drafter.num_draft_tokens
        batch = first_logits.shape[0]
        rows = jnp.arange(batch)[:, None]
        first = jnp.argmax(first_logits, axis=-1).astype(jnp.int32)  # [B]
        out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first)
        history = history.at[:, prompt_len].set(first)
        emitted = jnp.ones((batch,), jnp.int32)  # tokens produced per row (the first from the prefill logits)

        def generating(emitted, done):
            return ~done & (emitted < max_new_tokens)

        def keep_going(carry):
            _, _, _, _, emitted, done, _, _, _ = carry
            return jnp.any(generating(emitted, done))

        def step(carry):
            last, cache, state, history, emitted, done, out, num_steps, counts = carry
            active = generating(emitted, done)  # [B]
            drafts, state = drafter.propose(drafter_params, state, last, history, prompt_len + emitted)  # [B, k]
            verified = jnp.concatenate([last[:, None], drafts], axis=1)  # [B, k+1]
            logits, variables = model.apply({"params": params, "cache": cache}, verified, model_mode="verify",
                                            mutable=["cache"])
            target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k+1]: the greedy token after each input
            matched = jnp.sum(jnp.cumprod(drafts == target[:, :k], axis=1), axis=1).astype(jnp.int32)  # [B]
            # Never emit past max_new_tokens: a row's tokens stay exactly those of plain decoding's first N.
            num_drafts = jnp.where(active, jnp.minimum(matched, max_new_tokens - emitted - 1), 0)
            bonus = jnp.take_along_axis(target, num_drafts[:, None], axis=1)[:, 0]
            accepted_len = jnp.where(active, num_drafts + 1, 0)  # last + accepted drafts enter the cache
            cache = commit_verified_cache(config, variables["cache"], accepted_len)
            state = drafter.update(drafter_params, state, verified, accepted_len)

            columns = jnp.arange(k + 1, dtype=jnp.int32)[None]  # the new tokens: drafts[:n], then the bonus
            new = jnp.where(columns < num_drafts[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
            keep = columns < accepted_len[:, None]  # [B, k+1]
            out = out.at[rows, jnp.where(keep, emitted[:, None] + columns, out.shape[1])].set(new, mode="drop")
            history = history.at[rows, jnp.where(keep, prompt_len + emitted[:, None] + columns, history.shape[1])].set(
                new, mode="drop")
            done = done | jnp.any(keep & (new == eos_id), axis=1)
            last = jnp.where(active, bonus, last)
            counts = counts + jnp.sum(jax.nn.one_hot(matched, k + 1, dtype=jnp.int32) * active[:, None], axis=0)
            return last, cache, state, history, emitted + accepted_len, done, out, num_steps + 1, counts

        carry = (first, cache, state, history, emitted, first == eos_id, out, jnp.int32(0),
                 jnp.zeros((k + 1,), jnp.int32))
        _, cache, state, _, _, _, out, num_steps, counts = jax.lax.while_loop(keep_going, step, carry)
        return out, num_steps, counts, cache, state  # the cache / drafter state reuse the donated buffers

