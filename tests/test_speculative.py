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
from MaxText.inference import speculative
from MaxText.inference.speculative import NgramDrafter
from MaxText.layers import kda
from MaxText.layers.models import KimiLinearForCausalLM, commit_verified_cache, init_cache

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


def _assert_cache_row_equal(got, want, tol=1e-5):
    """One row's cache: KDA conv window and committed state to tol; MLA index, validity and the valid latents."""
    for name, layer in want["model"].items():
        got_attn, want_attn = got["model"][name]["self_attn"], layer["self_attn"]
        if "latent" in want_attn:
            np.testing.assert_array_equal(got_attn["index"], want_attn["index"], err_msg=name)
            np.testing.assert_array_equal(got_attn["key_valid"], want_attn["key_valid"], err_msg=name)
            valid = want_attn["key_valid"]
            np.testing.assert_allclose(got_attn["latent"][valid], want_attn["latent"][valid], atol=tol, rtol=0)
        else:
            assert set(got_attn) == {"conv_state", "recurrent_state", "state_slot", "norm_counts",
                                     "project_counts"}, set(got_attn)
            for counts in ("norm_counts", "project_counts"):
                assert not np.any(got_attn[counts]), f"{name}/{counts}"  # zero between steps
            np.testing.assert_allclose(got_attn["conv_state"], want_attn["conv_state"], atol=tol, rtol=0,
                                       err_msg=f"{name}/conv_state")
            np.testing.assert_allclose(kda.committed_state(got_attn), kda.committed_state(want_attn), atol=tol,
                                       rtol=0, err_msg=f"{name}/committed state")


def _batch_rows(cache, row):
    """Row `row` of every cache leaf, kept as a 1-row batch (what kda.committed_state reads)."""
    return jax.tree_util.tree_map(lambda x: np.asarray(x)[row:row + 1], cache)


def test_commit_leaves_the_cache_of_decoding_only_the_accepted_tokens():
    """Verify + commit rounds with per-row accepted lengths 0..k+1, each row's ring of k + 2 slots wrapping around,
    then plain decode steps on that cache == decoding each row's accepted tokens on a plain (1-slot) cache: same
    committed state and window to 1e-5, same decode-step logits (so the same greedy tokens)."""
    config = _config()
    model, params = KimiLinearForCausalLM(config), target().params
    rng = np.random.default_rng(0)
    batch, lengths = 4, (9, 5, 12, 7)
    prompt = np.zeros((batch, 12), np.int32)
    segment_ids = np.zeros((batch, 12), np.int32)
    for row, length in enumerate(lengths):  # left padding, as the engine does
        prompt[row, 12 - length:] = rng.integers(0, 260, length)
        segment_ids[row, 12 - length:] = 1

    @functools.partial(jax.jit, static_argnums=2)
    def prefill(tokens, segments, state_slots):
        return model.apply({"params": params, "cache": init_cache(config, batch, state_slots)}, tokens,
                           model_mode="prefill", decoder_segment_ids=segments, mutable=["cache"])[1]["cache"]

    @jax.jit
    def verify_and_commit(cache, tokens, accepted):
        _, variables = model.apply({"params": params, "cache": cache}, tokens, model_mode="verify", mutable=["cache"])
        assert "verify_inputs" in variables["cache"]["model"]["layers_0"]["self_attn"]
        return commit_verified_cache(config, variables["cache"], accepted)

    @jax.jit
    def decode_step(cache, token):
        logits, variables = model.apply({"params": params, "cache": cache}, token[:, None],
                                        model_mode="autoregressive", mutable=["cache"])
        return logits[:, -1], variables["cache"]

    slots = kda.verify_state_slots(K + 1)
    accepted_per_round = [[0, 1, 3, K + 1], [K + 1, 2, 0, 4], [K + 1, K + 1, 1, 0], [3, K + 1, 0, 2]]
    cache = prefill(jnp.asarray(prompt), jnp.asarray(segment_ids), slots)
    committed = [[] for _ in range(batch)]  # each row's accepted tokens, in order
    for accepted in accepted_per_round:
        tokens = rng.integers(0, 260, (batch, K + 1))
        cache = verify_and_commit(cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(accepted, jnp.int32))
        for row in range(batch):
            committed[row] += tokens[row, :accepted[row]].tolist()
    totals = [len(c) for c in committed]
    assert max(totals) >= slots and min(totals) < slots, totals  # some rings wrapped around, some did not
    np.testing.assert_array_equal(cache["model"]["layers_0"]["self_attn"]["state_slot"],
                                  np.asarray(totals) % slots)
    after = rng.integers(0, 260, (2, batch))  # plain decode steps on the speculative (k + 2 slot) cache
    spec_logits = []
    for tokens in after:
        logits, cache = decode_step(cache, jnp.asarray(tokens, jnp.int32))
        spec_logits.append(np.asarray(logits))

    for row in range(batch):  # plain decoding of this row's accepted tokens (every row fed the same ones)
        plain = prefill(jnp.asarray(prompt), jnp.asarray(segment_ids), 1)
        for token in committed[row]:
            plain = decode_step(plain, jnp.full((batch,), token, jnp.int32))[1]
        for step, tokens in enumerate(after):
            logits, plain = decode_step(plain, jnp.full((batch,), tokens[row], jnp.int32))
            np.testing.assert_allclose(spec_logits[step][row], np.asarray(logits)[row], atol=1e-5, rtol=0)
        _assert_cache_row_equal(_batch_rows(cache, row), _batch_rows(plain, row))


def test_commit_copies_no_recurrent_state():
    """commit_verified_cache only moves each row's ring slot: the KDA rings pass through as the very input arrays,
    and no operation of the commit makes an array as large as one state per row (a take-and-copy commit would)."""
    config = _config()
    batch = 2
    cache = init_cache(config, batch, kda.verify_state_slots(K + 1))
    for i, kind in enumerate(config.layer_types):  # add what a 'verify' of K + 1 tokens leaves
        layer = cache["model"][f"layers_{i}"]["self_attn"]
        if kind == "kda":
            conv = layer["conv_state"]
            layer["verify_inputs"] = jnp.zeros((batch, conv.shape[1] + K + 1, conv.shape[2]), conv.dtype)
    accepted = jnp.zeros((batch,), jnp.int32)
    closed = jax.make_jaxpr(functools.partial(commit_verified_cache, config))(cache, accepted)
    flat_in, _ = jax.tree_util.tree_flatten_with_path((cache, accepted))
    flat_out, _ = jax.tree_util.tree_flatten_with_path(jax.eval_shape(
        functools.partial(commit_verified_cache, config), cache, accepted))
    invars, outvars = closed.jaxpr.invars, closed.jaxpr.outvars
    rings = [i for i, (path, _) in enumerate(flat_out) if "recurrent_state" in jax.tree_util.keystr(path)]
    ring_inputs = [i for i, (path, _) in enumerate(flat_in) if "recurrent_state" in jax.tree_util.keystr(path)]
    assert len(rings) == config.layer_types.count("kda") > 0
    assert [outvars[i] for i in rings] == [invars[i] for i in ring_inputs]  # the input rings, untouched
    state_elements = batch * config.kda_num_heads * config.kda_head_dim ** 2
    big = [(eqn.primitive.name, v.aval.shape) for eqn in closed.jaxpr.eqns for v in eqn.outvars
           if np.prod(v.aval.shape) >= state_elements]
    assert not big, big


def test_draft_model_proposal_copies_no_cache_buffer():
    """The draft model's k proposal steps run on its (donated) cache's own buffers: the compiled proposal holds no
    copy of a KDA state ring or an MLA latent cache (a scratch copy of the cache, reused afterwards, holds both)."""
    import re

    engine = target()
    drafter = speculative.DraftModelDrafter(engine, K)
    cache = init_cache(engine.config, 2, speculative.state_slots(K))
    propose = jax.jit(lambda params, cache, last: drafter.propose(params, cache, last, None, None), donate_argnums=1)
    hlo = propose.lower(engine.params, cache, jnp.zeros((2,), jnp.int32)).compile().as_text()
    layers = [layer["self_attn"] for layer in cache["model"].values()]
    shapes = {leaf.shape for attn in layers for name, leaf in attn.items() if name in ("recurrent_state", "latent")}
    assert len(shapes) == 2, shapes
    copies = [line.strip()[:120] for line in hlo.splitlines() for shape in shapes
              if re.search(rf"\[{','.join(map(str, shape))}\]\S* copy\(", line)]
    assert not copies, copies


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
    drafts, _ = drafter.propose((), (), jnp.array([2, 6, 0]), history, jnp.array([9, 6, 6]))
    assert np.asarray(drafts).tolist() == [[3, 9, 1, 2, 3], [5, 6, 5, 6, 5], [0, 0, 0, 0, 0]]


# ----------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize("overrides, message", [
    ({"speculative": "tree"}, "allowed values: none, ngram, draft_model"),
    ({"speculative": "ngram", "temperature": 0.7}, "greedy only"),
    ({"speculative": "ngram", "temperature": 0.0, "num_draft_tokens": 0}, r"num_draft_tokens is 0; it must be in \[1, 16\]"),
    ({"num_draft_tokens": 17}, r"\[1, 16\]"),
    ({"speculative_topk": 2}, "tree drafts are not supported"),
    ({"speculative": "draft_model", "temperature": 0.0}, "needs draft_config_path"),
    ({"verify_checkpoint_dtype": "bfloat16"},
     r"'verify_checkpoint_dtype' is 'bfloat16'; allowed values: float32 \(.*committed fp32 state\)"),
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
