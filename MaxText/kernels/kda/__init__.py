"""KDA kernels behind one fla-style interface, and the dispatcher that picks an implementation.

    o, final_state = chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                               cu_seqlens=None, chunk_size=64, implementation="auto")
    o, final_state = fused_recurrent_kda(...same arguments...)
    o, new_pool = packed_decode_kda(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, num_heads=H, head_dim=K,
                                implementation="auto")          # serving decode, pool updated in place (pallas)
    o, checkpoints = recurrent_kda_checkpoints(q, k, v, g, beta, initial_state=S0, checkpoint_dtype=...,
                                               implementation="auto")  # speculative verify
    o, state_ring = recurrent_kda_ring_checkpoints(q, k, v, g, beta, state_ring=R, state_slot=s,
                                                   implementation="auto")  # verify into the state ring (in place)
    o, pool, window, counts = project_and_decode_kda(x, norm_scale, weights, window, ..., counts, num_heads=H,
                                                     head_dim=K, norm_eps=..., out_norm_eps=...)
                                    # batch-1 decode from the layer's input row in one launch, where
                                    # one_launch_decode_reason(...) is None (the Pallas kernel only)

Implementations (config key `kda_kernel`):
  naive   -- token-by-token fp32 `lax.scan` (naive.py): the oracle.
  chunked -- chunk-parallel WY form in plain JAX / XLA (chunked.py).
  pallas  -- GPU kernels (pallas_*.py), only where they import and support the platform and shape.
  auto    -- pallas where supported, else chunked for prefill (`chunk_kda`) and naive for decode
             (`fused_recurrent_kda`). The choice is logged once per distinct outcome.
`packed_decode_kda` and the two verify functions resolve like decode: the Pallas kernel, or their plain-JAX versions
(`packed_decode.packed_decode_kda_reference`, the `verify.py` scans) for every other implementation.
Under a multi-device mesh the Pallas kernels run under shard_map (`partitioned`).
"""

from __future__ import annotations

import importlib
import logging

import jax

from MaxText.kernels.kda import verify
from MaxText.kernels.kda.chunked import chunked_kda
from MaxText.kernels.kda.naive import naive_recurrent_kda
from MaxText.kernels.kda.packed_decode import apply_output_norm, packed_decode_kda_reference, shard_map_packed_decode
from MaxText.kernels.kda.sharded import shard_map_over_rows_and_heads

logger = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "naive", "chunked", "pallas")
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def load_pallas():
    """Returns the Pallas kernel module, or raises ImportError saying why it is unavailable."""
    return importlib.import_module("MaxText.kernels.kda.pallas_ops")


def pallas_unavailable_reason(kind: str, head_dim: int, value_dim: int) -> str | None:
    """None when the Pallas kernel of `kind` ('prefill' | 'decode') can run here, else why not."""
    try:
        module = load_pallas()
    except Exception as e:  # noqa: BLE001 -- any import failure must fall back, never crash (RFC 4.2)
        return f"the Pallas KDA kernels failed to import ({type(e).__name__}: {e})"
    return module.unsupported_reason(kind, head_dim, value_dim)


def resolve(implementation: str, kind: str, head_dim: int, value_dim: int, with_segments: bool = False) -> str:
    """Maps a `kda_kernel` value to the implementation that runs: 'naive' | 'chunked' | 'pallas'."""
    if implementation not in KERNEL_CHOICES:
        raise ValueError(f"kda kernel implementation {implementation!r} is unknown; choose one of {KERNEL_CHOICES}")
    if implementation in ("naive", "chunked"):
        return implementation
    reason = ("segment_ids (packed training rows) are not supported by the Pallas kernels" if with_segments
              else pallas_unavailable_reason(kind, head_dim, value_dim))
    if implementation == "pallas":
        if reason is not None:
            raise RuntimeError(f"kda_kernel=pallas was requested for {kind}, but {reason}. "
                               f"Use kda_kernel=auto to fall back automatically, or chunked / naive.")
        return "pallas"
    fallback = "chunked" if kind == "prefill" else "naive"
    chosen = "pallas" if reason is None else fallback
    _log_once(f"kda_kernel=auto: {kind} uses {chosen}" + (f" ({reason})" if reason else "")
              + f" on {jax.default_backend()} with head dims K={head_dim}, V={value_dim}")
    return chosen


def _dispatch(kind: str, pallas_name: str, q, k, v, g, beta, implementation: str, kwargs):
    """The fla-style entry points: `kind` ('prefill' | 'decode') resolved to the Pallas kernel `pallas_name`
    (partitioned under a mesh), the XLA chunked kernel or the naive recurrence, called on the same arguments."""
    chosen = resolve(implementation, kind, q.shape[-1], v.shape[-1], kwargs.get("segment_ids") is not None)
    if chosen == "pallas":
        return partitioned(getattr(load_pallas(), pallas_name))(q, k, v, g, beta, **kwargs)
    fn = chunked_kda if chosen == "chunked" else naive_recurrent_kda
    return fn(q, k, v, g, beta, **kwargs)


def chunk_kda(q, k, v, g, beta, *, implementation: str = "auto", **kwargs):
    """Prefill-shaped KDA (many tokens). See the module docstring for the arguments."""
    return _dispatch("prefill", "chunk_kda", q, k, v, g, beta, implementation, kwargs)


def partitioned(kernel_fn, shard_map_fn=shard_map_over_rows_and_heads, rows: str = "batch"):
    """`kernel_fn` under shard_map over rows and heads when a multi-device mesh is current (`jax.set_mesh`), with
    the mesh axes that flax's current logical axis rules give `rows` and 'kda_heads'; `kernel_fn` itself otherwise.
    For kernels XLA cannot partition (Pallas). `shard_map_fn(kernel_fn, mesh, row_axes, head_axes)` wraps a kernel
    of one signature: sharded.py's for the fla-style kernels, packed_decode.py's and verify.py's for theirs."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel_fn
    import flax.linen as nn  # pylint: disable=import-outside-toplevel  (the kernels are otherwise plain JAX)

    def mesh_axes(logical):
        entry = nn.logical_to_mesh_axes((logical,), nn.get_logical_axis_rules())[0]
        return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))

    return shard_map_fn(kernel_fn, None, mesh_axes(rows), mesh_axes("kda_heads"))


def fused_recurrent_kda(q, k, v, g, beta, *, implementation: str = "auto", **kwargs):
    """Decode-shaped KDA (few tokens per call). See the module docstring for the arguments."""
    return _dispatch("decode", "fused_recurrent_kda", q, k, v, g, beta, implementation, kwargs)


def packed_decode_kda(mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices, *, num_heads: int, head_dim: int,
                  implementation: str = "auto", **kwargs):
    """Packed single-token decode over a state pool (arguments and results: packed_decode.py). On the Pallas kernel
    the pool is updated in place when it is donated; otherwise the plain-JAX reference computes the same function.

    Under a mesh, rows shard over the axes of 'cache_batch' (not 'batch'): the pool is the decode cache, so the
    kernel sees exactly the cache's shards and updates them where they lie; heads over 'kda_heads'. The output norm
    (out_gate, out_norm_scale, out_norm_eps) runs in the kernel's launch on one device, by XLA after it under a mesh.
    With norm_counts [B, H] int32 zeros (the KDA decode cache's), a third result: them after the call (zero; the
    one-device Triton kernel counts a head's value blocks on them for that norm, every other path passes them on).
    """
    value_dim = state_pool.shape[-1]
    args = (mixed_qkv, a, b, A_log, dt_bias, state_pool, slot_indices)
    norm_counts = kwargs.pop("norm_counts", None)  # the one-device Triton kernel's; passed through elsewhere
    if resolve(implementation, "decode", head_dim, value_dim) == "pallas":
        kernel_fn = load_pallas().packed_decode_kda
        run = partitioned(kernel_fn, shard_map_packed_decode, rows="cache_batch")
        if run is kernel_fn:
            return kernel_fn(*args, num_heads=num_heads, head_dim=head_dim, norm_counts=norm_counts, **kwargs)
        norm = {}  # the output norm's inputs are not sharded with the kernel's: under a mesh XLA applies it after
        if kwargs.get("out_norm_eps") is not None:
            norm = {name: kwargs.pop(name) for name in ("out_gate", "out_norm_scale", "out_norm_eps")}
        o, pool = run(*args, num_heads=num_heads, head_dim=head_dim, **kwargs)
        result = (apply_output_norm(o, **norm) if norm else o), pool
    else:
        result = packed_decode_kda_reference(*args, num_heads=num_heads, head_dim=head_dim, **kwargs)
    return result if norm_counts is None else (*result, norm_counts)


def recurrent_kda_checkpoints(q, k, v, g, beta, *, implementation: str = "auto", **kwargs):
    """Speculative verify: T draft tokens from `initial_state`, every token's post-state kept (arguments and results:
    verify.py). The Pallas kernel where `implementation` resolves to it for decode, else the fp32 scan."""
    if resolve(implementation, "decode", q.shape[-1], v.shape[-1]) == "pallas":
        return partitioned(load_pallas().recurrent_kda_checkpoints, verify.shard_map_verify)(q, k, v, g, beta, **kwargs)
    return verify.recurrent_kda_checkpoints(q, k, v, g, beta, **kwargs)


def recurrent_kda_ring_checkpoints(q, k, v, g, beta, *, implementation: str = "auto", **kwargs):
    """Speculative verify into each row's state ring (the KDA block's cache; arguments and results: verify.py). The
    Pallas kernel (ring updated in place) where `implementation` resolves to it for decode, else the fp32 scan with
    a gather and a scatter. Under a mesh, rows shard over 'cache_batch' (the ring is the cache) and heads over
    'kda_heads'."""
    if resolve(implementation, "decode", q.shape[-1], v.shape[-1]) == "pallas":
        return partitioned(load_pallas().recurrent_kda_ring_checkpoints, verify.shard_map_verify,
                           rows="cache_batch")(q, k, v, g, beta, **kwargs)
    return verify.recurrent_kda_ring_checkpoints(q, k, v, g, beta, **kwargs)


def one_launch_decode_reason(implementation: str, batch: int, model_dim: int, num_heads: int, head_dim: int,
                             value_dim: int) -> str | None:
    """None when `project_and_decode_kda` (one Pallas launch from the layer's input row to the normed output) runs
    here: the decode resolves to the Pallas kernels, one device, and the launch takes the dims; else why not."""
    if resolve(implementation, "decode", head_dim, value_dim) != "pallas":
        return f"kda_kernel={implementation} does not resolve to the Pallas kernels for decode here"
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        return f"a mesh of {mesh.size} devices (the launch runs on one)"
    try:
        module = importlib.import_module("MaxText.kernels.kda.pallas_project_decode")
    except Exception as e:  # noqa: BLE001 -- fall back, never crash
        return f"the one-launch kernel failed to import ({type(e).__name__}: {e})"
    return module.unsupported_reason(batch, model_dim, num_heads, head_dim, value_dim)


def project_and_decode_kda(*args, **kwargs):
    """KDA's batch-1 decode from the layer's input row in one Pallas launch (pallas_project_decode.project_and_decode:
    arguments and results there; semantics project_decode.project_and_decode_reference). Call it where
    `one_launch_decode_reason` is None."""
    return load_pallas().project_and_decode_kda(*args, **kwargs)


__all__ = ["chunk_kda", "fused_recurrent_kda", "packed_decode_kda", "recurrent_kda_checkpoints",
           "recurrent_kda_ring_checkpoints", "project_and_decode_kda", "one_launch_decode_reason",
           "naive_recurrent_kda", "chunked_kda", "resolve", "KERNEL_CHOICES"]
