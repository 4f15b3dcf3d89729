"""MLA layer: parity with HF KimiLinearAttention, and the compressed latent cache (prefill / absorbed decode)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from MaxText.hf_weights import params_from_hf_state_dict
from MaxText.layers.mla import MultiHeadLatentAttention
from tests.test_model_hf_parity import hf_model, hf_state_dict, our_config

TOL = 1e-5  # x max|reference|
NO_LORA, Q_LORA = "kda2x32_mla4_e8top2", "kda4x16_mla13_qlora_e16top4g4"


@functools.lru_cache(maxsize=None)
def mla_setup(name: str):
    """(HF MLA module, our config, our layer params) for the first MLA layer of HF test config `name`."""
    model = hf_model(name)
    config = our_config(model, max_target_length=48)
    layer = config.layer_types.index("mla")
    params = params_from_hf_state_dict(hf_state_dict(model), config)["params"]["model"][f"layers_{layer}"]
    return model.model.layers[layer].self_attn, config, params["self_attn"]


def _inputs(config, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, length, config.emb_dim)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _layer_fn(config, model_mode: str):
    """A jitted (params, cache, x, segment_ids) -> (output, new cache) for one mode (cache is {} in train)."""
    layer = MultiHeadLatentAttention(config)

    def run(params, cache, x, segment_ids):
        variables = {"params": params, **({"cache": cache} if cache else {})}
        if model_mode == "train":
            return layer.apply(variables, x, model_mode=model_mode, decoder_segment_ids=segment_ids), {}
        out, mutated = layer.apply(variables, x, model_mode=model_mode, decoder_segment_ids=segment_ids,
                                   mutable=["cache"])
        return out, mutated["cache"]

    return jax.jit(run)


def _apply(config, params, x, model_mode, cache=None, segment_ids=None):
    """Returns (output, cache) for train / prefill / autoregressive."""
    return _layer_fn(config, model_mode)(params, cache or {}, jnp.asarray(x), segment_ids)


def _assert_close(got, want, tol=TOL):
    got, want = np.asarray(got), np.asarray(want)
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err <= tol * scale, f"max err {err:.3e} > {tol} x {scale:.3e}"


@pytest.mark.parametrize("name", [NO_LORA, Q_LORA])
def test_matches_hf_attention(name):
    hf_layer, config, params = mla_setup(name)
    x = _inputs(config, batch=2, length=37)
    with torch.no_grad():
        want = hf_layer(torch.tensor(x), attention_mask=None)[0].numpy()
    got, _ = _apply(config, params, x, "train")
    _assert_close(got, want)


@pytest.mark.parametrize("name", [NO_LORA, Q_LORA])
def test_prefill_then_absorbed_decode_equals_full_forward(name):
    _, config, params = mla_setup(name)
    x = _inputs(config, batch=2, length=24, seed=1)
    full, _ = _apply(config, params, x, "train")
    prefill_len = 14  # then 10 single-token latent-space decode steps
    out, cache = _apply(config, params, x[:, :prefill_len], "prefill")
    outs = [out]
    for t in range(prefill_len, x.shape[1]):
        out, cache = _apply(config, params, x[:, t:t + 1], "autoregressive", cache)
        outs.append(out)
    _assert_close(jnp.concatenate(outs, axis=1), full)
    # The cache holds only the compressed latents (c, k_rot), kv_lora_rank + rope numbers per token.
    assert cache["latent"].shape == (2, config.max_target_length, config.kv_lora_rank + config.qk_rope_head_dim)
    assert set(cache) == {"latent", "key_valid", "index"}
    assert np.asarray(cache["index"]).tolist() == [x.shape[1]] * 2  # the write index, per row
    assert np.asarray(cache["key_valid"])[:, :x.shape[1]].all() and not np.asarray(cache["key_valid"])[:, 24:].any()


def test_chunked_prefill_equals_one_prefill():
    _, config, params = mla_setup(NO_LORA)
    x = _inputs(config, batch=2, length=30, seed=2)
    whole, whole_cache = _apply(config, params, x, "prefill")
    first, cache = _apply(config, params, x[:, :11], "prefill")
    second, cache = _apply(config, params, x[:, 11:], "prefill", cache)
    _assert_close(jnp.concatenate([first, second], axis=1), whole)
    for key in whole_cache:
        np.testing.assert_allclose(np.asarray(cache[key]), np.asarray(whole_cache[key]), atol=1e-6)


def test_left_padding_is_never_attended():
    _, config, params = mla_setup(Q_LORA)
    x = _inputs(config, batch=2, length=20, seed=3)
    pad = 6
    padded = x.copy()
    padded[0, :pad] = 100.0  # garbage at the padding positions of row 0: it must not leak into the real tokens
    segment_ids = np.ones((2, 20), np.int32)
    segment_ids[0, :pad] = 0
    alone, _ = _apply(config, params, x[:1, pad:], "train")
    got, _ = _apply(config, params, padded, "train", segment_ids=jnp.asarray(segment_ids))
    _assert_close(got[0, pad:], alone[0])
    # The same through the cache: padded prefill, then decode steps must still skip the padding keys.
    out, cache = _apply(config, params, padded[:, :15], "prefill", segment_ids=jnp.asarray(segment_ids[:, :15]))
    assert not np.asarray(cache["key_valid"])[0, :pad].any()
    outs = [out]
    for t in range(15, 20):
        out, cache = _apply(config, params, padded[:, t:t + 1], "autoregressive", cache)
        outs.append(out)
    _assert_close(jnp.concatenate(outs, axis=1)[0, pad:], alone[0])
    _assert_close(jnp.concatenate(outs, axis=1)[1], got[1])


def test_packed_documents_do_not_attend_to_each_other():
    _, config, params = mla_setup(NO_LORA)
    x = _inputs(config, batch=1, length=26, seed=4)
    segment_ids = np.array([[1] * 9 + [2] * 17], np.int32)
    packed, _ = _apply(config, params, x, "train", segment_ids=jnp.asarray(segment_ids))
    first, _ = _apply(config, params, x[:, :9], "train")
    second, _ = _apply(config, params, x[:, 9:], "train")
    _assert_close(packed, jnp.concatenate([first, second], axis=1))
