"""The inference engine on a random tiny model: batching, caching, stopping, sampling, request validation, loading."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import checkpointing, pyconfig
from MaxText.inference.engine import Engine
from MaxText.inference.sampling import SamplingParams, filter_logits, sample
from MaxText.layers.models import KimiLinearForCausalLM

TINY = "configs/kimi_linear_tiny.yml"
OVERRIDES = {"param_init_std": 0.08, "kda_kernel": "chunked", "kda_chunk_size": 32, "max_target_length": 128}
NEW_TOKENS = 12
BATCH_LENGTHS = (3, 21, 70)  # generation tests share these shapes, so they share compiled prefill / decode steps


@functools.lru_cache(maxsize=None)
def engine() -> Engine:
    """A random-init tiny Kimi-Linear (3 KDA layers + 1 MLA, dense then MoE MLPs), fp32."""
    config = pyconfig.load_config(TINY, OVERRIDES)
    params = KimiLinearForCausalLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32),
                                                model_mode="train")
    return Engine(config, params)


def _prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 260, n).tolist() for n in lengths]


def test_batched_generation_equals_per_prompt_generation():
    prompts = _prompts(*BATCH_LENGTHS)  # the batch is padded to a longer bucket than the short prompts alone
    batched = engine().generate(prompts, NEW_TOKENS)
    assert [len(row) for row in batched] == [NEW_TOKENS] * 3
    stats = engine().last_stats
    assert stats.prefill_tokens == sum(BATCH_LENGTHS) and stats.decode_tokens == 3 * NEW_TOKENS
    assert stats.prefill_tokens_per_second > 0 and stats.decode_tokens_per_second > 0
    for prompt, row in zip(prompts, batched):
        assert engine().generate([prompt], NEW_TOKENS)[0] == row


def test_cached_generation_equals_full_forward_argmax():
    """Prefill + decode (KDA conv / recurrent state, MLA latent cache) == re-running the whole sequence each step."""
    prompt = _prompts(17, seed=1)[0]
    generated = engine().generate([prompt], NEW_TOKENS)[0]
    sequence = list(prompt)
    for _ in range(NEW_TOKENS):
        sequence.append(int(np.argmax(engine().logits([sequence])[0, -1])))
    assert generated == sequence[len(prompt):]


def test_logits_do_not_depend_on_the_compile_bucket():
    tokens = _prompts(90, seed=2)[0]
    long = engine().logits([tokens])
    short = engine().logits(tokens[:5])  # a flat list is one row
    assert long.shape == (1, 90, 260) and short.shape == (1, 5, 260) and long.dtype == np.float32
    np.testing.assert_allclose(short[0], long[0, :5], rtol=1e-5, atol=1e-5)


def test_each_row_stops_at_its_first_eos():
    prompts = _prompts(*BATCH_LENGTHS, seed=3)
    free = engine().generate(prompts, NEW_TOKENS)
    eos = free[1][4]  # row 1 stops after 5 tokens; the others stop at their own first occurrence, if any
    stopped = engine().generate(prompts, NEW_TOKENS, eos_id=eos)
    for row, full in zip(stopped, free):
        expected = full[:full.index(eos) + 1] if eos in full else full
        assert row == expected
    assert len(stopped[1]) <= 5 and stopped[1][-1] == eos


def test_sampling_is_seeded_and_filters_reduce_to_greedy():
    prompts = _prompts(*BATCH_LENGTHS, seed=4)
    greedy = engine().generate(prompts, NEW_TOKENS)
    sampled = engine().generate(prompts, NEW_TOKENS, temperature=1.0, seed=7)
    assert engine().generate(prompts, NEW_TOKENS, temperature=1.0, seed=7) == sampled
    assert engine().generate(prompts, NEW_TOKENS, temperature=1.0, seed=8) != sampled
    assert engine().generate(prompts, NEW_TOKENS, temperature=1.0, top_k=1, seed=7) == greedy
    assert engine().generate(prompts, NEW_TOKENS, temperature=0.7, top_p=1e-6, seed=7) == greedy


def test_filter_logits_keeps_top_k_and_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    top2 = filter_logits(logits, SamplingParams(1.0, top_k=2))
    assert np.isfinite(np.asarray(top2)).tolist() == [[True, True, False, False, False]]
    nucleus = filter_logits(logits, SamplingParams(1.0, top_p=0.8))  # 0.5 + 0.2 < 0.8: the third token is needed
    assert np.isfinite(np.asarray(nucleus)).tolist() == [[True, True, True, False, False]]
    draws = sample(jnp.repeat(logits, 2000, axis=0), jax.random.PRNGKey(0), SamplingParams(1.0, top_p=0.8))
    assert set(np.asarray(draws).tolist()) == {0, 1, 2}


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(prompts=[[1, 2], []], max_new_tokens=4), "prompt 1 is empty"),
    (dict(prompts=[], max_new_tokens=4), "non-empty list"),
    (dict(prompts=[[1, 2, 260]], max_new_tokens=4), "token id 260 at position 2"),
    (dict(prompts=[[-1]], max_new_tokens=4), "token id -1"),
    (dict(prompts=[[1] * 100], max_new_tokens=29), "129 > max_target_length=128"),
    (dict(prompts=[[1]], max_new_tokens=4, top_p=1.5), "top_p=1.5"),
    (dict(prompts=[[1]], max_new_tokens=4, top_k=0, temperature=1.0), "top_k=0"),
    (dict(prompts=[[1]], max_new_tokens=4, temperature=-1.0), "temperature=-1.0"),
    (dict(prompts=[[1]], max_new_tokens=4, eos_id=999), "eos_id=999"),
])
def test_bad_requests_fail_before_any_compute(request_kwargs, message, monkeypatch):
    eng = engine()

    def no_compute(*args, **kwargs):
        raise AssertionError("compute ran before the request was validated")

    monkeypatch.setattr(eng, "_prefill", no_compute)
    monkeypatch.setattr(eng, "_decode", no_compute)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        eng.generate(**request_kwargs)


def test_bad_logits_requests_fail_before_any_compute(monkeypatch):
    eng = engine()
    monkeypatch.setattr(eng, "_forward", lambda *a, **k: pytest.fail("compute ran"))
    with pytest.raises(ValueError, match="token id 300 at position 1"):
        eng.logits([[5, 300]])
    with pytest.raises(ValueError, match=r"shape \(1, 0\)"):
        eng.logits([[]])


def test_params_are_checked_against_the_config():
    eng = engine()
    bad = jax.tree_util.tree_map(lambda x: x, eng.params)
    bad["model"]["layers_3"]["self_attn"]["kv_b_proj"]["kernel"] = np.zeros((7, 7), np.float32)
    with pytest.raises(ValueError, match=r"model/layers_3/self_attn/kv_b_proj/kernel has shape \(7, 7\)"):
        Engine(eng.config, bad)
    del bad["lm_head"]
    with pytest.raises(ValueError, match="missing.*lm_head/kernel"):
        Engine(eng.config, bad)


def test_from_checkpoint_loads_what_was_saved(tmp_path):
    eng = engine()
    checkpointing.save_params(str(tmp_path / "ckpt"), {"params": eng.params}, eng.config)
    loaded = Engine.from_checkpoint(str(tmp_path / "ckpt"), kda_kernel="chunked", kda_chunk_size=32,
                                    max_target_length=128)
    tokens = _prompts(13, seed=5)
    np.testing.assert_array_equal(loaded.logits(tokens), eng.logits(tokens))
    with pytest.raises(ValueError, match="emb_dim: checkpoint 64, config 32"):
        Engine.from_checkpoint(str(tmp_path / "ckpt"), emb_dim=32)


def test_decode_graph_scheduling_reaches_the_decode_compile_and_keeps_the_tokens(monkeypatch):
    """`decode_graph_scheduling` becomes the decode program's XLA option (GPU CUDA-graph order; CPU ignores it)."""
    prompt = _prompts(17, seed=1)
    reference = engine().generate(prompt, NEW_TOKENS)
    options, real_jit = [], jax.jit

    def recording_jit(fn, **kwargs):
        options.append(kwargs.get("compiler_options"))
        return real_jit(fn, **kwargs)

    monkeypatch.setattr(jax, "jit", recording_jit)
    config = pyconfig.load_config(TINY, {**OVERRIDES, "decode_graph_scheduling": "serialize"})
    assert Engine(config, engine().params).generate(prompt, NEW_TOKENS) == reference
    decode_options = [o for o in options if o and "xla_gpu_command_buffer_scheduling_mode" in o]
    assert decode_options and all(o["xla_gpu_command_buffer_scheduling_mode"] == "SERIALIZE" for o in decode_options)
    # decode_loop_graphs (default true): the loop's WHILE / CONDITIONAL commands recorded into the CUDA graphs
    assert all("WHILE" in o["xla_gpu_enable_command_buffer"].split(",") for o in decode_options)


@pytest.mark.parametrize("unroll", [1, 5])
def test_decode_loop_unroll_keeps_every_token_and_each_rows_eos(unroll):
    """N decode steps per loop iteration, then single steps: the same tokens, the same stops, max_new_tokens kept
    (against the default, 2)."""
    assert engine().config.decode_loop_unroll == 2
    config = pyconfig.load_config(TINY, {**OVERRIDES, "decode_loop_unroll": unroll})
    unrolled = Engine(config, engine().params)
    prompts = _prompts(*BATCH_LENGTHS, seed=3)
    free = engine().generate(prompts, NEW_TOKENS)
    assert unrolled.generate(prompts, NEW_TOKENS) == free
    assert unrolled.last_stats.decode_tokens == 3 * NEW_TOKENS  # no step past max_new_tokens
    eos = free[1][4]
    assert unrolled.generate(prompts, NEW_TOKENS, eos_id=eos) == engine().generate(prompts, NEW_TOKENS, eos_id=eos)


def test_profile_dir_traces_the_decode_loop_and_keeps_the_tokens(tmp_path):
    """generate(profile_dir=...) writes a jax.profiler trace holding the decode loop's program (not the prefill's),
    with the same tokens as an untraced call."""
    from jax.profiler import ProfileData

    from MaxText.inference.engine import DECODE_PROGRAM

    prompts = _prompts(*BATCH_LENGTHS)
    reference = engine().generate(prompts, NEW_TOKENS)
    assert engine().generate(prompts, NEW_TOKENS, profile_dir=str(tmp_path)) == reference
    stats = engine().last_stats
    assert stats.decode_tokens == len(prompts) * NEW_TOKENS and stats.decode_seconds > 0
    traces = list(tmp_path.rglob("*.xplane.pb"))
    assert len(traces) == 1, traces
    modules = {str(dict(event.stats).get("hlo_module", "")).split("(")[0]
               for plane in ProfileData.from_file(str(traces[0])).planes for line in plane.lines
               for event in line.events}
    assert DECODE_PROGRAM in modules, modules
    assert not any(module.startswith("jit__prefill_fn") for module in modules), modules
