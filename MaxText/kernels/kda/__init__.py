"""KDA kernels behind one fla-style interface, and the dispatcher that picks an implementation.

    o, final_state = chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                               cu_seqlens=None, chunk_size=64, implementation="auto")
    o, final_state = fused_recurrent_kda(...same arguments...)

Implementations (config key `kda_kernel`):
  naive   -- token-by-token fp32 `lax.scan` (naive.py): the oracle.
  chunked -- chunk-parallel WY form in plain JAX / XLA (chunked.py).
  pallas  -- GPU kernels (pallas_*.py), only where they import and support the platform and shape.
  auto    -- pallas where supported, else chunked for prefill (`chunk_kda`) and naive for decode
             (`fused_recurrent_kda`). The choice is logged once per distinct outcome.
"""

from __future__ import annotations

import importlib
import logging

import jax

from MaxText.kernels.kda.chunked import chunked_kda
from MaxText.kernels.kda.naive import naive_recurrent_kda
from MaxText.kernels.kda.sharded import shard_map_over_rows_and_heads
from MaxText.kernels.kda.verify import recurrent_kda_checkpoints

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


def chunk_kda(q, k, v, g, beta, *, implementation: str = "auto", **kwargs):
    """Prefill-shaped KDA (many tokens). See the module docstring for the arguments."""
    chosen = resolve(implementation, "prefill", q.shape[-1], v.shape[-1], kwargs.get("segment_ids") is not None)
    if chosen == "pallas":
        return partitioned(load_pallas().chunk_kda)(q, k, v, g, beta, **kwargs)
    fn = chunked_kda if chosen == "chunked" else naive_recurrent_kda
    return fn(q, k, v, g, beta, **kwargs)


def partitioned(kernel_fn):
    """`kernel_fn` under shard_map over rows and heads when a multi-device mesh is current (`jax.set_mesh`), with
    the mesh axes that flax's current logical axis rules give 'batch' and 'kda_heads'; `kernel_fn` itself otherwise.
    For kernels XLA cannot partition (Pallas); see sharded.py."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel_fn
    import flax.linen as nn  # pylint: disable=import-outside-toplevel  (the kernels are otherwise plain JAX)

    def mesh_axes(logical):
        entry = nn.logical_to_mesh_axes((logical,), nn.get_logical_axis_rules())[0]
        return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))

    return shard_map_over_rows_and_heads(kernel_fn, None, mesh_axes("batch"), mesh_axes("kda_heads"))


def fused_recurrent_kda(q, k, v, g, beta, *, implementation: str = "auto", **kwargs):
    """Decode-shaped KDA (few tokens per call). See the module docstring for the arguments."""
    chosen = resolve(implementation, "decode", q.shape[-1], v.shape[-1], kwargs.get("segment_ids") is not None)
    if chosen == "pallas":
        return partitioned(load_pallas().fused_recurrent_kda)(q, k, v, g, beta, **kwargs)
    fn = chunked_kda if chosen == "chunked" else naive_recurrent_kda
    return fn(q, k, v, g, beta, **kwargs)


__all__ = ["chunk_kda", "fused_recurrent_kda", "naive_recurrent_kda", "chunked_kda", "recurrent_kda_checkpoints", "resolve",
           "KERNEL_CHOICES"]
