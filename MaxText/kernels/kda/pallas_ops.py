"""Entry points of the Pallas KDA kernels (the dispatcher in `__init__.py` loads this module lazily).

    unsupported_reason(kind, head_dim, value_dim) -> str | None
    o, final_state = chunk_kda(q, k, v, g, beta, **fla-style kwargs)           # prefill: pallas_chunk.py
    o, final_state = fused_recurrent_kda(q, k, v, g, beta, **same kwargs)      # decode:  pallas_decode.py
    o, new_pool = packed_decode_kda(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices,
                                    num_heads=H, head_dim=K, scale=None)        # serving decode (seed 004):
                                                             # pallas_decode.py, or mosaic_decode.py (decode_kernel)
    o, checkpoints = recurrent_kda_checkpoints(q, k, v, g, beta, initial_state=S0, **kwargs)  # verify: pallas_verify.py
    o, state_ring = recurrent_kda_ring_checkpoints(q, k, v, g, beta, state_ring=R, state_slot=s, **kwargs)  # in place
    o, pool, window, counts = project_and_decode_kda(x, norm_scale, weights, window, A_log, dt_bias, state_pool,
                                                     slot_indices, out_norm_scale, counts, **kwargs)
                                           # batch-1 decode from the layer's input row, one launch: pallas_project_decode.py

All are GPU kernels written with the Pallas Triton lowering, but for the packed decode's Mosaic GPU kernel (Hopper,
from 64 rows). Each takes `interpret=False`; with True they run in the Pallas interpreter on any backend (the CPU
tests use that at small shapes; the packed decode then takes its Triton kernel unless asked for
`kernel="mosaic"`). Semantics are those of `naive.naive_recurrent_kda`, `packed_decode.packed_decode_kda_reference` and
`verify.recurrent_kda_checkpoints` / `verify.recurrent_kda_ring_checkpoints` and `project_decode.project_and_decode_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.kernels.kda import pallas_chunk, pallas_decode, pallas_project_decode, pallas_verify, verify
from MaxText.kernels.kda.common import check_cu_seqlens, kda_gate, prepare_inputs
from MaxText.kernels.kda.packed_decode import apply_output_norm, check_packed_inputs

SUPPORTED_HEAD_DIMS = (32, 64, 128)


def unsupported_reason(kind: str, head_dim: int, value_dim: int) -> str | None:
    """None when the Pallas kernel of `kind` ('prefill' | 'decode') runs on the default backend at these dims."""
    if kind not in ("prefill", "decode"):
        raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
    backend = jax.default_backend()
    if backend != "gpu":
        return f"the Pallas KDA kernels need a GPU (CUDA) backend, and the default backend is {backend!r}"
    platform = jax.devices()[0].platform if jax.devices() else backend
    if "rocm" in str(getattr(jax.devices()[0], "client", "")).lower() or platform == "rocm":
        return "the Pallas KDA kernels are built and tested for NVIDIA GPUs only, not ROCm"
    for name, dim in (("head_dim K", head_dim), ("value_dim V", value_dim)):
        if dim not in SUPPORTED_HEAD_DIMS:
            return f"{name}={dim} is not supported by the Pallas KDA kernels (supported: {SUPPORTED_HEAD_DIMS})"
    return None


def _check_dims(head_dim, value_dim):
    for name, dim in (("K", head_dim), ("V", value_dim)):
        if dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head dim {name}={dim} is not supported by the Pallas KDA kernels; "
                             f"expected one of {SUPPORTED_HEAD_DIMS}")


def _pack_plan(cu_seqlens, seq_len):
    """Host-side plan: every sequence padded to a multiple of C = 64 tokens and laid end to end.

    Returns (gather [Ttot] int, valid [Ttot] bool, inverse [T] int, chunk_offsets [N + 1] int32).
    """
    C = pallas_chunk.CHUNK
    cu = np.asarray(cu_seqlens, np.int64)
    lengths = np.diff(cu)
    chunks = -(-lengths // C)
    offsets = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int32)
    starts = offsets[:-1].astype(np.int64) * C  # padded start of each sequence
    total = max(int(offsets[-1]) * C, C)
    seq_of = np.repeat(np.arange(len(lengths)), lengths)
    inverse = starts[seq_of] + (np.arange(seq_len) - cu[seq_of])  # packed token -> padded position
    gather = np.zeros(total, np.int64)
    valid = np.zeros(total, bool)
    gather[inverse], valid[inverse] = np.arange(seq_len), True
    return gather, valid, inverse, offsets


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, cu_seqlens=None,
              chunk_size=64, interpret=False, block_v=None, num_warps=1):
    """fla-style chunked KDA forward on the Pallas kernels; returns (o [B, T, H, V] in q's dtype, final state
    [N, H, K, V] float32 or None). q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; bf16 or fp32.

    The kernel always uses 64-token chunks; `chunk_size` is accepted for the shared signature (the result does not
    depend on it). `cu_seqlens` must be concrete (a host array), as for `chunked_kda`. block_v: value columns per
    program of the serial recurrence (default `pallas_chunk.recurrence_block_v`); num_warps: warps per program of
    `pallas_chunk.scores` and `pallas_chunk.wy_inverse`.
    """
    del chunk_size
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, jax.core.Tracer):
            raise ValueError("the Pallas chunk_kda plans packed sequences on the host: pass cu_seqlens as a "
                             "concrete (numpy) array, not a traced value")
        check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    # Shape checks shared with the other implementations, on abstract values only (no compute).
    jax.eval_shape(functools.partial(prepare_inputs, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                     use_gate_in_kernel=use_gate_in_kernel,
                                     cu_seqlens=None if cu_seqlens is None else np.asarray(cu_seqlens)),
                   q, k, v, g, beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    batch, seq_len, H, K = q.shape
    V = v.shape[-1]
    _check_dims(K, V)
    C = pallas_chunk.CHUNK
    scale = K ** -0.5 if scale is None else float(scale)

    if cu_seqlens is None:
        n_seq, padded = batch, -(-seq_len // C) * C
        needs_pad = padded != seq_len or seq_len == 0
        padded = max(padded, C)
    else:
        gather, valid, inverse, offsets = _pack_plan(cu_seqlens, seq_len)
        n_seq, needs_pad = len(offsets) - 1, not bool(valid.all())
    gate_in_kernel = use_gate_in_kernel
    if use_gate_in_kernel and needs_pad:  # padded tokens need log-decay 0, so the gate runs in XLA here
        g, gate_in_kernel = kda_gate(g, A_log, dt_bias), False

    if cu_seqlens is None:
        def flat(x):  # [B, T, ...] -> [B * padded, ...], zero padding (no decay, no update)
            x = jnp.pad(x, [(0, 0), (0, padded - seq_len)] + [(0, 0)] * (x.ndim - 2)) if needs_pad else x
            return x.reshape(batch * padded, *x.shape[2:])
        offsets = np.arange(batch + 1, dtype=np.int32) * (padded // C)
    else:
        mask = jnp.asarray(valid)

        def flat(x):  # [1, T, ...] -> [Ttot, ...], each sequence on a chunk boundary, zeros between
            out = x[0][jnp.asarray(gather)]
            return jnp.where(mask.reshape((-1,) + (1,) * (out.ndim - 1)), out, jnp.zeros((), out.dtype))

    if initial_state is None:
        initial_state = jnp.zeros((n_seq, H, K, V), jnp.float32)
    qf, kf, vf, gf, bf = (flat(x) for x in (q, k, v, g, beta))
    qg, kg, w, u, aqk, g_last = pallas_chunk.intra(
        qf, kf, vf, gf, bf, A_log if gate_in_kernel else None, dt_bias if gate_in_kernel else None,
        scale=scale, l2norm=use_qk_l2norm_in_kernel, gate=gate_in_kernel, num_warps=num_warps,
        interpret=interpret)
    o, final_state = pallas_chunk.recurrence(
        qg, kg, w, u, aqk, g_last, initial_state.astype(jnp.float32), jnp.asarray(offsets, jnp.int32),
        out_dtype=q.dtype, block_v=block_v, interpret=interpret)  # o: [Ttot, H, V]
    if cu_seqlens is None:
        o = o.reshape(batch, -1, H, V)[:, :seq_len]
    else:
        o = o[jnp.asarray(inverse)][None]
    return o, (final_state if output_final_state else None)


def fused_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                        cu_seqlens=None, chunk_size=None, interpret=False, block_v=32):
    """fla-style recurrent KDA for few tokens (decode): one Pallas step kernel per token over an in-place state.

    Same arguments and results as `naive.naive_recurrent_kda`. Packed sequences (`cu_seqlens`) take the chunked
    Pallas path, which computes the same function.
    """
    del chunk_size
    if cu_seqlens is not None:
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                         cu_seqlens=cu_seqlens, interpret=interpret)
    A_log, dt_bias, options = _recurrent_options(
        q, k, v, g, beta, initial_state, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, block_v=block_v)
    batch, seq_len, H, K = q.shape
    V = v.shape[-1]
    state = (jnp.zeros((batch, H, K, V), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    slots = jnp.arange(batch, dtype=jnp.int32)
    dtype = jnp.promote_types(q.dtype, v.dtype)
    mixed = jnp.concatenate([q.reshape(batch, seq_len, H * K).astype(dtype), k.reshape(batch, seq_len, H * K)
                             .astype(dtype), v.reshape(batch, seq_len, H * V).astype(dtype)], axis=-1)
    step = functools.partial(pallas_decode.decode_call, num_heads=H, head_dim=K, beta_logit=False,
                             interpret=interpret, **options)

    def body(state, xs):
        mixed_t, g_t, beta_t = xs
        o_t, state = step(mixed_t, g_t.reshape(batch, H * K), beta_t, A_log, dt_bias, state, slots)
        return state, o_t

    xs = (jnp.moveaxis(mixed, 1, 0), jnp.moveaxis(g, 1, 0), jnp.moveaxis(beta, 1, 0))
    final_state, o = jax.lax.scan(body, state, xs)  # o: [T, B, H, V]
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), (final_state if output_final_state else None)


def decode_tile(batch: int) -> tuple[int, int, bool]:
    """(block_v, num_warps, columns_fastest) of the packed decode kernel for `batch` rows, measured on an H200 (H =
    32, K = V = 128, the output norm in the launch; benchmarks/RESULTS.md): 32 value columns at 4 warps for 1-3 rows
    (more programs; B = 1 / 2: 3.77 / 4.59 us per step vs 4.78 / 4.78 with 128); a head's 128 columns in one program
    from 4 rows (B = 4 / 8 / 16 / 24: 5.95 / 8.66 / 15.88 / 31.64 us vs 6.26 / 11.20 / 17.19 / 34.82 with 32;
    twenty-seventh session; again in `benchmarks/kda_kernels.py --sweep`'s `_norm` rows, twenty-eighth); from 32
    rows 64 columns at 4 warps, launched with a head's value blocks side by side (`columns_fastest`; B = 64 / 128 /
    256: 79.8 / 155.0 / 301.4 us per step vs 80.5 / 156.8 / 305.6 at 2 warps and 82.4 / 161.6 / 315.6 at 2 warps
    rows first, one run)."""
    if batch < 4:
        return 32, 4, False
    return (128, 4, False) if batch < 32 else (64, 4, True)


DECODE_KERNELS = ("triton", "mosaic")
MOSAIC_DECODE_MIN_ROWS = 64


def decode_kernel(batch: int, head_dim: int, value_dim: int) -> str:
    """The packed decode kernel for `batch` rows: 'mosaic' (mosaic_decode.py) from 64 rows at K = V = 128 on a Hopper
    GPU, else 'triton' (pallas_decode.py). Measured on an H200 (H = 32, benchmarks/RESULTS.md, fifteenth session):
    at 64 / 128 / 256 rows the Mosaic kernel's step is 1-3% shorter; its first form was longer at 1 / 8 rows (5.2 vs
    2.3 us, 10.1 vs 8.7) and even at 32."""
    device = jax.devices()[0]
    hopper = device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")
    if hopper and batch >= MOSAIC_DECODE_MIN_ROWS and head_dim == value_dim == _mosaic_decode().HEAD_DIM:
        return "mosaic"
    return "triton"


def _mosaic_decode():
    """mosaic_decode.py, imported where it may run (Mosaic GPU's modules need not import where Triton's do)."""
    from MaxText.kernels.kda import mosaic_decode  # pylint: disable=import-outside-toplevel
    return mosaic_decode


def packed_decode_kda(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, *, num_heads: int, head_dim: int,
                      scale: float | None = None, out_dtype=None, interpret: bool = False, kernel: str | None = None,
                      block_v: int | None = None, num_warps: int | None = None, columns_fastest: bool | None = None,
                      out_gate=None, out_norm_scale=None, out_norm_eps: float | None = None, norm_counts=None):
    """Packed single-token decode with the state pool updated in place (seed 004).

    mixed_qkv [B, 2*H*K + H*V] (conv output, q | k | v, not yet l2-normed); a [B, H*K] raw gate; b [B, H] raw beta
    logit; A_log [H]; dt_bias [H*K]; state_pool [S, H, K, V] float32; slot_indices [B] int32 (-1 = padding row:
    zero output, pool row untouched). Computes l2norm, scale (default K**-0.5), gate and sigmoid(beta) in-kernel.
    Returns (o [B, H, V] in `out_dtype` (default: mixed_qkv's dtype), new_pool). The pool is donated when this is
    called under `jax.jit` with `donate_argnums` on it (and by the inner jit): the update happens in the same buffer.
    Reference semantics: `packed_decode.packed_decode_kda_reference`. kernel: 'triton' | 'mosaic' (default
    `decode_kernel`). block_v, num_warps, columns_fastest: the Triton kernel's tile and launch order (default
    `decode_tile(B)`). out_gate [B, H*V], out_norm_scale [V], out_norm_eps: o is the KDA output norm of it
    (`packed_decode.apply_output_norm`), computed in the Triton kernel's launch (after the Mosaic kernel by XLA).
    norm_counts [B, H] int32 zeros: the Triton kernel's counters for that norm, kept between steps by the caller
    (`pallas_decode.decode_call`); given, they come back as a third result (zero).
    """
    layout = check_packed_inputs(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, num_heads, head_dim)
    _check_dims(head_dim, layout.value_dim)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out_dtype = None if out_dtype is None else jnp.dtype(out_dtype)
    batch = mixed_qkv.shape[0]
    kernel = kernel or ("triton" if interpret else decode_kernel(batch, head_dim, layout.value_dim))
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {DECODE_KERNELS}, got {kernel!r}")
    if kernel == "mosaic":
        triton_options = {"block_v": block_v, "num_warps": num_warps, "columns_fastest": columns_fastest}
        if given := [name for name, value in triton_options.items() if value is not None]:
            raise ValueError(f"{', '.join(given)}: options of the Triton decode kernel, not of kernel='mosaic'")
        o, pool = _mosaic_decode().decode_step(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices,
                                               num_heads=num_heads, head_dim=head_dim, scale=scale,
                                               out_dtype=out_dtype, interpret=interpret)
        if out_norm_eps is not None:
            o = apply_output_norm(o, out_gate, out_norm_scale, out_norm_eps)
        return (o, pool) if norm_counts is None else (o, pool, norm_counts)
    default_block_v, default_warps, default_order = decode_tile(batch)
    block_v = min(block_v or default_block_v, layout.value_dim)
    return pallas_decode.decode_step(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices,
                                     num_heads=num_heads, head_dim=head_dim, scale=scale, block_v=block_v,
                                     num_warps=num_warps or default_warps,
                                     columns_fastest=default_order if columns_fastest is None else columns_fastest,
                                     out_dtype=out_dtype, out_gate=out_gate, out_norm_scale=out_norm_scale,
                                     out_norm_eps=out_norm_eps, norm_counts=norm_counts, interpret=interpret)


def _recurrent_options(q, k, v, g, beta, initial_state, *, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                       A_log, dt_bias, block_v):
    """For the token-by-token kernels (decode, verify): the shape checks shared with the plain-JAX versions (abstract
    values only), the gate params (zeros when absent) and the kernels' static options."""
    jax.eval_shape(functools.partial(prepare_inputs, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                     use_gate_in_kernel=use_gate_in_kernel),
                   q, k, v, g, beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    batch, _, H, K = q.shape
    V = v.shape[-1]
    _check_dims(K, V)
    if block_v is None:  # narrow blocks (more programs) for few rows: decode_tile's rule before its 128-column tile
        block_v = 32 if batch < 32 else 64  # for 4-31 rows (verify's kernel not timed with that tile)
    A_log = jnp.zeros((H,), jnp.float32) if A_log is None else A_log
    dt_bias = jnp.zeros((H * K,), jnp.float32) if dt_bias is None else dt_bias
    options = dict(scale=K ** -0.5 if scale is None else float(scale), gate_in_kernel=use_gate_in_kernel,
                   l2norm_in_kernel=use_qk_l2norm_in_kernel, block_v=min(block_v, V))
    return A_log, dt_bias, options


def recurrent_kda_checkpoints(q, k, v, g, beta, *, initial_state, checkpoint_dtype=jnp.float32, scale=None,
                              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                              interpret=False, block_v: int | None = None, num_warps: int = 4):
    """Speculative verify on the Pallas kernel (pallas_verify.py): T draft tokens from `initial_state`, each token's
    post-state kept. Same arguments and results as `verify.recurrent_kda_checkpoints`: q, k, g [B, T, H, K];
    v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] float32 (unchanged). Returns (o [B, T, H, V] in q's
    dtype, checkpoints [B, T, H, K, V] in `checkpoint_dtype`; the recurrence runs in float32).
    """
    A_log, dt_bias, options = _recurrent_options(
        q, k, v, g, beta, initial_state, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, block_v=block_v)
    return pallas_verify.verify_step(q, k, v, g, beta, A_log, dt_bias, initial_state, None, in_ring=False,
                                     checkpoint_dtype=jnp.dtype(checkpoint_dtype), num_warps=num_warps,
                                     interpret=interpret, **options)


def recurrent_kda_ring_checkpoints(q, k, v, g, beta, *, state_ring, state_slot, scale=None,
                                   use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                   interpret=False, block_v: int | None = None, num_warps: int = 4):
    """Speculative verify into the per-row state ring, in place (pallas_verify.py). Same arguments and results as
    `verify.recurrent_kda_ring_checkpoints`: state_ring [B, S, H, K, V] float32 (S >= T + 1), state_slot [B] int32;
    returns (o [B, T, H, V] in q's dtype, the ring with token t's state in slot (s + 1 + t) mod S). The ring is
    aliased to the output: under `jax.jit`, donate it (the inner jit does) and the update happens in its buffer.
    """
    batch, seq_len, H, K = q.shape
    verify.check_state_ring(state_ring, state_slot, batch, seq_len, H, K, v.shape[-1])
    committed = jax.ShapeDtypeStruct((batch, H, K, v.shape[-1]), jnp.float32)  # the slot read, for the checks
    A_log, dt_bias, options = _recurrent_options(
        q, k, v, g, beta, committed, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, block_v=block_v)
    return pallas_verify.ring_verify_step(q, k, v, g, beta, A_log, dt_bias, state_ring, state_slot, in_ring=True,
                                          checkpoint_dtype=jnp.dtype(jnp.float32), num_warps=num_warps,
                                          interpret=interpret, **options)


project_and_decode_kda = pallas_project_decode.project_and_decode  # (its docstring; the layer's kda_decode_one_launch)
