"""KDA kernels: chunked vs the naive oracle, the oracle vs HF's torch recurrence, packs, and the dispatcher."""

import logging

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

from MaxText.kernels import kda as kda_kernels
from MaxText.kernels.kda import chunked_kda, naive_recurrent_kda
from tests.kda_inputs import assert_close, random_kda_inputs


def run_both(inputs, **kwargs):
    naive = naive_recurrent_kda(**inputs, output_final_state=True, **kwargs)
    chunked = chunked_kda(**inputs, output_final_state=True, **kwargs)
    return naive, chunked


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_chunked_matches_naive(seq_len, with_initial_state):
    inputs = random_kda_inputs(np.random.default_rng(seq_len), 2, seq_len, 3, 32, 32)
    if not with_initial_state:
        inputs.pop("initial_state")
    (o_ref, s_ref), (o, s) = run_both(inputs, use_qk_l2norm_in_kernel=True)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("head_k,head_v", [(48, 48), (64, 32), (16, 64)])
def test_chunked_head_dims_and_gate_in_kernel(head_k, head_v):
    inputs = random_kda_inputs(np.random.default_rng(head_k), 1, 130, 2, head_k, head_v, raw_gate=True)
    (o_ref, s_ref), (o, s) = run_both(inputs, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunked_chunk_sizes(chunk_size):
    inputs = random_kda_inputs(np.random.default_rng(chunk_size), 1, 200, 2, 32, 32)
    (o_ref, s_ref), (o, s) = run_both(inputs, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


def test_very_negative_gates_do_not_overflow():
    """Every channel decays by e^-20 per step: a factored exp(G_i) * exp(-G_j) would overflow to inf / nan."""
    inputs = random_kda_inputs(np.random.default_rng(1), 1, 128, 2, 32, 32)
    inputs["g"] = np.full_like(inputs["g"], -20.0)
    (o_ref, s_ref), (o, s) = run_both(inputs, use_qk_l2norm_in_kernel=True)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("beta", [0.5, 0.99])
def test_near_identical_keys_stay_exact(beta):
    """Repetitive text: every key nearly the same, large beta, almost no decay. Then A_kk is close to beta times the
    all-ones lower triangle, whose powers grow like binomials (~1e17 at the 32nd); a solve that forms such powers
    (the nilpotent product) returns garbage in fp32 (it did: errors of 5e4 to 3e21 x the output scale). Both the
    chunked kernel and the Pallas prefill (interpret mode) must stay at fp32 accuracy."""
    from MaxText.kernels.kda import pallas_ops
    rng = np.random.default_rng(7)
    B, T, H, K = 1, 130, 2, 32
    k = np.tile(rng.standard_normal(K), (B, T, H, 1)) + 0.01 * rng.standard_normal((B, T, H, K))
    inputs = dict(q=rng.standard_normal((B, T, H, K)), k=k, v=rng.standard_normal((B, T, H, K)),
                  g=np.full((B, T, H, K), -1e-3), beta=np.full((B, T, H), beta))
    inputs = {name: jnp.asarray(x, jnp.float32) for name, x in inputs.items()}
    (o_ref, s_ref), (o, s) = run_both(inputs, use_qk_l2norm_in_kernel=True)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    o_pallas, _ = pallas_ops.chunk_kda(**inputs, use_qk_l2norm_in_kernel=True, interpret=True)
    assert_close(o_pallas, o_ref)


@pytest.mark.parametrize("lengths", [[5, 17, 1, 41], [64, 0, 65, 3], [130]])
def test_packed_sequences(lengths):
    """cu_seqlens packs: each sequence restarts from its own initial state; equals running each alone."""
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs = random_kda_inputs(np.random.default_rng(len(lengths)), 1, int(cu[-1]), 2, 32, 32,
                               num_states=len(lengths))
    (o_ref, s_ref), (o, s) = run_both(inputs, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    for n in range(len(lengths)):
        alone = {name: value[:, cu[n]:cu[n + 1]] for name, value in inputs.items() if name != "initial_state"}
        o_n, s_n = naive_recurrent_kda(**alone, initial_state=inputs["initial_state"][n:n + 1],
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        if lengths[n]:
            assert_close(o_ref[:, cu[n]:cu[n + 1]], o_n)
        assert_close(s_ref[n], s_n[0])


def test_naive_matches_hf_torch_recurrence():
    """The oracle itself agrees with HF transformers' reference recurrence."""
    inputs = random_kda_inputs(np.random.default_rng(7), 2, 50, 2, 32, 16)
    o, s = naive_recurrent_kda(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hf, s_hf = recurrent_kimi_delta_attention(
        *(torch.tensor(inputs[n]) for n in ("q", "k", "v", "g", "beta")),
        initial_state=torch.tensor(inputs["initial_state"]), output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close(o, o_hf.numpy())
    assert_close(s, s_hf.numpy())


def test_bad_inputs_name_the_problem():
    inputs = random_kda_inputs(np.random.default_rng(0), 2, 8, 2, 16, 16)
    with pytest.raises(ValueError, match=r"beta must be \[B, T, H\]"):
        naive_recurrent_kda(**{**inputs, "beta": inputs["beta"][..., :1]})
    with pytest.raises(ValueError, match="initial_state must be"):
        chunked_kda(**{**inputs, "initial_state": inputs["initial_state"][:1]})
    with pytest.raises(ValueError, match="batch size 1"):
        chunked_kda(**inputs, cu_seqlens=np.array([0, 8]))
    single = {name: value[:1] for name, value in inputs.items()}
    with pytest.raises(ValueError, match="must start at 0, end at T=8"):
        chunked_kda(**single, cu_seqlens=np.array([0, 5]))
    with pytest.raises(ValueError, match="needs A_log and dt_bias"):
        naive_recurrent_kda(**inputs, use_gate_in_kernel=True)


def test_dispatcher_on_cpu(caplog):
    inputs = random_kda_inputs(np.random.default_rng(3), 1, 20, 2, 16, 16)
    kda_kernels._logged.clear()
    with caplog.at_level(logging.INFO, logger="MaxText.kernels.kda"):
        o_auto, _ = kda_kernels.chunk_kda(**inputs, implementation="auto")
        kda_kernels.chunk_kda(**inputs, implementation="auto")
    fallbacks = [r.getMessage() for r in caplog.records if "kda_kernel=auto" in r.getMessage()]
    assert len(fallbacks) == 1 and "prefill uses chunked" in fallbacks[0], fallbacks
    o_chunked, _ = kda_kernels.chunk_kda(**inputs, implementation="chunked")
    np.testing.assert_array_equal(np.asarray(o_auto), np.asarray(o_chunked))
    assert kda_kernels.resolve("auto", "decode", 16, 16) == "naive"
    with pytest.raises(RuntimeError, match="kda_kernel=pallas was requested"):
        kda_kernels.chunk_kda(**inputs, implementation="pallas")
    with pytest.raises(ValueError, match="unknown"):
        kda_kernels.chunk_kda(**inputs, implementation="fast")


def test_output_dtype_follows_q_and_state_is_fp32():
    inputs = random_kda_inputs(np.random.default_rng(4), 1, 40, 2, 16, 16)
    bf16 = {n: jnp.asarray(v, jnp.bfloat16) if n in ("q", "k", "v") else v for n, v in inputs.items()}
    o, s = chunked_kda(**bf16, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32


def test_segment_ids_restart_the_state():
    """Rows packing several documents: each document's outputs equal running it alone from a zero state."""
    lengths = [[20, 45, 1, 34], [100]]
    seq_len = 100
    inputs = random_kda_inputs(np.random.default_rng(11), 2, seq_len, 2, 32, 32)
    segment_ids = np.stack([np.repeat(np.arange(1, len(row) + 1), row) for row in lengths]).astype(np.int32)
    (o_ref, s_ref), (o, s) = run_both(inputs, use_qk_l2norm_in_kernel=True, segment_ids=segment_ids, chunk_size=32)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    start = 0
    for n, length in enumerate(lengths[0]):
        alone = {name: value[:1, start:start + length] for name, value in inputs.items() if name != "initial_state"}
        state = inputs["initial_state"][:1] if n == 0 else None
        o_n, s_n = naive_recurrent_kda(**alone, initial_state=state, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
        assert_close(o[:1, start:start + length], o_n)
        start += length
    assert_close(s[0], s_n[0])
