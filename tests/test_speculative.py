"""Speculative decoding: verify + commit leaves the cache of plain decoding; greedy output is token-identical with
the n-gram and the draft-model drafter for rows accepting 0..k drafts; bad settings fail at config load / request."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import pyconfig
from MaxText.inference.engine import Engine
from MaxText.inference.speculative import NgramDrafter
from MaxText.layers.models import KimiLinearForCausalLM, commit_verified_cache

TINY = "configs/kimi_linear_tiny.yml"
OVERRIDES = {"param_init_std": 0.08, "kda_kernel": "chunked", "kda_chunk_size": 32, "max_target_length": 128}
K = 4  # draft tokens per verify step
NEW_TOKENS = 24


def _config(**overrides):
    return pyconfig.load_config(TINY, {**OVERRIDES, **overrides})


def _init(config, seed: int):
    return KimiLinearForCausalLM(config).init(jax.random.PRNGKey(seed), jnp.zeros((1, 1), jnp.int32),
                                              model_mode="train")["params"]


@functools.lru_cache(maxsize=None)
def damped_engine(mixer_scale: float) -> Engine:
    """The random tiny Kimi-Linear (3 KDA + 1 MLA) with its mixers' o_proj scaled by `mixer_scale`.

    0.01 (the target): the greedy next token depends mostly, not only, on the last token, so the output repeats
    fragments the n-gram drafter can predict, but not always. 0.0 (the draft model): the target's bigram
    approximation, a different model that agrees with it often but not always.
    """
    config = _config()
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * mixer_scale if "o_proj" in jax.tree_util.keystr(path) else x, nn.unbox(_init(config, 0)))
    return Engine(config, params)


def target() -> Engine:
    return damped_engine(0.01)


def other_model() -> Engine:
    return damped_engine(0.0)

# ----------------------------------------------------------------------------------------- verify + commit


def _cache_rows(cache, row):
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[row], cache)


def _assert_cache_row_equal(got, want, tol=1e-5):
    """One row's cache: KDA conv / recurrent state to tol; MLA index, validity and the valid latents."""
    for name, layer in want["model"].items():
        got_attn, want_attn = got["model"][name]["self_attn"], layer["self_attn"]
        if "latent" in want_attn:
            assert int(got_attn["index"]) == int(want_attn["index"]), name
            np.testing.assert_array_equal(got_attn["key_valid"], want_attn["key_valid"], err_msg=name)
            valid = want_attn["key_valid"]
            np.testing.assert_allclose(got_attn["latent"][valid], want_attn["latent"][valid], atol=tol, rtol=0)
        else:
            assert set(got_attn) == {"conv_state", "recurrent_state"}, set(got_attn)
            for key in ("conv_state", "recurrent_state"):
                np.testing.assert_allclose(got_attn[key], want_attn[key], atol=tol, rtol=0, err_msg=f"{name}/{key}")


@pytest.mark.parametrize("checkpoint_dtype, tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_commit_leaves_the_cache_of_decoding_only_the_accepted_tokens(checkpoint_dtype, tol):
    """Two verify + commit rounds with per-row accepted lengths 0..k+1 == decoding each row's accepted tokens."""
    config = _config(verify_checkpoint_dtype=checkpoint_dtype)
    model, params = KimiLinearForCausalLM(config), target().params
    rng = np.random.default_rng(0)
    batch, lengths = 4, (9, 5, 12, 7)
    prompt = np.zeros((batch, 12), np.int32)
    segment_ids = np.zeros((batch, 12), np.int32)
    for row, length in enumerate(lengths):  # left padding, as the engine does
        prompt[row, 12 - length:] = rng.integers(0, 260, length)
        segment_ids[row, 12 - length:] = 1

    @jax.jit
    def prefill(tokens, segments):
        return model.apply({"params": params}, tokens, model_mode="prefill", decoder_segment_ids=segments,
                           mutable=["cache"])[1]["cache"]

    @jax.jit
    def verify_and_commit(cache, tokens, accepted):
        _, variables = model.apply({"params": params, "cache": cache}, tokens, model_mode="verify", mutable=["cache"])
        assert "verify_states" in variables["cache"]["model"]["layers_0"]["self_attn"]
        return commit_verified_cache(config, variables["cache"], accepted)

    @jax.jit
    def decode_step(cache, token):
        return model.apply({"params": params, "cache": cache}, token[:, None], model_mode="autoregressive",
                           mutable=["cache"])[1]["cache"]

    rounds = [(rng.integers(0, 260, (batch, K + 1)), np.array([0, 1, 3, K + 1])),
              (rng.integers(0, 260, (batch, K + 1)), np.array([K + 1, 2, 0, 4]))]
    cache = prefill(jnp.asarray(prompt), jnp.asarray(segment_ids))
    committed = [[] for _ in range(batch)]  # each row's accepted tokens, in order
    for tokens, accepted in rounds:
        cache = verify_and_commit(cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(accepted, jnp.int32))
        for row in range(batch):
            committed[row] += tokens[row, :accepted[row]].tolist()

    for row in range(batch):  # plain decoding of this row's accepted tokens (every row fed the same ones)
        plain = prefill(jnp.asarray(prompt), jnp.asarray(segment_ids))
        for token in committed[row]:
            plain = decode_step(plain, jnp.full((batch,), token, jnp.int32))
        _assert_cache_row_equal(_cache_rows(cache, row), _cache_rows(plain, row), tol)


# ----------------------------------------------------------------------------------------- generation


def _cycle_prompts():
    """Row 0: the target's own greedy output (fragments recur: n-gram drafts often right); row 1: random tokens (no
    match at first); row 2: a repeated pattern the target does not follow (confidently wrong drafts)."""
    rng = np.random.default_rng(3)
    seed_prompt = rng.integers(0, 260, 6).tolist()
    own = target().generate([seed_prompt], 60)[0]
    return [seed_prompt + own, rng.integers(0, 260, 11).tolist(), rng.integers(0, 260, 4).tolist() * 5]


def test_ngram_speculation_is_token_identical_to_greedy():
    prompts = _cycle_prompts()
    plain = target().generate(prompts, NEW_TOKENS)
    speculative = target().generate(prompts, NEW_TOKENS, speculative="ngram", num_draft_tokens=K)
    assert speculative == plain
    stats = target().last_stats
    counts = stats.accepted_length_counts
    assert len(counts) == K + 1 and counts[0] > 0 and counts[K] > 0, counts  # rows accepted 0 ... k drafts
    assert 0.0 < stats.acceptance_rate < 1.0 and stats.tokens_per_step > 1.0, stats
    assert stats.decode_tokens == 3 * NEW_TOKENS and stats.verify_steps < NEW_TOKENS


def test_draft_model_speculation_is_token_identical_to_greedy():
    prompts = _cycle_prompts()
    plain = target().generate(prompts, NEW_TOKENS)
    partial = target().generate(prompts, NEW_TOKENS, speculative="draft_model", num_draft_tokens=K,
                                draft_engine=other_model())
    assert partial == plain
    stats = target().last_stats
    assert 0.0 < stats.acceptance_rate < 1.0 and stats.accepted_length_counts[0] > 0, stats
    itself = target().generate(prompts, NEW_TOKENS, speculative="draft_model", num_draft_tokens=K,
                               draft_engine=target())
    assert itself == plain
    assert target().last_stats.acceptance_rate == 1.0, target().last_stats  # the target drafting for itself


def test_speculation_stops_rows_at_eos():
    prompts = _cycle_prompts()
    plain = target().generate(prompts, NEW_TOKENS)
    eos = plain[1][5]
    expected = target().generate(prompts, NEW_TOKENS, eos_id=eos)
    assert target().generate(prompts, NEW_TOKENS, eos_id=eos, speculative="ngram", num_draft_tokens=K) == expected


def test_ngram_drafter_continues_the_latest_match_periodically():
    drafter = NgramDrafter(num_draft_tokens=5, max_ngram=2)
    history = jnp.array([[-1, -1, 7, 1, 2, 3, 9, 1, 2, -1, -1, -1],   # "1 2" matched at 3..4: drafts 3 9 1 2 3
                         [5, 6, 5, 6, 5, 6, -1, -1, -1, -1, -1, -1],  # period 2: 5 6 5 6 5
                         [-1, -1, -1, 4, 8, 0, -1, -1, -1, -1, -1, -1]], jnp.int32)  # no match: repeat the last
    drafts = drafter.propose((), (), jnp.array([2, 6, 0]), history, jnp.array([9, 6, 6]))
    assert np.asarray(drafts).tolist() == [[3, 9, 1, 2, 3], [5, 6, 5, 6, 5], [0, 0, 0, 0, 0]]


# ----------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize("overrides, message", [
    ({"speculative": "tree"}, "allowed values: none, ngram, draft_model"),
    ({"speculative": "ngram", "temperature": 0.7}, "greedy only"),
    ({"speculative": "ngram", "temperature": 0.0, "num_draft_tokens": 0}, r"num_draft_tokens is 0; it must be in \[1, 16\]"),
    ({"num_draft_tokens": 17}, r"\[1, 16\]"),
    ({"speculative_topk": 2}, "tree drafts are not supported"),
    ({"speculative": "draft_model", "temperature": 0.0}, "needs draft_config_path"),
    ({"verify_checkpoint_dtype": "float16"}, "allowed values: float32, bfloat16"),
])
def test_unsupported_settings_fail_at_config_load(overrides, message):
    with pytest.raises(pyconfig.ConfigError, match=message):
        _config(**overrides)


def test_draft_model_config_loads():
    config = _config(speculative="draft_model", temperature=0.0, draft_config_path=TINY, num_draft_tokens=3)
    assert (config.speculative, config.num_draft_tokens, config.draft_config_path) == ("draft_model", 3, TINY)


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative="tree"), "speculative='tree'"),
    (dict(speculative="ngram", temperature=0.5), "greedy only"),
    (dict(speculative="ngram", num_draft_tokens=0), "num_draft_tokens=0"),
    (dict(speculative="draft_model"), "needs draft_engine"),
    (dict(speculative="ngram", max_new_tokens=120), "max_target_length=128"),
])
def test_bad_speculative_requests_fail_before_any_compute(kwargs, message, monkeypatch):
    engine = target()
    monkeypatch.setattr(engine, "_prefill", lambda *a, **k: pytest.fail("compute ran"))
    request = {"prompts": [[1, 2, 3, 4, 5]], "max_new_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        engine.generate(**request)
