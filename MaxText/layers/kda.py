"""Kimi Delta Attention (KDA): the linear-attention mixer of Kimi-Linear, as a Flax Linen block.

Reads top to bottom like the math (DESIGN.md §3; reference: HF `KimiLinearDeltaAttention`):
    q, k, v = silu(causal_depthwise_conv_W(x Wq / Wk / Wv))        three separate short convolutions
    g       = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)          per head and key channel (in the kernel)
    beta    = sigmoid(b_proj(x))                                     per head
    o       = KDA(l2norm(q) * K^-0.5, l2norm(k), v, g, beta)        fp32 state [H, K, V] per sequence
    out     = o_proj(RMSNorm_K(o) * sigmoid(g_b(g_a(x))))

Param names follow the HF checkpoint (q_proj, q_conv1d, f_a_proj, A_log, dt_bias, o_norm, ...). Decode state lives in
the `cache` collection, one decode slot per batch row:
  conv_state       [B, W-1, 3*H*K]    the last W-1 pre-convolution q|k|v inputs (activation dtype);
  recurrent_state  [B, S, H, K, V]    float32: a ring of S state slots per row (S = 1 for plain decoding);
  state_slot       [B] int32          the slot holding the row's committed state (`committed_state(cache)`);
  norm_counts      [B, H] int32       zeros (with `kda_decode_out_norm`): the packed decode kernel's counters for its
                                      output norm, left zero by each launch (no zeros made and copied per step);
  project_counts   [B, 2*H+1] int32   zeros (with `kda_decode_one_launch`): the one-launch decode's counters, likewise.
S is fixed when the cache is created (`models.init_cache(config, batch, state_slots)`; a cache created lazily by the
first prefill has S = 1) and read from the cache's shape. Prefill and one-token decode read and write the committed
slot only (S = 1: a reshape, so plain decoding costs what it did without the ring). When `kda_kernel` resolves to the
Pallas decode kernel, model_mode='autoregressive' (one token) runs the packed decode kernel with the ring as its pool
(pool row b*S + state_slot[b]): it takes the conv output, the raw gate input and the beta logit, and updates the state
in place (donate the cache to the step). With `kda_decode_one_launch` and the input norm deferred (the decoder passes
`input_norm_parts`), a batch-1 step on one GPU runs everything from the input row to the normed output in one launch
instead (`kernels.kda.project_and_decode_kda`: projections, convolution, recurrence and output norm; the layer then
computes no projection itself).

model_mode='verify' (speculative decoding) scores T draft tokens from the committed state without changing it. It
needs S >= T + 1 (`verify_state_slots(T)`): token t's post-state (float32) goes to ring slot (s + 1 + t) mod S, never
to the committed slot s (`kernels.kda.recurrent_kda_ring_checkpoints`, in place on the Pallas kernel), and the conv
inputs go to `verify_inputs` [B, W-1+T, 3*H*K] (the conv window followed by the drafts' pre-conv inputs: the window
after accepting `a` tokens is its slice [a, a+W-1)). `commit_verified(layer_cache, accepted_len)` then moves
`state_slot` to (s + a) mod S and slices the window: no recurrent state is copied.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from MaxText.kernels import kda as kda_kernels
from MaxText.kernels.kda.common import causal_conv, gated_rms_norm
from MaxText.kernels.kda.project_decode import ProjectionWeights
from MaxText.layers.linears import Dense, dense_together, scale_rows

MODEL_MODES = ("train", "prefill", "autoregressive", "verify")
# Logical axes of the cache entries (MaxText/sharding.py shards the cache by them): rows over the data axis, the
# recurrent state's heads over tensor. conv_state's channels are q|k|v concatenated, so a 1-D split of them would not
# fall on head boundaries; it is small ((W-1) * 3*H*K per row) and stays whole on each tensor shard.
CACHE_LOGICAL_AXES = {
    "conv_state": ("cache_batch", None, None),
    "recurrent_state": ("cache_batch", None, "kda_heads", None, None),  # [B, S, H, K, V]: the slots of a row together
    "state_slot": ("cache_batch",),
    "norm_counts": ("cache_batch", None),
    "project_counts": ("cache_batch", None),
    "verify_inputs": ("cache_batch", None, None),
}
HEAD_ACTIVATION_AXES = ("batch", "length", "kda_heads", None)  # q, k, v, g, o: [B, T, H, K]


def verify_state_slots(num_verify_tokens: int) -> int:
    """Ring slots per row a 'verify' of `num_verify_tokens` tokens needs: the committed state plus one per token."""
    return num_verify_tokens + 1


def read_slot(state_ring, state_slot):
    """state_ring [B, S, H, K, V], state_slot [B] -> the state in each row's slot [B, H, K, V] (S = 1: a reshape)."""
    if state_ring.shape[1] == 1:
        return state_ring[:, 0]
    return jax.vmap(lambda ring, slot: jax.lax.dynamic_index_in_dim(ring, slot, keepdims=False))(state_ring, state_slot)


def write_slot(state_ring, state_slot, state):
    """The ring with each row's slot `state_slot[b]` set to state[b] [H, K, V] (S = 1: a reshape)."""
    if state_ring.shape[1] == 1:
        return state[:, None]
    return jax.vmap(lambda ring, slot, new: jax.lax.dynamic_update_index_in_dim(ring, new, slot, 0))(
        state_ring, state_slot, state)


def zero_cache(cache, state_slots: int = 1):
    """Zeros shaped like `cache` (a tree of arrays or ShapeDtypeStructs: one KDA layer's cache or a whole model's),
    except that every KDA `recurrent_state` becomes a ring of `state_slots` slots per row, [B, S, H, K, V] float32.
    An empty cache: each row's committed state is slot 0 (`state_slot` zeros) and all zero."""
    def zeros(path, leaf):
        shape = tuple(leaf.shape)
        if str(getattr(path[-1], "key", path[-1])) == "recurrent_state":
            shape = (shape[0], state_slots) + shape[2:]
        return jnp.zeros(shape, leaf.dtype)

    return jax.tree_util.tree_map_with_path(zeros, cache)


def committed_state(layer_cache):
    """The committed recurrent state [B, H, K, V] float32 of a KDA layer's cache (the ring's slot `state_slot`)."""
    return read_slot(layer_cache["recurrent_state"], layer_cache["state_slot"])


def dt_bias_init(key, shape, dtype=jnp.float32, dt_min=1e-3, dt_max=1e-1):
    """softplus^-1 of a log-uniform dt in [dt_min, dt_max] (fla / HF initialization)."""
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(dt_min), math.log(dt_max)))
    dt = jnp.maximum(dt, 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def a_log_init(key, shape, dtype=jnp.float32):
    """log of a uniform decay rate in [1, 16] per head (fla / HF initialization)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


class ShortConvKernel(nn.Module):
    """The [W, C] depthwise kernel of one short convolution (HF Conv1d weight [C, 1, W], transposed)."""

    width: int
    channels: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self):
        init = nn.with_logical_partitioning(nn.initializers.normal(self.width ** -0.5), (None, "kda_qkv"))
        return self.param("kernel", init, (self.width, self.channels), self.param_dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last axis times sigmoid(gate), all in float32 (HF KimiLinearRMSNormGated)."""

    features: int
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):  # (setup, not compact: the decode kernel reads `scale` without the module's call)
        self.scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (None,)),
                                (self.features,), self.param_dtype)

    def __call__(self, x, gate):
        return gated_rms_norm(x, gate, self.scale, self.eps)


class KimiDeltaAttention(nn.Module):
    """KDA mixer. `__call__(x [B, T, D], model_mode, decoder_segment_ids=None) -> [B, T, D]` in `config.dtype`."""

    config: ml_collections.FrozenConfigDict

    def _dense(self, features, logical_axes, name):
        return Dense(self.config, features, logical_axes, name=name)

    def _param(self, name, init, shape, logical_axes):
        return self.param(name, nn.with_logical_partitioning(init, logical_axes), shape,
                          jnp.dtype(self.config.weight_dtype))

    @nn.compact
    def __call__(self, x, *, model_mode: str, decoder_segment_ids=None, input_row_scale=None, input_norm_parts=None):
        """`input_row_scale` [B, T, 1] float32 (the input norm deferred: RMSNorm(deferred=True)): each projection of
        x is multiplied by it, as if x had been multiplied by it first. `input_norm_parts` (residual [B, T, D], the
        input norm's scale [D]): where x and input_row_scale came from, for `kda_decode_one_launch`."""
        cfg = self.config
        if model_mode not in MODEL_MODES:
            raise ValueError(f"model_mode={model_mode!r}; the KDA layer supports {MODEL_MODES}")
        num_heads, head_dim, width = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel_size
        qkv_dim = num_heads * head_dim
        batch, seq_len, _ = x.shape
        dtype = jnp.dtype(cfg.dtype)
        x = x.astype(dtype)
        if decoder_segment_ids is not None:  # padding tokens contribute nothing: a zero input keeps a zero state
            x = jnp.where((decoder_segment_ids != 0)[..., None], x, jnp.zeros_like(x))

        if model_mode == "train":
            window = jnp.zeros((batch, width - 1, 3 * qkv_dim), dtype)
            conv_state = state_ring = state_slot = norm_counts = project_counts = None
        else:  # created lazily with one ring slot; models.init_cache creates more
            conv_state = self.variable("cache", "conv_state", jnp.zeros, (batch, width - 1, 3 * qkv_dim), dtype)
            state_ring = self.variable("cache", "recurrent_state", jnp.zeros,
                                       (batch, 1, num_heads, head_dim, head_dim), jnp.float32)
            state_slot = self.variable("cache", "state_slot", jnp.zeros, (batch,), jnp.int32)
            norm_counts = (self.variable("cache", "norm_counts", jnp.zeros, (batch, num_heads), jnp.int32)
                           if cfg.kda_decode_out_norm else None)
            project_counts = (self.variable("cache", "project_counts", jnp.zeros, (batch, 2 * num_heads + 1),
                                            jnp.int32) if cfg.kda_decode_one_launch else None)
            window = conv_state.value
        if (project_counts is not None and input_norm_parts is not None and model_mode == "autoregressive"
                and seq_len == 1 and not self.is_initializing() and cfg.dense_kernel_layout == "out_in"
                and kda_kernels.one_launch_decode_reason(cfg.kda_kernel, batch, x.shape[-1], num_heads, head_dim,
                                                         head_dim) is None):
            # (before any projection here: the launch computes them all from the residual row)
            return self._decode_in_one_launch(input_norm_parts, conv_state, state_ring, state_slot, project_counts)

        # Projections and the three short convolutions (one fused depthwise conv over q|k|v channels).
        qkv_pre = scale_rows(jnp.concatenate(
            dense_together(cfg, x, qkv_dim, ("embed", "kda_qkv"), ("q_proj", "k_proj", "v_proj")), axis=-1),
            input_row_scale)  # [B, T, 3*H*K]
        conv_kernel = jnp.concatenate([ShortConvKernel(width, qkv_dim, jnp.dtype(cfg.weight_dtype), name=name)()
                                       for name in ("q_conv1d", "k_conv1d", "v_conv1d")], axis=-1)  # [W, 3*H*K]
        # Packed training rows restart the convolution and the recurrence at each document boundary; in prefill,
        # zeroed (left-)padding already leaves the zero state untouched.
        train_segments = decoder_segment_ids if model_mode == "train" else None
        conv_out, new_window = causal_conv(qkv_pre, window, conv_kernel, train_segments)
        mixed_qkv = jax.nn.silu(conv_out).astype(dtype)  # [B, T, 3*H*K]: q | k | v, heads in order within each

        # Forget gate input (the gate itself is computed in the kernel), the delta-rule step size's logit, and the
        # output gate's low-rank input (used by `_output`; projected here with f_a, the same shape).
        f_a, g_a = (scale_rows(y, input_row_scale)
                    for y in dense_together(cfg, x, head_dim, ("embed", None), ("f_a_proj", "g_a_proj")))  # [B, T, K]
        g_raw = self._dense(qkv_dim, (None, "kda_qkv"), "f_b_proj")(f_a)  # [B, T, H*K]
        A_log = self._param("A_log", a_log_init, (num_heads,), ("kda_heads",))
        dt_bias = self._param("dt_bias", dt_bias_init, (qkv_dim,), ("kda_qkv",))
        beta_logit = scale_rows(self._dense(num_heads, ("embed", "kda_heads"), "b_proj")(x),
                                input_row_scale)  # [B, T, H]

        if (model_mode == "autoregressive" and seq_len == 1
                and kda_kernels.resolve(cfg.kda_kernel, "decode", head_dim, head_dim) == "pallas"):
            # Serving decode: the packed kernel takes the conv output, raw gate and beta logit as they are and updates
            # the cache's state in place (the pool is the ring itself, row b's committed state at pool row
            # b*S + state_slot[b]; donate the cache to the jitted step for a true in-place update).
            ring = state_ring.value
            num_slots = ring.shape[1]
            pool_rows = jnp.arange(batch, dtype=jnp.int32) * num_slots + state_slot.value
            # With kda_decode_out_norm the kernel also applies the output norm (gate and scale as inputs), counting
            # a head's value blocks on the cache's norm_counts.
            out_norm = dict(out_gate=self._out_gate(g_a)[:, 0], out_norm_scale=self._out_norm().scale,
                            out_norm_eps=cfg.normalization_layer_epsilon,
                            norm_counts=norm_counts.value) if cfg.kda_decode_out_norm else {}
            o, pool, *counts = kda_kernels.packed_decode_kda(
                mixed_qkv[:, 0], g_raw[:, 0], beta_logit[:, 0], A_log, dt_bias,
                ring.reshape(batch * num_slots, *ring.shape[2:]), pool_rows, num_heads=num_heads,
                head_dim=head_dim, implementation=cfg.kda_kernel, **out_norm)  # o: [B, H, V]; pool: [B*S, H, K, V]
            if counts and not self.is_initializing():
                norm_counts.value = counts[0]  # zero again, the same buffer (aliased)
            return self._update_cache_and_output(g_a, o[:, None], conv_state, new_window, state_ring,
                                                 pool.reshape(ring.shape), normed=bool(out_norm))

        qkv = mixed_qkv.reshape(batch, seq_len, 3, num_heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, H, K]
        g_raw = g_raw.reshape(batch, seq_len, num_heads, head_dim)
        beta = jax.nn.sigmoid(beta_logit.astype(jnp.float32))
        # The kernels work per (row, head): keep heads split over the tensor axis (no gather of the state).
        q, k, v, g_raw = (nn.with_logical_constraint(t, HEAD_ACTIVATION_AXES) for t in (q, k, v, g_raw))
        beta = nn.with_logical_constraint(beta, HEAD_ACTIVATION_AXES[:3])

        if model_mode == "verify":
            if state_ring.value.shape[1] < verify_state_slots(seq_len):
                raise ValueError(
                    f"model_mode='verify' of T={seq_len} tokens needs a KDA state ring of S >= "
                    f"{verify_state_slots(seq_len)} slots per row, but the cache has S={state_ring.value.shape[1]}; "
                    f"create it with models.init_cache(config, batch, state_slots=kda.verify_state_slots(T))")
            o, ring = kda_kernels.recurrent_kda_ring_checkpoints(
                q, k, v, g_raw, beta, implementation=cfg.kda_kernel, state_ring=state_ring.value,
                state_slot=state_slot.value, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                dt_bias=dt_bias)  # [B, T, H, V], [B, S, H, K, V]
            if not self.is_initializing():
                self.put_variable("cache", "verify_inputs",
                                  jnp.concatenate([window, qkv_pre.astype(window.dtype)], axis=1))  # [B, W-1+T, C]
                state_ring.value = nn.with_logical_constraint(ring, CACHE_LOGICAL_AXES["recurrent_state"])
            return self._output(g_a, o)
        kernel_fn = kda_kernels.fused_recurrent_kda if model_mode == "autoregressive" else kda_kernels.chunk_kda
        o, final_state = kernel_fn(
            q, k, v, g_raw, beta, implementation=cfg.kda_kernel,
            initial_state=None if state_ring is None else read_slot(state_ring.value, state_slot.value),
            output_final_state=state_ring is not None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            A_log=A_log, dt_bias=dt_bias, chunk_size=cfg.kda_chunk_size,
            **({} if train_segments is None else {"segment_ids": train_segments}))  # o: [B, T, H, V]
        new_ring = None if state_ring is None else write_slot(state_ring.value, state_slot.value, final_state)
        return self._update_cache_and_output(g_a, o, conv_state, new_window, state_ring, new_ring)

    def _decode_in_one_launch(self, input_norm_parts, conv_state, state_ring, state_slot, project_counts):
        """`kda_decode_one_launch`: one token of one row from the residual row and the input norm's scale to o_proj's
        input in one launch (`kernels.kda.project_and_decode_kda`), the kernels read as stored ([out, in]); the conv
        window, the state ring (in place) and the launch's counters go back to the cache. Returns o_proj's output."""
        cfg = self.config
        params = nn.meta.unbox(self.variables["params"])
        weights = ProjectionWeights(**{  # field q -> param q_proj, q_conv -> q_conv1d
            field: params[field + ("1d" if field.endswith("conv") else "_proj")]["kernel"]
            for field in ProjectionWeights._fields})
        residual, norm_scale = input_norm_parts
        ring = state_ring.value
        num_slots = ring.shape[1]
        o, pool, window, counts = kda_kernels.project_and_decode_kda(
            residual[:, 0].astype(jnp.dtype(cfg.dtype)), norm_scale, weights, conv_state.value, params["A_log"],
            params["dt_bias"],
            ring.reshape(num_slots, *ring.shape[2:]), state_slot.value, self._out_norm().scale,
            project_counts.value[0], num_heads=cfg.kda_num_heads, head_dim=cfg.kda_head_dim,
            norm_eps=cfg.normalization_layer_epsilon, out_norm_eps=cfg.normalization_layer_epsilon)  # o: [1, H, V]
        project_counts.value = counts[None]  # zero again, the same buffer (aliased)
        conv_state.value = nn.with_logical_constraint(window, CACHE_LOGICAL_AXES["conv_state"])
        state_ring.value = nn.with_logical_constraint(pool.reshape(ring.shape), CACHE_LOGICAL_AXES["recurrent_state"])
        return self._o_proj(o[:, None].astype(jnp.dtype(cfg.dtype)))

    def _update_cache_and_output(self, g_a, o, conv_state, new_window, state_ring, new_ring, normed=False):
        """Stores the new conv window and state ring (prefill / autoregressive), then `_output(g_a, o)` (only the
        output projection when `normed`: the kernel applied the output norm)."""
        if state_ring is not None and not self.is_initializing():
            conv_state.value = nn.with_logical_constraint(new_window, CACHE_LOGICAL_AXES["conv_state"])
            state_ring.value = nn.with_logical_constraint(new_ring, CACHE_LOGICAL_AXES["recurrent_state"])
        o = nn.with_logical_constraint(o, HEAD_ACTIVATION_AXES)
        return self._o_proj(o.astype(jnp.dtype(self.config.dtype))) if normed else self._output(g_a, o)

    def _out_gate(self, g_a):
        """The output gate g_b_proj(g_a): [B, T, K] -> [B, T, H*V]."""
        return self._dense(self.config.kda_num_heads * self.config.kda_head_dim, (None, "kda_qkv"), "g_b_proj")(g_a)

    def _out_norm(self):
        cfg = self.config
        return GatedRMSNorm(cfg.kda_head_dim, cfg.normalization_layer_epsilon, jnp.dtype(cfg.weight_dtype),
                            name="o_norm")

    def _o_proj(self, o):
        """o [B, T, H, V] -> o_proj [B, T, D]."""
        batch, seq_len, num_heads, head_dim = o.shape
        return self._dense(self.config.emb_dim, ("kda_qkv", "embed"), "o_proj")(
            o.reshape(batch, seq_len, num_heads * head_dim))

    def _output(self, g_a, o):
        """Output gate (from g_a = g_a_proj(x) [B, T, K]), gated RMSNorm over each head, output projection:
        o [B, T, H, V] -> [B, T, D]."""
        gate = self._out_gate(g_a).reshape(o.shape)
        return self._o_proj(self._out_norm()(o, gate).astype(jnp.dtype(self.config.dtype)))


def commit_verified(layer_cache, accepted_len):
    """The KDA cache after a 'verify' call, as if only the first `accepted_len[b]` verified tokens had been decoded.

    layer_cache: {conv_state, recurrent_state, state_slot, verify_inputs}; accepted_len: [B] int32 in [0, T]
    (0 keeps the row's state). Nothing is recomputed and no recurrent state is copied: the verify left token t's
    state in ring slot (s + 1 + t) mod S, so the row's committed slot just moves to (s + a) mod S; the window is a
    slice of `verify_inputs`. `recurrent_state` passes through as the same array. Returns the cache without the
    verify entry (the same structure as before the 'verify' call).
    """
    cache = dict(layer_cache)
    inputs = cache.pop("verify_inputs")  # [B, W-1+T, C]
    window_len = cache["conv_state"].shape[1]
    cache["conv_state"] = jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, window_len))(
        inputs, accepted_len)  # [B, W-1, C]
    num_slots = cache["recurrent_state"].shape[1]
    cache["state_slot"] = ((cache["state_slot"] + accepted_len) % num_slots).astype(jnp.int32)
    return cache
