"""benchmarks/model_decode.py: the decode-bytes roofline model by hand, the profile parsing helpers, and the whole
script end to end on the tiny config (CPU)."""

import json
import os
import statistics
import subprocess
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import model_decode
from MaxText import pyconfig
from MaxText.layers.models import KimiLinearForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "kimi_linear_tiny.yml")


def test_decode_bytes_per_step_matches_a_hand_count_on_the_tiny_config():
    # Tiny: D=64, vocab 260, 4 layers (KDA, KDA, KDA, MLA; dense MLP then 3 MoE), KDA H=2 K=V=32 W=4, MLA 2 heads
    # nope 16 rope 8 v 16 kv_lora_rank 32 no q LoRA, mlp_dim 128, 8 experts top-2 of moe_mlp_dim 32, 1 shared.
    # bf16 weights (2 bytes) with fp32 activations (4 bytes): the two itemsizes must not be mixed up.
    config = pyconfig.load_config(TINY, ["weight_dtype=bfloat16", "dtype=float32"])
    got = model_decode.decode_bytes_per_step(config, batch=2, context=10, distinct_experts_per_layer=3)
    kda_layer = (3 * 64 * 64 + 3 * 4 * 64      # q/k/v proj, q/k/v conv
                 + 64 * 32 + 32 * 64 + 2 + 64  # f_a, f_b, A_log, dt_bias
                 + 64 * 2                      # b_proj
                 + 64 * 32 + 32 * 64 + 32      # g_a, g_b, o_norm
                 + 64 * 64)                    # o_proj
    assert kda_layer == 25570
    mla_layer = 64 * 2 * 24 + 64 * 40 + 32 + 32 * 2 * 32 + 2 * 16 * 64  # q, kv_a, kv_a_norm, kv_b, o
    assert mla_layer == 9760
    want = {
        "embedding_rows": 2 * 64 * 2,
        "lm_head": 64 * 260 * 2,
        "norms": 9 * 64 * 2,
        "kda_weights": 3 * 25570 * 2,
        "mla_weights": 9760 * 2,
        "dense_mlp": 3 * 64 * 128 * 2,
        "router": 3 * (64 * 8 * 2 + 8 * 4),  # fp32 correction bias
        "shared_experts": 3 * (3 * 64 * 32) * 2,
        "routed_experts": 3 * 3 * (3 * 64 * 32) * 2,  # 3 MoE layers x 3 distinct experts
        "kda_state": 3 * 2 * 2 * (2 * 32 * 32) * 4,  # read + write, 2 rows, fp32
        "kda_conv_state": 3 * 2 * 2 * (3 * 3 * 64) * 4,  # read + write of [B, W-1, 3*H*K] fp32
        "mla_latent_cache": 1 * 2 * 10 * 40 * 4,
    }
    want["total"] = sum(want.values())
    assert got == pytest.approx(want)
    assert want["total"] == 536_556
    per_layer = model_decode.decode_bytes_per_step(config, 2, 10, [3, 3, 3])
    assert per_layer == pytest.approx(got)
    with pytest.raises(ValueError, match="3 MoE layers"):
        model_decode.decode_bytes_per_step(config, 2, 10, [3, 3])

    # Every weight once (all experts, the whole embedding table) is exactly the model's param bytes.
    everything = model_decode.decode_bytes_per_step(config, 260, 0, config.num_experts)
    model = KimiLinearForCausalLM(config)
    params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32),
                                                        model_mode="train"))["params"])
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    state = ("kda_state", "kda_conv_state", "mla_latent_cache", "total")
    assert sum(v for k, v in everything.items() if k not in state) == param_bytes

    assert model_decode.expected_distinct_experts(8, 2, 1) == pytest.approx(2.0)
    assert model_decode.expected_distinct_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))  # 3.5
    assert model_decode.expected_distinct_experts(256, 8, 64) == pytest.approx(222.44, abs=0.01)


def test_profile_helpers_name_ops_by_model_component():
    config = pyconfig.load_config(TINY)  # layers: kda, kda, kda, mla; mlp: dense, moe, moe, moe
    component = lambda op_name: model_decode.model_component(op_name, config)  # noqa: E731
    root = "jit(decode_step)/KimiLinearForCausalLM/"
    assert component(root + "model/layers_1/mlp/experts/mk,mkn->mn/dot_general") == "moe/experts"
    assert component(root + "model/layers_0/mlp/down_proj/dot_general") == "dense/down_proj"
    assert component(root + "model/layers_3/self_attn/bthr,bsr->bhts/dot_general") == "mla"
    assert component(root + "model/layers_2/self_attn/self_attn._update_cache_and_output/self_attn._output/"
                            "o_proj/dot_general") == "kda/o_proj"
    assert component(root + "model/layers_2/input_layernorm/mul") == "layer norms"
    assert component(root + "lm_head/dot_general") == "lm_head"
    assert component("jit(decode_step)/argmax") == "outside the model (sampling, ...)"
    hlo = ('  %fusion.3 = f32[2]{0} fusion(%p), kind=kLoop, calls=%c, metadata={op_name="jit(f)/lm_head/mul"}\n'
           '  ROOT %wrapped_convert.5 = f32[64,8]{1,0} fusion(%params__model____layers_1____mlp____gate____kernel__.1)'
           ', kind=kLoop\n'
           '%fused_computation.3 (param_0: f32[2]) -> f32[2] {\n')
    names = model_decode.hlo_op_names(hlo)
    assert names == {"fusion.3": "jit(f)/lm_head/mul", "wrapped_convert.5": "model/layers_1/mlp/gate/kernel/(param)"}
    assert component(names["wrapped_convert.5"]) == "moe/gate"
    # Nested host events: a parent's own time excludes its children (and grandchildren only once).
    assert model_decode._exclusive([(0, 10), (2, 3), (3, 1), (12, 4)]) == [7, 2, 1, 4]
    # Kernels side by side (a concurrent CUDA graph) cover their union once: [0, 10) and [12, 20).
    assert model_decode.covered_time([(12, 16), (0, 10), (2, 5), (15, 20), (3, 4)]) == 18
    # Each kernel's share of that time: alone its own time, side by side an equal part of the overlap.
    shares = model_decode.shared_time([(0, 10), (5, 15), (15, 16), (20, 22), (20, 22)])
    assert shares == [7.5, 7.5, 1.0, 1.0, 1.0] and sum(shares) == model_decode.covered_time(
        [(0, 10), (5, 15), (15, 16), (20, 22)])


# Config overrides and XLA options of the decode step's compile (accepted, and without effect, on CPU; a boolean one
# written as true, which XLA takes only as a Python bool).
VARIANT = ("fused_projections=false,decode_graph_scheduling=serialize,xla_gpu_autotune_level=0,"
           "xla_gpu_enable_pdl=true,steps_per_call=2")
ENGINE_VARIANT = "decode_loop_graphs=false,decode_loop_unroll=1"  # an Engine variant: config keys only


def test_smoke_run_end_to_end_on_cpu(tmp_path):
    xla_flags = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()  # compiles faster
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "model_decode.py"), "--smoke", "--out",
                           str(tmp_path), "--decode-variants", "", VARIANT, "--trace-dir",
                           str(tmp_path / "traces"), "--engine-variants", "", ENGINE_VARIANT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "model_decode.json").read_text())
    assert results["errors"] == {}
    assert results["env"]["xla_flags"] == xla_flags  # the JSON records the run's XLA flags
    assert set(results["stages"]) == {"copy", "init", "prefill", "decode", "engine"}
    assert results["params"]["count"] > 0 and results["copy_bandwidth"]["used_Bps"] > 0
    assert results["prefill"]["prompt_len"] == 64 and results["prefill"]["chunk"] == 32
    assert results["prefill"]["tokens_per_s"] > 0
    assert [(r["batch"], r["moe"], r["moe_impl"], r["dense_impl"], r["variant"], r["fused_projections"])
            for r in results["decode"]] == [(1, "auto", "gather", "xla", "", True),
                                            (1, "auto", "gather", "xla", VARIANT, False),
                                            (2, "auto", "gather", "xla", "", True),
                                            (2, "auto", "gather", "xla", VARIANT, False)]
    for row in results["decode"]:
        assert row["tpot_ms"] > 0 and row["roofline_ms"] > 0 and row["cache"] == "prefill"
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / row["tpot_ms"] * 1e3)
        # Issuing a block of steps ends before waiting for it: the host's share of a step is at most its time.
        assert 0 < row["dispatch_ms"] <= row["tpot_ms"]
        assert row["outputs_in_place"]  # cache, tokens and expert counts all donated and aliased
        assert isinstance(row["warmup_cache_crc32"], int)
        assert isinstance(row["warmup_tokens_crc32"], int) == (row["variant"] != VARIANT)  # steps_per_call=2: none
        # The router's choices, counted inside the step: top-2 of 8 experts for each of 3 MoE layers.
        assert len(row["distinct_experts_per_layer"]) == 3
        assert all(2 <= d <= min(8, 2 * row["batch"]) for d in row["distinct_experts_per_layer"])
        profile = row["profile"]
        assert "error" not in profile and profile["top_ops"], profile
        assert 0 < profile["covered_ms"] <= profile["busy_ms"] * (1 + 1e-9), profile  # the union, overlaps once
        assert profile["idle_ms"] == pytest.approx(profile["step_ms"] - profile["covered_ms"])  # no kernel running
        # Every op launched at least once per call (steps_per_call=2: each unrolled step's ops once in two steps);
        # the components' launches add up to the step's.
        least = 0.5 if row["variant"] == VARIANT else 1
        assert all(op["launches_per_step"] >= least for op in profile["top_ops"]), profile["top_ops"]
        assert profile["launches_per_step"] == pytest.approx(
            sum(c["launches_per_step"] for c in profile["components"]))
        # The host's share: the jitted step's calls; no CUDA graphs on CPU.
        assert profile["host"]["step_call_ms"] > 0 and profile["host"]["graph_launch_ms"] == 0, profile["host"]
        components = {c["component"] for c in profile["components"]}
        assert {"moe/experts", "kda", "mla", "lm_head"} <= components, components
        if row["variant"] == "":  # one step per call: its kernels in start order, from the lm_head's product
            timeline = profile["timeline"]
            assert timeline[0]["start_us"] == 0 and len(timeline) >= len(profile["top_ops"]), timeline
            assert [k["start_us"] for k in timeline] == sorted(k["start_us"] for k in timeline)
        assert sum(c["ops"] for c in profile["components"]) == profile["num_ops"]
        assert all(c["ops"] >= 1 for c in profile["components"])
    # A variant that changes no math (fused_projections; an XLA option of the step's compile; two steps per call)
    # leaves a bit-identical cache after the same warm-up steps; the batches' caches differ. Two steps per call give
    # no tokens crc (only every second token is seen).
    by_batch = {}
    for row in results["decode"]:
        by_batch.setdefault(row["batch"], set()).add(row["warmup_cache_crc32"])
    assert all(len(crcs) == 1 for crcs in by_batch.values()), by_batch
    assert len({crc for crcs in by_batch.values() for crc in crcs}) == 2
    # one trace folder per decode setting (batch x variant) and per Engine (variant x batch)
    assert len(os.listdir(tmp_path / "traces")) == 8
    # per batch, each setting vs its first
    assert proc.stdout.count(" (first) |") == 2 and proc.stdout.count(" (- / same) |") == 2
    # The engine stage: Engine.generate's decode loop per Engine variant and batch, 8 new tokens (7 steps) after
    # 16-token prompts, its roofline at the loop's mean context with the decode stage's expert counts of that batch
    # (its first setting).
    config = model_decode.load_benchmark_config(model_decode.parse_args(["--smoke"]))
    assert [(r["variant"], r["batch"], r["prompt_len"], r["new_tokens"]) for r in results["engine"]] == [
        ("", 1, 16, 8), ("", 2, 16, 8), (ENGINE_VARIANT, 1, 16, 8), (ENGINE_VARIANT, 2, 16, 8)]
    # Loops outside the graphs, one step per iteration, decode the same greedy tokens (the variant changes how the
    # loop is launched only).
    engine_crcs = {(r["batch"], r["variant"]): r["tokens_crc32"] for r in results["engine"]}
    assert all(engine_crcs[(b, "")] == engine_crcs[(b, ENGINE_VARIANT)] for b in (1, 2)), engine_crcs
    for row in results["engine"]:
        decode_row = next(r for r in results["decode"] if r["batch"] == row["batch"])
        assert row["distinct_experts_from"] == "decode stage"
        assert row["distinct_experts"] == decode_row["distinct_experts_mean"]
        assert row["bytes"] == pytest.approx(
            model_decode.decode_bytes_per_step(config, row["batch"], 16 + 4, row["distinct_experts"]))
        assert row["ms_per_step"] == pytest.approx(statistics.median(row["runs_ms_per_step"]))
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / row["ms_per_step"] * 1e3)
        assert row["over_roofline"] == pytest.approx(row["ms_per_step"] / row["roofline_ms"])
        assert row["prefill_ms"] > 0 and isinstance(row["tokens_crc32"], int)
        # The profile of one more call's decode loop (its program only): 7 steps' kernels per step.
        profile = row["profile"]
        assert "error" not in profile and profile["top_ops"], profile
        assert profile["steps"] == 7 and profile["step_ms"] == pytest.approx(row["ms_per_step"])
        if row["variant"] == ENGINE_VARIANT:  # (unrolled, the CPU's copies of an op are kernels of their own)
            assert profile["timeline"] and profile["timeline"][0]["start_us"] == 0, profile["timeline"]
        assert 0 < profile["covered_ms"] <= profile["busy_ms"] * (1 + 1e-9), profile
        assert profile["launches_per_step"] > 0
    for table_text in ("| TPOT / roofline | host dispatch ms | synced step ms |",
                       "### Engine.generate (one while_loop program for all decode steps)",
                       "| ops | launches / step | µs / launch |", "### Profile, batch 2, moe auto (gather)",
                       f"| 2 | auto (gather), {VARIANT} |", f"| 2 | {ENGINE_VARIANT} | 16 | 8 |",
                       f"### Profile, Engine.generate's decode loop, batch 2, {ENGINE_VARIANT}"):
        assert table_text in proc.stdout


@pytest.mark.parametrize("stages", ["init,prefill,decode", "init,decode"])
def test_a_decode_variant_with_other_cache_entries_gets_its_own_cache(tmp_path, stages):
    """A --decode-variants value whose config makes a cache entry the run's config does not (here the KDA decode's
    norm counters, kda_decode_out_norm) decodes on a cache with that entry (zeros) after a prefill or on a synthetic
    cache, instead of failing on the step's cache tree."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "model_decode.py"), "--smoke",
                           "kda_decode_out_norm=false", "--stages", stages, "--batches", "1", "--out", str(tmp_path),
                           "--decode-variants", "", "kda_decode_out_norm=true"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "model_decode.json").read_text())
    assert results["errors"] == {}
    assert [(r["variant"], r["tpot_ms"] > 0) for r in results["decode"]] == [("", True),
                                                                            ("kda_decode_out_norm=true", True)]


def test_engine_stage_needs_a_decode_step():
    with pytest.raises(SystemExit):
        model_decode.parse_args(["--smoke", "--engine-tokens", "1"])
    assert model_decode.parse_args(["--smoke", "--stages", "init,decode", "--engine-tokens", "1"]).engine_tokens == 1


def test_profile_stage_needs_decode_or_engine(capsys):
    """The profile stage traces the decode settings and the Engines: alone it has nothing to trace."""
    with pytest.raises(SystemExit):
        model_decode.parse_args(["--smoke", "--stages", "init,profile"])
    assert "add 'decode' or 'engine'" in capsys.readouterr().err
    for stages in ("init,engine,profile", "init,decode,profile"):
        assert model_decode.parse_args(["--smoke", "--stages", stages]).stages == stages.split(",")


@pytest.mark.parametrize("variant", ["steps_per_call=2", "decode_loop_graphs=false,xla_gpu_autotune_level=0"])
def test_engine_variants_take_config_keys_only(variant, capsys):
    with pytest.raises(SystemExit):
        model_decode.parse_args(["--smoke", "--engine-variants", "", variant])
    assert "apply to the decode stage's step only" in capsys.readouterr().err
    assert model_decode.parse_args(["--smoke", "--engine-variants", ENGINE_VARIANT]).engine_variants == [
        ENGINE_VARIANT]


def test_decode_variants_parse_into_config_overrides():
    assert model_decode.variant_overrides("") == {}
    assert model_decode.variant_overrides("fused_projections=true, dense_matmul=xla") == {
        "fused_projections": "true", "dense_matmul": "xla"}
    with pytest.raises(ValueError, match="expected comma-separated key=value"):
        model_decode.variant_overrides("fused_projections")
    assert model_decode.variant_config_overrides(VARIANT) == {"fused_projections": "false",
                                                             "decode_graph_scheduling": "serialize"}
    # boolean options as Python bools (XLA's parser refuses the string 'true')
    assert model_decode.variant_xla_options(VARIANT) == {"xla_gpu_autotune_level": "0", "xla_gpu_enable_pdl": True}
    assert model_decode.variant_xla_options("xla_gpu_enable_pdl=FALSE") == {"xla_gpu_enable_pdl": False}
    assert model_decode.variant_steps_per_call(VARIANT) == 2 and model_decode.variant_steps_per_call("") == 1
    with pytest.raises(ValueError, match=r"steps_per_call='0', expected an integer >= 1"):
        model_decode.variant_steps_per_call("steps_per_call=0")


def test_malformed_decode_variant_is_refused_before_any_stage(capsys):
    with pytest.raises(SystemExit):
        model_decode.parse_args(["--smoke", "--decode-variants", "", "fused_projections"])
    assert "--decode-variants: decode variant 'fused_projections': expected comma-separated key=value" in (
        capsys.readouterr().err)


def test_decode_step_writes_each_output_in_place_of_its_own_input():
    """The timed decode step returns its outputs in the order of its donated inputs (cache, tokens, expert counts),
    so each output reuses its own input's buffer and no buffer moves between steps (a moving buffer makes XLA
    re-record the step's CUDA graph on every step: the 48B step's [1] int32 leaves traded buffers that way). The
    other order is caught by `outputs_in_place`."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    args = model_decode.parse_args(["--smoke"])
    setup = model_decode.init_setup(args, {})
    config, batch = setup.config, 1
    cache = model_decode.batch_cache(setup, None, batch, args.prompt_len)
    tokens = jax.device_put(np.zeros((batch,), np.int32), setup.rows(1))
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    counts = jax.device_put(np.zeros((config.mlp_types.count("moe"),), np.int32), replicated)
    decode_step = model_decode.make_decode_step(KimiLinearForCausalLM(config), config.num_experts)
    shardings = dict(in_shardings=(setup.param_shardings, setup.cache_shardings(batch), setup.rows(1), replicated),
                     donate_argnums=(1, 2, 3))
    step, _ = setup.compile(decode_step, (setup.params, cache, tokens, counts),
                            out_shardings=(setup.cache_shardings(batch), setup.rows(1), replicated), **shardings)
    first = len(jax.tree.leaves(setup.params))
    assert model_decode.outputs_in_place(step, first)
    addresses = []
    for _ in range(3):
        cache, tokens, counts = step(setup.params, cache, tokens, counts)
        addresses.append([x.unsafe_buffer_pointer() for x in jax.tree.leaves((cache, tokens, counts))])
    assert addresses[0] == addresses[1] == addresses[2]
    # the order of the old step (tokens first): aliased, but to other same-shaped inputs
    reordered, _ = setup.compile(lambda *a: (lambda c, t, n: (t, n, c))(*decode_step(*a)),
                                 (setup.params, cache, tokens, counts),
                                 out_shardings=(setup.rows(1), replicated, setup.cache_shardings(batch)), **shardings)
    assert None not in model_decode.aliased_inputs(reordered)
    assert not model_decode.outputs_in_place(reordered, first)
    # A decode variant's XLA options reach XLA's compile of the step (an unknown one is refused there).
    with pytest.raises(Exception, match="No such compile option: 'xla_not_an_option'"):
        setup.compile(decode_step, (setup.params, cache, tokens, counts), xla_options={"xla_not_an_option": "1"},
                      out_shardings=(setup.cache_shardings(batch), setup.rows(1), replicated), **shardings)


def test_decode_step_counts_the_experts_of_the_launch_that_routed(interpreted_norm_and_router):
    """The decode step counts each MoE layer's distinct experts from the routing the layer sows, whichever launch
    routed: on one GPU at batch <= 16 `moe_router_in_norm`'s norm_and_route launch routes and the Router module is
    never called (the step counted its captured outputs before and failed there: [n_moe] counts plus nothing). The
    tiny model (bf16, the norms' and router's Pallas kernels interpreted) at batch 2: one count per MoE layer,
    each the number of distinct ids the layer's routing holds, the same with the router's own launches."""
    calls = interpreted_norm_and_router
    counted = {}
    for in_norm in (True, False):
        config = pyconfig.load_config(TINY, {"dtype": "bfloat16", "num_experts": 16, "norm_kernel": "pallas",
                                             "moe_router_kernel": "pallas", "mla_kernel": "xla",
                                             "moe_router_in_norm": in_norm})
        model = KimiLinearForCausalLM(config)
        tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, config.vocab_size)
        params = {"params": model.init(jax.random.PRNGKey(0), tokens, model_mode="train")["params"]}
        _, variables = model.apply(params, tokens, model_mode="prefill", mutable=["cache"])
        moe_layers = config.mlp_types.count("moe")
        calls.clear()
        step = jax.jit(model_decode.make_decode_step(model, config.num_experts))
        _, _, counts = step(params["params"], variables["cache"], tokens[:, -1], jnp.zeros((moe_layers,), jnp.int32))
        assert calls.count("norm_and_route") == (moe_layers if in_norm else 0)
        _, sown = model.apply({**params, "cache": variables["cache"]}, tokens[:, -1:], model_mode="autoregressive",
                              mutable=["cache", "intermediates"])
        ids = [np.asarray(layer["mlp"]["routing"][0][1]) for _, layer in sorted(
            sown["intermediates"]["model"].items(), key=lambda kv: int(kv[0].split("_")[-1])) if "mlp" in layer]
        assert len(ids) == moe_layers
        np.testing.assert_array_equal(np.asarray(counts), [len(np.unique(i)) for i in ids])
        assert all(config.num_experts_per_tok <= c <= 2 * config.num_experts_per_tok for c in np.asarray(counts))
        counted[in_norm] = np.asarray(counts)
    np.testing.assert_array_equal(counted[True], counted[False])


def test_cache_checksum_sees_every_bit_and_position():
    cache = {"state": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "latent": jnp.ones((2, 5), jnp.bfloat16),
             "index": jnp.array([7], jnp.int32), "mask": jnp.array([True, False])}
    base = model_decode.cache_checksum(cache)
    assert model_decode.cache_checksum(jax.tree.map(jnp.copy, cache)) == base
    one_bit = jax.lax.bitcast_convert_type(jnp.uint16(0x3F81), jnp.bfloat16)  # 1.0 with its lowest mantissa bit set
    assert model_decode.cache_checksum({**cache, "latent": cache["latent"].at[1, 3].set(one_bit)}) != base
    assert model_decode.cache_checksum({**cache, "state": cache["state"][::-1]}) != base  # same values, moved
    assert model_decode.cache_checksum({**cache, "mask": ~cache["mask"]}) != base


def test_device_op_times_name_many_streams_by_count():
    """A CUDA graph's kernels come on many streams: the profile's source names them by count past four; the ops'
    launches and times are read from every stream."""
    class Item:  # a trace's plane, line or event (hashable by identity, as the profiler's objects are)
        def __init__(self, **fields):
            self.__dict__.update(fields)

    def plane(streams):
        event = Item(name="fusion_1", stats=[("hlo_module", model_decode.DECODE_MODULE), ("hlo_op", "f")],
                     start_ns=0, duration_ns=1000)
        lines = [Item(name=f"Stream #{i}", events=[event]) for i in range(streams)]
        return model_decode.Trace("trace", [Item(name="/device:GPU:0", lines=lines)])

    many = model_decode.device_op_times(plane(6), model_decode.DECODE_MODULE, accelerator=True)
    assert many.source == "/device:GPU:0: 6 lines (Stream #0, ...)"
    assert many.launches == {"f": 6}
    few = model_decode.device_op_times(plane(2), model_decode.DECODE_MODULE, accelerator=True)
    assert few.source == "/device:GPU:0: Stream #0, Stream #1"


def test_dense_implementation_reports_what_the_projections_run(monkeypatch):
    """The benchmark's `dense_impl` column: on one GPU at batch 1, XLA for kernels stored out_in (the default), the
    Pallas kernel for in_out ones, XLA above DENSE_PALLAS_MAX_ROWS rows."""
    from MaxText import sharding
    from MaxText.kernels import grouped_matmul as gmm
    monkeypatch.setattr(gmm.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gmm, "pallas_unavailable_reason", lambda *a: None)
    keys = ["weight_dtype=bfloat16", "dtype=bfloat16"]
    out_in, in_out = (pyconfig.load_config(TINY, keys + [f"dense_kernel_layout={layout}"])
                      for layout in ("out_in", "in_out"))
    mesh = sharding.create_mesh(out_in)
    assert model_decode.dense_implementation(out_in, mesh, 1) == "xla"
    assert model_decode.dense_implementation(in_out, mesh, 1) == "pallas"
    assert model_decode.dense_implementation(in_out, mesh, gmm.DENSE_PALLAS_MAX_ROWS + 1) == "xla"


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_a_variant_in_the_other_dense_layout_gets_the_same_model_transposed(layout):
    """--decode-variants dense_kernel_layout=...: Setup.params_for transposes exactly the dense kernels (the other
    leaves are the setup's own arrays), with the variant's shardings; the variant's model on them gives the setup's
    logits."""
    from MaxText import sharding
    other = {"in_out": "out_in", "out_in": "in_out"}[layout]
    config, variant = (pyconfig.load_config(TINY, [f"dense_kernel_layout={value}"]) for value in (layout, other))
    mesh = sharding.create_mesh(config)
    tokens = jnp.arange(6, dtype=jnp.int32).reshape(1, 6)
    params = nn.unbox(KimiLinearForCausalLM(config).init(jax.random.key(0), tokens, model_mode="train"))["params"]
    setup = model_decode.Setup(config, mesh, sharding.param_shardings(config, mesh), params)
    assert setup.params_for(config) == (setup.params, setup.param_shardings)
    relaid, shardings = setup.params_for(variant)
    assert setup.params_for(variant)[0] is relaid  # made once
    flat_old, flat_new = (flax.traverse_util.flatten_dict(tree) for tree in (params, relaid))
    transposed = {path[1:] for path in model_decode.hf_weights.dense_kernel_paths(config)}
    assert ("lm_head", "kernel") in transposed and ("model", "layers_1", "mlp", "gate", "kernel") not in transposed
    for path, value in flat_old.items():
        if path in transposed:
            np.testing.assert_array_equal(flat_new[path], value.T)
        else:
            assert flat_new[path] is value, path
    assert jax.tree.structure(shardings) == jax.tree.structure(sharding.param_shardings(variant, mesh))
    want = KimiLinearForCausalLM(config).apply({"params": params}, tokens, model_mode="train")
    got = KimiLinearForCausalLM(variant).apply({"params": relaid}, tokens, model_mode="train")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    experts = pyconfig.load_config(TINY, [f"dense_kernel_layout={layout}", "expert_kernel_layout=out_in"])
    with pytest.raises(ValueError, match="expert_kernel_layout=out_in sets the routed experts' param shapes"):
        setup.params_for(experts)  # a second copy of the experts is not made


def test_profile_notes_add_up():
    """A profile keeps every note it is given (the Engine's loop-graphs note and the graphs-as-ops one)."""
    breakdown = {"top_ops": [{"op": "command_buffer.3"}]}
    model_decode.add_note(breakdown, model_decode.LOOP_GRAPHS_PROFILE_NOTE, "t")
    model_decode.with_graph_note(breakdown, "t")
    assert breakdown["note"] == model_decode.LOOP_GRAPHS_PROFILE_NOTE + "; " + model_decode.GRAPHS_AS_OPS_NOTE
    assert "note" not in model_decode.with_graph_note({"top_ops": [{"op": "fusion.1"}]}, "t")


def test_step_timeline_lists_the_shortest_step_between_its_marker_launches():
    """The timeline: the kernels from one launch of the kernel launched once per step with the longest mean launch
    (the lm_head's product, whose unrolled copies are two ops; 'norm' also runs once per step but shorter, 'proj'
    twice) to its next, in start order, times in µs from the step's start; of three steps the shortest (the second:
    no host gap); none where no kernel runs once per step."""
    events = []
    for step, start in enumerate((0.0, 10_000.0, 16_000.0)):  # ns; the first step waits 4 µs for the host
        late = 4_000.0 if step == 0 else 0.0
        head = f"dot.{step % 2}"  # a loop unrolled twice: two ops, one kernel
        events += [(start, 2_000.0, head, "head"), (start + 2_000 + late, 500.0, "norm", "norm"),
                   (start + 2_600 + late, 1_000.0, "proj", "proj"), (start + 2_700 + late, 900.0, "proj", "proj")]
    timeline = model_decode.step_timeline(sorted(events), steps=3)
    assert timeline == [{"op": "dot.1", "kernel": "head", "start_us": 0.0, "us": 2.0},
                        {"op": "norm", "kernel": "norm", "start_us": 2.0, "us": 0.5},
                        {"op": "proj", "kernel": "proj", "start_us": 2.6, "us": 1.0},
                        {"op": "proj", "kernel": "proj", "start_us": 2.7, "us": 0.9}]
    assert model_decode.step_timeline(sorted(events), steps=4) == []
