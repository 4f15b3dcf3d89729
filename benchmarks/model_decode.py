"""Whole-model benchmark of the Kimi-Linear architecture: prefill time, decode time per output token (TPOT) against a
memory roofline, and a profile of one decode step (issue 8).

    python benchmarks/model_decode.py --config configs/kimi_linear.yml --out $OUT             # the 48B model, one GPU
    python benchmarks/model_decode.py --config configs/kimi_linear.yml --layers 4 --out $OUT  # its first 4 layers
    python benchmarks/model_decode.py --smoke                                                # tiny model, CPU, seconds
    python benchmarks/model_decode.py ici_tensor_parallelism=2 --config configs/kimi_linear.yml \
        --stages copy,init,decode,profile --batches 1 8 --decode-moe gather ragged_dot

`key=value` arguments override the config (after the benchmark's own dtype=bfloat16, weight_dtype=bfloat16 and
max_target_length = prompt + every decode step the run takes); put them before the list-valued options (--batches,
--decode-moe). Compiled programs persist in $JAX_COMPILATION_CACHE_DIR (default <tmp>/jax-compilation-cache), so a
rerun's "compile" time may be a cache load. Stages (--stages, comma-separated; default all):
  copy     device copy bandwidth, bytes read + written / time: benchmarks/kda_kernels.copy_bandwidth on a GPU (torch
           and JAX; the roofline uses the larger), a JAX copy timed by kda_kernels.time_jax elsewhere.
  init     random params created directly on the device(s) in their logical-axis shardings, one param at a time by
           small jitted generators (MaxText/random_init.py: ~24 compiled programs for the 48B model; nothing is
           materialized on the host; a progress bar shows leaves and GB made). The JSON's `params` has the seconds
           of the abstract tree, of compiling and of generating, and device 0's peak memory.
  prefill  a --prompt-len prompt (batch 1) fed --prefill-chunk tokens per jitted call, each continuing the donated
           cache (chunked prefill bounds the MoE dispatch's temporaries); median wall time of --prefill-repeats runs
           after one warm-up; compile time reported apart. MoE dispatch: --prefill-moe.
  decode   per batch B (--batches), MoE dispatch (--decode-moe) and variant (--decode-variants: config overrides
           on the same params, e.g. decode_graph_scheduling=serialize; dense_kernel_layout=...: the same values
           with the dense kernels transposed on the device (Setup.params_for); keys 'xla_...' are XLA options of
           the step's compile, e.g. xla_gpu_autotune_level=0 (true / false: booleans); steps_per_call=N: N steps
           unrolled in each call of the timed program, one host dispatch for N steps, no tokens crc): the prefilled
           prompt's cache repeated over B rows (a synthetic cache of the same context when prefill did not run; an
           entry that only the variant's config makes, e.g. a kernel's counters, as zeros), B
           distinct first tokens, then ONE jitted single-step program (cache donated, greedy argmax inside, no host
           sync in the step) issued back to back.
           Every output of the step is written in place of its own donated input (cache, tokens, the running
           expert counts): the buffers keep their addresses from step to step, so XLA can replay the step's CUDA
           graphs without re-recording them. The step compiles with the config's decode XLA options
           (`decode_graph_scheduling`), as the Engine's decode loop does.
           After the warm-up steps: the crc32 of their greedy tokens and a checksum of every bit of the cache
           (`cache_checksum`); settings that run the same arithmetic must agree on both.
           The dense projections follow the config's `dense_matmul` and `dense_kernel_layout` (recorded per batch as
           `dense_impl`).
           TPOT = median over --repeats blocks of block wall time / --steps (the host dispatch overlaps the device,
           as in a device-side loop; `dispatch` = the host's time to issue a step: TPOT is host bound where they
           meet; steps_per_call=N against the default 1 shows how much of the TPOT is the host's); `synced` = median
           of --synced-steps steps each waited for (adds dispatch).
           The step also adds up the distinct experts each MoE layer routed to (the routing each MoE sows),
           and the roofline uses their mean over the timed steps. (Engine's decode runs all steps in one
           while_loop, which gives no per-step time; this step is Engine's step_fn as a program of its own.)
  profile  --profile-steps decode steps under jax.profiler for every decode setting; the trace's device kernels
           summed by HLO op, and by model component (kda/q_proj, moe/experts, ...) through the compiled HLO's
           op_name metadata; printed as the top --top ops with their share of the step time, and the time
           covered by at least one kernel (their union: less than their sum where kernels run side by side; XLA
           runs no CUDA graphs under the profiler unless XLA_FLAGS has
           --xla_enable_command_buffers_during_profiling=true), each op's share of it (`shared_time`), and the
           host's time per step in the step's call and in its CUDA graph launches (`host_event_times`). With
           the engine stage, also one more `Engine.generate` call per Engine and batch, its decode loop traced
           (`profile_dir`) and broken down per step by kernel (`profile_engine`).
  engine   per batch B, what a user of the Engine gets: `Engine.generate` (its prefill, then ONE program whose
           while_loop runs every decode step on the device: no host dispatch per step) on the same params, B
           prompts of --engine-prompt-len tokens (the Engine prefills a prompt in one program: a short one),
           --engine-tokens new tokens (greedy, no EOS: every step runs); one untimed call compiles, then --repeats
           timed calls. Per step = the decode loop's wall time / (--engine-tokens - 1) (the first token comes
           from the prefill's logits); the roofline at the loop's mean context, with the decode stage's measured
           distinct experts for B where it ran (else uniform routing's expectation). --engine-variants: config
           overrides per Engine (e.g. 'decode_loop_graphs=false'), each an Engine on the same params, one after
           the other in this process.

Roofline (per decode setting) = decode_bytes_per_step(config, B, context, distinct experts) / copy bandwidth (per
device: a mesh of N devices is assumed to split the bytes N ways). Prints a table and writes model_decode.json to
--out (default $OUT or .) after every stage, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import itertools
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

# The 48B model's ~98 GB of params need more than the default 75% of an H200's memory that XLA may allocate.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# A rerun (say, another --stages subset) loads the compiled programs instead of compiling them again.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jax-compilation-cache"))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from benchmarks import kda_kernels  # noqa: E402  (timing helpers, copy bandwidth; it lets torch share the GPU)
from MaxText import hf_weights, pyconfig, random_init, sharding  # noqa: E402
from MaxText.inference.compile_options import decode_compiler_options  # noqa: E402
from MaxText.layers.linears import dense_matmul_choice  # noqa: E402
from MaxText.layers.models import KimiLinearForCausalLM, init_cache  # noqa: E402
from MaxText.kernels import grouped_matmul  # noqa: E402

STAGES = ("copy", "init", "prefill", "decode", "profile", "engine")
DECODE_MODULE = "jit_decode_step"  # the XLA module name of the jitted `decode_step`
SMOKE = dict(config="configs/kimi_linear_tiny.yml", prompt_len=64, prefill_chunk=32, prefill_repeats=1, batches=[1, 2],
             steps=4, repeats=1, warmup=2, synced_steps=2, profile_steps=2, engine_prompt_len=16, engine_tokens=8)


# ------------------------------------------------------------------------------------------------ bytes per step


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts among `num_tokens` tokens that each route to `top_k` distinct experts uniformly:
    E * (1 - (1 - k/E)^b) (one token misses a given expert with probability 1 - k/E, independently of the others)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def roofline_ms(total_bytes: float, copy_bw: float, mesh) -> float:
    """The roofline of a step that must move `total_bytes`: at the measured copy bandwidth per device, the mesh's
    devices splitting the bytes."""
    return total_bytes / (copy_bw * mesh.size) * 1e3


def decode_bytes_per_step(config: ml_collections.FrozenConfigDict, batch: int, context: int,
                          distinct_experts_per_layer: float | Sequence[float]) -> dict[str, float]:
    """The bytes one decode step of `batch` rows with `context` cached tokens must move, by term, plus 'total'.

    Weights (`weight_dtype`) are read once per step: the embedding rows of the batch's input tokens, lm_head whole,
    every norm, every KDA / MLA projection (KDA conv kernels, A_log, dt_bias, o_norm included), the dense MLP layers,
    each MoE layer's router (its correction bias is float32) and shared experts, and the routed experts in use:
    `distinct_experts_per_layer` of them in each MoE layer (one number for all MoE layers, or one per MoE layer in
    layer order; see expected_distinct_experts). State: the KDA recurrent state read and written (2 * B * H * K * V * 4
    bytes per KDA layer), the KDA conv window read and written (2 * B * (W-1) * 3*H*K in `dtype`), and the MLA latent
    cache read (B * context * (kv_lora_rank + qk_rope_head_dim) in `dtype` per MLA layer). Activations and the one new
    cache row per layer are left out (they are small).
    """
    cfg = config
    weight, act = jnp.dtype(cfg.weight_dtype).itemsize, jnp.dtype(cfg.dtype).itemsize
    dim, heads, head_dim, width = cfg.emb_dim, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel_size
    qkv = heads * head_dim  # K = V = kda_head_dim
    kda_params = (3 * dim * qkv + 3 * width * qkv  # q, k, v projections and their short convolutions
                  + dim * head_dim + head_dim * qkv + heads + qkv  # f_a, f_b, A_log, dt_bias
                  + dim * heads  # b_proj
                  + dim * head_dim + head_dim * qkv + head_dim  # g_a, g_b, o_norm
                  + qkv * dim)  # o_proj
    q_dim = cfg.num_query_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    rank, latent = cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    q_params = dim * q_dim if not rank else dim * rank + rank + rank * q_dim  # q_proj | q_a, q_a_layernorm, q_b
    mla_params = (q_params + dim * latent + cfg.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
                  + cfg.kv_lora_rank * cfg.num_query_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # kv_b_proj
                  + cfg.num_query_heads * cfg.v_head_dim * dim)  # o_proj
    expert_params = 3 * dim * cfg.moe_mlp_dim  # gate, up, down
    n_kda, n_mla = cfg.layer_types.count("kda"), cfg.layer_types.count("mla")
    n_dense, n_moe = cfg.mlp_types.count("dense"), cfg.mlp_types.count("moe")
    if np.ndim(distinct_experts_per_layer) == 0:
        experts_used = n_moe * float(distinct_experts_per_layer)
    elif len(distinct_experts_per_layer) == n_moe:
        experts_used = float(np.sum(distinct_experts_per_layer))
    else:
        raise ValueError(f"distinct_experts_per_layer has {len(distinct_experts_per_layer)} entries; the config has "
                         f"{n_moe} MoE layers (give one number per MoE layer, or one number for all)")
    terms = {
        "embedding_rows": batch * dim * weight,
        "lm_head": dim * cfg.vocab_size * weight,
        "norms": (2 * cfg.num_decoder_layers + 1) * dim * weight,
        "kda_weights": n_kda * kda_params * weight,
        "mla_weights": n_mla * mla_params * weight,
        "dense_mlp": n_dense * 3 * dim * cfg.mlp_dim * weight,
        "router": n_moe * (dim * cfg.num_experts * weight + cfg.num_experts * 4),
        "shared_experts": n_moe * cfg.shared_experts * expert_params * weight,
        "routed_experts": experts_used * expert_params * weight,
        "kda_state": n_kda * 2 * batch * heads * head_dim * head_dim * 4,
        "kda_conv_state": n_kda * 2 * batch * (width - 1) * 3 * qkv * act,
        "mla_latent_cache": n_mla * batch * context * latent * act,
    }
    terms["total"] = float(sum(terms.values()))
    return terms


# ------------------------------------------------------------------------------------------------ profile parsing

# Lines the profiler derives from the kernel lines (reading them too would count every kernel twice).
DERIVED_LINES = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Launch Stats", "TensorFlow Ops",
                 "TensorFlow Name Scope", "Framework Ops", "Framework Name Scope", "Source code")


class OpTimes(NamedTuple):
    """Device time of one XLA program in a trace, by HLO op."""
    # HLO op name (the kernel's name when it has no 'hlo_op' stat or ran in a CUDA graph) -> its share of the time
    # covered by kernels (`shared_time`: a kernel's own time where it runs alone; the serial sum without graphs)
    nanoseconds: dict[str, float]
    kernels: dict[str, str]  # HLO op name -> the name of a kernel it launched
    launches: dict[str, int]  # HLO op name -> its kernel events (launches) in the trace
    source: str  # the plane and lines read
    summed_ns: float  # the kernels' durations summed (more than covered_ns where they ran side by side)
    covered_ns: float  # time covered by at least one of the events (their union)
    events: tuple  # (start ns, duration ns, HLO op, kernel) of every kept event, by start


def step_timeline(events, steps: int) -> list[dict[str, Any]]:
    """One step's kernels in start order (`OpTimes.events`), each as {op, kernel, start_us, us} from the step's
    start: the events from one launch of the step's marker to its next, the marker being the kernel launched once per
    step (of `steps`; the lm_head's product; by kernel name, which a loop's unrolled copies of an op share on a GPU)
    with the longest mean launch; of the trace's steps the shortest (a step with no host work between its kernels,
    e.g. no loop iteration launched from the host). [] where no kernel is launched once per step. Read beside each
    other, the starts show the dependent chain: which kernel waits for which, and the gaps between them."""
    launches: dict[str, list[float]] = defaultdict(list)
    for _, duration, _, kernel in events:
        launches[kernel].append(duration)
    per_step = [kernel for kernel, durations in launches.items() if len(durations) == steps]
    if not per_step or steps < 2:  # (one step: no launch of the marker after it)
        return []
    marker = max(per_step, key=lambda kernel: statistics.fmean(launches[kernel]))
    starts = [start for start, _, _, kernel in events if kernel == marker]
    first, end = min(zip(starts, starts[1:]), key=lambda pair: pair[1] - pair[0])
    return [{"op": op, "kernel": kernel, "start_us": (start - first) / 1e3, "us": duration / 1e3}
            for start, duration, op, kernel in events if first <= start < end]


def shared_time(intervals: list[tuple[float, float]]) -> list[float]:
    """Each (start, end) interval's share of the time the intervals cover: every instant split equally among the
    intervals running then (a kernel alone gets its whole duration; two side by side half of their overlap each).
    The shares add up to `covered_time`."""
    points = sorted([(start, 1, i) for i, (start, _) in enumerate(intervals)]
                    + [(end, 0, i) for i, (_, end) in enumerate(intervals)])  # at one instant, ends before starts
    shares, active, last = [0.0] * len(intervals), set(), None
    for instant, starts, i in points:
        if active and instant > last:
            for j in active:
                shares[j] += (instant - last) / len(active)
        last = instant
        if starts:
            active.add(i)
        else:
            active.discard(i)
    return shares


def covered_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Trace(NamedTuple):
    """A jax.profiler trace, read once: its file and its planes."""
    path: str
    planes: list


def read_trace(trace_dir: str) -> Trace:
    """The newest *.xplane.pb that jax.profiler.trace wrote under `trace_dir`, parsed."""
    from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: the profiler wrote no trace")
    return Trace(paths[-1], list(ProfileData.from_file(paths[-1]).planes))


def _exclusive(events: list[tuple[float, float]]) -> list[float]:
    """Durations of (start, duration) events on one line minus the durations of the events nested in them."""
    exclusive = [duration for _, duration in events]
    open_events: list[int] = []
    for i in sorted(range(len(events)), key=lambda j: (events[j][0], -events[j][1])):
        start, duration = events[i]
        while open_events and sum(events[open_events[-1]]) <= start:
            open_events.pop()
        if open_events:
            exclusive[open_events[-1]] -= duration
        open_events.append(i)
    return exclusive


def device_op_times(trace: Trace, module_name: str, accelerator: bool) -> OpTimes:
    """Device time per HLO op of the XLA program `module_name` (e.g. 'jit_decode_step') in a jax.profiler trace.

    Reads the first accelerator plane ('/device:GPU:0'): its kernel lines (the CUDA streams), each kernel keyed by its
    'hlo_op' stat (its own name when the stat is absent, or names a CUDA graph: XLA_FLAGS
    --xla_enable_command_buffers_during_profiling=true) and timed by its `shared_time`. Without an accelerator plane
    (CPU runs): the host plane's XLA thunk events (those with an 'hlo_op' stat), nested events' time taken out of their
    parents. Events of other programs are skipped where the 'hlo_module' stat names them. `accelerator`: the run used a
    GPU / TPU, so a trace without its plane (no device tracer, e.g. CUPTI unavailable) is an error, not a host-side
    breakdown.
    """
    planes = trace.planes
    devices = {p: re.match(r"/device:(GPU|TPU):(\d+)", p.name) for p in planes}
    devices = {p: int(match.group(2)) for p, match in devices.items() if match}
    if accelerator and not devices:
        raise ValueError(f"the trace {trace.path} has no accelerator plane (was the device tracer, e.g. CUPTI, "
                         f"unavailable?); planes: {[p.name for p in planes]}")
    if devices:
        plane = min(devices, key=devices.get)
        lines = ([line for line in plane.lines if line.name.startswith("Stream")]
                 or [line for line in plane.lines if line.name not in DERIVED_LINES])
        host = False
    else:
        hosts = [p for p in planes if p.name == "/host:CPU"]
        if not hosts:
            raise ValueError(f"the trace {trace.path} has neither an accelerator nor a host CPU plane; planes: "
                             f"{[p.name for p in planes]}")
        plane, lines, host = hosts[0], list(hosts[0].lines), True
    nanoseconds: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    kernels: dict[str, str] = {}
    keyed, own = [], []  # (op, kernel, start, duration) of every kept event; its own time (host: without children)
    for line in lines:
        events = []
        for event in line.events:
            stats = dict(event.stats)
            module = stats.get("hlo_module")
            if (host and "hlo_op" not in stats) or (module is not None and str(module).split("(")[0] != module_name):
                continue
            op = str(stats.get("hlo_op") or event.name)
            events.append((event.name if op.startswith("command_buffer") else op, event.name, event.start_ns,
                           event.duration_ns))
        keyed += events
        own += _exclusive([(start, duration) for *_, start, duration in events]) if host else [
            duration for *_, duration in events]
    intervals = [(start, start + duration) for *_, start, duration in keyed]
    for (op, kernel, _, _), duration in zip(keyed, own if host else shared_time(intervals)):
        nanoseconds[op] += duration
        launches[op] += 1
        kernels.setdefault(op, kernel)
    names = sorted({line.name for line in lines})  # a CUDA graph's kernels come on ~180 streams: named by count
    source = f"{plane.name}: " + (", ".join(names) if len(names) <= 4 else f"{len(names)} lines ({names[0]}, ...)")
    events = tuple(sorted((start, duration, op, kernel) for (op, kernel, start, _), duration in zip(keyed, own)))
    return OpTimes(dict(nanoseconds), kernels, dict(launches), source, sum(own), covered_time(intervals), events)


# Host events of a decode step in a trace, by name prefix: the jitted call (JAX's dispatch, XLA's thunks and the CUDA
# graph launches inside it) and the graph launches alone.
HOST_EVENTS = {"step_call_ms": f"PjitFunction(jit({DECODE_MODULE.removeprefix('jit_')}))",
               "graph_launch_ms": "cuGraphLaunch"}


def host_event_times(trace: Trace, steps: int) -> dict[str, float]:
    """Host milliseconds per step of each HOST_EVENTS entry in a jax.profiler trace: the union of the host plane's
    events whose names start with its prefix (nested ones count once), over `steps` steps. A CUDA graph's launch is
    synchronous host work that grows with its kernels (under the profiler also its tracing's)."""
    intervals = {key: [] for key in HOST_EVENTS}
    for plane in trace.planes:
        if plane.name.startswith("/host"):
            for line in plane.lines:
                for event in line.events:
                    for key, prefix in HOST_EVENTS.items():
                        if event.name.startswith(prefix):
                            intervals[key].append((event.start_ns, event.start_ns + event.duration_ns))
    return {key: covered_time(spans) * 1e-6 / steps for key, spans in intervals.items()}


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the op_name of its metadata ('jit(decode_step)/.../layers_3/mlp/experts/dot_general').

    An instruction without metadata that reads a param directly (XLA's own dtype converts, say) gets the param's
    path instead ('model/layers_0/mlp/down_proj/kernel/(param)').
    """
    names = {}
    for line in hlo_text.splitlines():
        instruction = re.match(r"\s*(?:ROOT\s+)?%?([^\s=(]+)\s*=", line)
        if instruction is None:
            continue
        op_name = re.search(r'\bop_name="([^"]*)"', line)
        param = None if op_name else re.search(r"%(params__[^\s,)]+)", line)
        if op_name:
            names[instruction.group(1)] = op_name.group(1)
        elif param:
            path = [part for part in param.group(1).split(".")[0].split("__") if part][1:]
            names[instruction.group(1)] = "/".join(path + ["(param)"])
    return names


def model_component(op_name: str | None, config) -> str:
    """Where an op comes from: 'kda/q_proj', 'moe/experts', 'mla', 'lm_head', 'layer norms', ... (the layer index
    replaced by the layer's kind, so that all layers of a kind add up; attention math without a projection of its
    own is just 'kda' / 'mla')."""
    if not op_name:
        return "(no op_name)"
    # Keep module names: drop the model class, jit / vmap / loop scopes, einsum specs and flax method scopes.
    parts = [p for p in op_name.split("/")[:-1]  # the last part is the primitive (dot_general, mul, ...)
             if p and p != "KimiLinearForCausalLM" and "(" not in p and "->" not in p and "." not in p
             and p not in ("while", "body", "cond", "closed_call")]
    if not parts:
        return "outside the model (sampling, ...)"
    if parts[0] != "model" or len(parts) == 1:
        return parts[0]  # lm_head
    layer = re.fullmatch(r"layers_(\d+)", parts[1])
    if layer is None:
        return parts[1]  # embed_tokens, norm
    index = int(layer.group(1))
    if len(parts) == 2 or parts[2].endswith("layernorm"):
        return "layer norms"
    kind = {"self_attn": config.layer_types[index], "mlp": config.mlp_types[index]}.get(parts[2], parts[2])
    return "/".join([kind] + parts[3:4])


def profile_breakdown(op_times: OpTimes, op_names: dict[str, str], config, steps: int, step_seconds: float,
                      top: int) -> dict[str, Any]:
    """Per-step device time by HLO op (the `top` largest) and by model component, in ms and % of `step_seconds`
    (each op's `shared_time`: they add up to the time covered by kernels); per op and per component also the kernel
    launches per step, the count that fusing would cut (and per component its number of distinct ops). In a trace
    of CUDA graphs an op is a kernel name (all its launches; components then by the names XLA gives its fusions,
    Pallas kernels under '(no op_name)')."""
    per_step = {op: ns * 1e-9 / steps for op, ns in op_times.nanoseconds.items()}

    def op_name(op):  # keyed by HLO op, or by a kernel named after its fusion ('loop_add_fusion_2' for '...fusion.2')
        return op_names.get(op) or op_names.get(re.sub(r"_(\d+)$", r".\1", op))

    launches = {op: op_times.launches[op] / steps for op in per_step}
    by_component: dict[str, float] = defaultdict(float)
    ops_by_component: dict[str, int] = defaultdict(int)
    launches_by_component: dict[str, float] = defaultdict(float)
    for op, seconds in per_step.items():
        component = model_component(op_name(op), config)
        by_component[component] += seconds
        ops_by_component[component] += 1
        launches_by_component[component] += launches[op]
    busy, covered = op_times.summed_ns * 1e-9 / steps, op_times.covered_ns * 1e-9 / steps

    def row(seconds):
        return {"ms": seconds * 1e3, "pct_of_step": 100 * seconds / step_seconds}

    return {
        "source": op_times.source, "steps": steps, "step_ms": step_seconds * 1e3, "busy_ms": busy * 1e3,
        "covered_ms": covered * 1e3, "idle_ms": (step_seconds - covered) * 1e3,  # idle: no kernel running
        "num_ops": len(per_step), "launches_per_step": sum(launches.values()),
        "top_ops": [{"op": op, "kernel": op_times.kernels.get(op), "component": model_component(op_name(op), config),
                     "op_name": op_name(op), "launches_per_step": launches[op], **row(seconds)}
                    for op, seconds in sorted(per_step.items(), key=lambda kv: -kv[1])[:top]],
        "components": [{"component": name, "ops": ops_by_component[name],
                        "launches_per_step": launches_by_component[name], **row(seconds)}
                       for name, seconds in sorted(by_component.items(), key=lambda kv: -kv[1])],
        "timeline": step_timeline(op_times.events, steps),  # one step's kernels by start (JSON only)
    }


# ------------------------------------------------------------------------------------------------ setup


_START = time.perf_counter()


def log(message: str) -> None:
    """Prints (flushed) with the seconds since the script started, so a run cut short shows where it was."""
    kda_kernels.log(f"[{time.perf_counter() - _START:7.1f} s] {message}")


def memory_note() -> str:
    """Device 0's memory in use, peak and limit ('' where the backend does not say)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" not in stats:
        return ""
    in_use, peak, limit = (stats.get(key, 0) / 1e9 for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"))
    return f" [device 0: {in_use:.1f} GB in use, peak {peak:.1f} GB of {limit:.1f} GB]"


def decode_steps_per_setting(args) -> int:
    """Decode steps one (batch, dispatch) setting takes at most: each writes one cache position (the profile's calls
    of several steps may trace up to steps_per_call - 1 more than --profile-steps)."""
    slack = max(variant_steps_per_call(variant) for variant in args.decode_variants) - 1
    return args.warmup + args.repeats * args.steps + args.synced_steps + args.profile_steps + slack


def load_benchmark_config(args, **extra) -> ml_collections.FrozenConfigDict:
    """The model config: bf16 params and activations, a cache long enough for the run, `--layers`, the command
    line's key=value overrides, then `extra` (the MoE dispatch of a stage)."""
    length = max(args.prompt_len + decode_steps_per_setting(args) + 1, args.engine_prompt_len + args.engine_tokens)
    overrides = ["dtype=bfloat16", "weight_dtype=bfloat16", f"max_target_length={length}"]
    if args.layers:
        full = pyconfig.load_config(args.config)
        if args.layers > full.num_decoder_layers:
            raise ValueError(f"--layers {args.layers}: {args.config} has only {full.num_decoder_layers} layers")
        kept = range(args.layers)
        overrides += [f"num_decoder_layers={args.layers}",
                      f"kda_layers={[i + 1 for i in kept if full.layer_types[i] == 'kda']}",
                      f"mla_layers={[i + 1 for i in kept if full.layer_types[i] == 'mla']}"]
    overrides += list(args.overrides) + [f"{key}={value}" for key, value in extra.items()]
    return pyconfig.load_config(args.config, overrides)


def moe_implementation(config: ml_collections.FrozenConfigDict, mesh: jax.sharding.Mesh) -> str:
    """The grouped matmul that `config.moe_grouped_matmul` resolves to on `mesh` (what the step runs; the expert
    widths decide with the gate/up products' shapes)."""
    with sharding.mesh_context(mesh, config):
        return grouped_matmul.resolve(config.moe_grouped_matmul, config.dtype, config.emb_dim, config.moe_mlp_dim)


def dense_implementation(config: ml_collections.FrozenConfigDict, mesh: jax.sharding.Mesh, batch: int) -> str:
    """What the projections' `dense_matmul` (linears.dense_matmul_choice) resolves to on `mesh` for a decode step of
    `batch` rows (q_proj's shape)."""
    with sharding.mesh_context(mesh, config):
        return grouped_matmul.resolve_dense(dense_matmul_choice(config), config.dtype, config.emb_dim,
                                            config.kda_num_heads * config.kda_head_dim, batch)


def setting_label(row: dict) -> str:
    """The MoE dispatch, 'auto (pallas)' when the requested one resolved to another implementation, then the decode
    variant's config overrides, if any."""
    moe = row["moe"] if row["moe"] == row["moe_impl"] else f"{row['moe']} ({row['moe_impl']})"
    return f"{moe}, {row['variant']}" if row.get("variant") else moe


class Setup:
    """The model config, device mesh, param shardings and the params on the device(s)."""

    def __init__(self, config: ml_collections.FrozenConfigDict, mesh: jax.sharding.Mesh, param_shardings, params):
        self.config, self.mesh, self.param_shardings, self.params = config, mesh, param_shardings, params
        self._abstract_caches: dict[tuple[int, ml_collections.FrozenConfigDict], Any] = {}
        self._relaid: dict[str, tuple[Any, Any]] = {}  # dense_kernel_layout -> (params, shardings)

    def params_for(self, config: ml_collections.FrozenConfigDict) -> tuple[Any, Any]:
        """(params, their shardings) for a decode setting's `config`: the setup's, or where the setting stores the
        dense kernels in the other layout (a --decode-variants value dense_kernel_layout=...), a copy with exactly
        those kernels transposed on the device (hf_weights.dense_kernel_paths; the same values), made once."""
        if config.expert_kernel_layout != self.config.expert_kernel_layout:
            raise ValueError(f"expert_kernel_layout={config.expert_kernel_layout} sets the routed experts' param "
                             f"shapes (the params here: {self.config.expert_kernel_layout}); give it as a config "
                             f"override (one process per layout), not in --decode-variants / --engine-variants")
        layout = config.dense_kernel_layout
        if layout == self.config.dense_kernel_layout:
            return self.params, self.param_shardings
        if layout not in self._relaid:
            transposed = {path[1:] for path in hf_weights.dense_kernel_paths(self.config)}  # without 'params'
            shardings = flax.traverse_util.flatten_dict(
                flax.core.unfreeze(sharding.param_shardings(config, self.mesh)))
            params = {path: jax.jit(jnp.transpose, out_shardings=shardings[path])(value) if path in transposed
                      else value for path, value in flax.traverse_util.flatten_dict(
                          flax.core.unfreeze(self.params)).items()}
            self._relaid[layout] = (flax.traverse_util.unflatten_dict(params),
                                    flax.traverse_util.unflatten_dict(shardings))
            log(f"decode: {len(transposed)} dense kernels transposed for dense_kernel_layout={layout}{memory_note()}")
        return self._relaid[layout]

    def rows(self, ndim: int) -> NamedSharding:
        return sharding.batch_sharding(self.mesh, self.config, ndim)

    def abstract_cache(self, batch: int, config: ml_collections.FrozenConfigDict | None = None):
        """The cache tree of `batch` rows (ShapeDtypeStructs) for `config` (default: the setup's; a decode setting's
        config may hold other entries, e.g. a kernel's counters); nothing is allocated."""
        config = self.config if config is None else config
        if (batch, config) not in self._abstract_caches:
            self._abstract_caches[batch, config] = jax.eval_shape(lambda: init_cache(config, batch))
        return self._abstract_caches[batch, config]

    def cache_shardings(self, batch: int, config: ml_collections.FrozenConfigDict | None = None):
        config = self.config if config is None else config
        return sharding.cache_shardings(self.abstract_cache(batch, config), self.mesh, config)

    def compile(self, fn, example_args, xla_options=None, **jit_kwargs):
        """(jax.jit(fn, **jit_kwargs) lowered and compiled for `example_args` with the XLA compile options
        `xla_options`, the seconds that took)."""
        start = time.perf_counter()
        with sharding.mesh_context(self.mesh, self.config):
            compiled = jax.jit(fn, **jit_kwargs).lower(*example_args).compile(xla_options or None)
        return compiled, time.perf_counter() - start


def init_setup(args, results) -> Setup:
    config = load_benchmark_config(args)
    mesh = sharding.create_mesh(config)
    sharding.check_mesh_fits_model(config, mesh)
    shardings = sharding.param_shardings(config, mesh)
    log(f"init: {config.num_decoder_layers} layers on mesh {sharding.describe_mesh(mesh)}, weight_dtype "
        f"{config.weight_dtype}, max_target_length {config.max_target_length}")
    # An "rbg" key: XLA's RngBitGenerator makes each param's bits in place, where threefry's unfused intermediates
    # (XLA:CPU) cost several times a param's size in temporaries.
    key = jax.random.key(config.seed, impl="rbg")
    params, summary = random_init.random_params_on_device(config, mesh, key, shardings=shardings)
    results["params"] = {"count": summary.num_params, "bytes": summary.num_bytes, "init_s": summary.total_s,
                         "mesh": sharding.describe_mesh(mesh), "leaves": summary.num_leaves,
                         "generators": summary.num_generators, "abstract_s": summary.abstract_s,
                         "compile_s": summary.compile_s, "generate_s": summary.generate_s,
                         "peak_bytes_in_use": summary.peak_bytes_in_use}
    log(f"init: {summary.describe()}{memory_note()}")
    return Setup(config, mesh, shardings, params)


# ------------------------------------------------------------------------------------------------ stages


def measure_copy_bandwidth(small: bool) -> dict[str, float]:
    """Device copy bandwidth (bytes read + written per second) as benchmarks/kda_kernels.py measures it."""
    if jax.default_backend() == "gpu" and not small:
        try:
            import torch  # pylint: disable=import-outside-toplevel
            torch_bw, jax_bw = kda_kernels.copy_bandwidth()
            torch.cuda.empty_cache()  # give its 4 GiB back before the model is created
            return {"torch_Bps": torch_bw, "jax_Bps": jax_bw, "used_Bps": max(torch_bw, jax_bw)}
        except Exception as e:  # noqa: BLE001 -- no torch with CUDA: the JAX copy alone
            log(f"copy: kda_kernels.copy_bandwidth failed ({type(e).__name__}: {e}); timing a JAX copy only")
    floats = 2 ** 22 if small else 2 ** 29
    seconds = kda_kernels.time_jax(jax.jit(lambda a: a * 1.0 + 0.0), jnp.ones((floats,), jnp.float32), blocks=3)
    return {"jax_Bps": 2 * 4 * floats / seconds, "used_Bps": 2 * 4 * floats / seconds}


def make_prefill_chunk(model):
    def prefill_chunk(params, cache, tokens):
        """tokens [B, C] continue `cache` -> (the new cache, greedy next token [B] int32 after the last position);
        the cache first, as it comes in: see `make_decode_step`."""
        logits, variables = model.apply({"params": params, "cache": cache}, tokens, model_mode="prefill",
                                        logits_to_keep=1, mutable=["cache"])
        return variables["cache"], jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    return prefill_chunk


def zero_cache_fn(setup: Setup, batch: int):
    return jax.jit(lambda: init_cache(setup.config, batch), out_shardings=setup.cache_shardings(batch))


def run_prefill(setup: Setup, args, results) -> Any:
    """Times the prefill of one prompt (batch 1); returns its filled cache."""
    chunk = min(args.prefill_chunk, args.prompt_len)
    if args.prompt_len % chunk:
        raise ValueError(f"--prompt-len {args.prompt_len} is not a multiple of --prefill-chunk {chunk}")
    config = load_benchmark_config(args, moe_grouped_matmul=args.prefill_moe)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, (1, args.prompt_len), dtype=np.int32)
    chunks = [jax.device_put(prompt[:, i:i + chunk], setup.rows(2)) for i in range(0, args.prompt_len, chunk)]
    zeros = zero_cache_fn(setup, 1)
    cache_shardings = setup.cache_shardings(1)
    step, compile_s = setup.compile(
        make_prefill_chunk(KimiLinearForCausalLM(config)), (setup.params, zeros(), chunks[0]),
        in_shardings=(setup.param_shardings, cache_shardings, setup.rows(2)),
        out_shardings=(cache_shardings, setup.rows(1)), donate_argnums=(1,))
    log(f"prefill: compiled a {chunk}-token chunk step (moe {config.moe_grouped_matmul}) in {compile_s:.1f} s")
    times = []
    for run in range(1 + args.prefill_repeats):
        cache = jax.block_until_ready(zeros())
        start = time.perf_counter()
        for tokens in chunks:
            cache, next_token = step(setup.params, cache, tokens)
        jax.block_until_ready((next_token, cache))
        times.append(time.perf_counter() - start)
        log(f"prefill: run {run} {'(warm-up) ' if run == 0 else ''}{times[-1] * 1e3:.1f} ms{memory_note()}")
    seconds = statistics.median(times[1:])
    results["prefill"] = {"prompt_len": args.prompt_len, "batch": 1, "chunk": chunk, "moe": config.moe_grouped_matmul,
                          "moe_impl": moe_implementation(config, setup.mesh),
                          "compile_s": compile_s, "ms": seconds * 1e3, "tokens_per_s": args.prompt_len / seconds,
                          "runs_ms": [t * 1e3 for t in times[1:]], "warmup_ms": times[0] * 1e3}
    return cache


def aliased_inputs(compiled) -> list[int | None]:
    """Per output leaf of a compiled program, the flat index of the donated input XLA writes it in place of (its
    input_output_alias), or None."""
    header = compiled.as_text().split("\n", 1)[0]
    aliases = {int(out): int(arg) for out, arg in re.findall(r"\{(\d+)\}: \((\d+),", header)}
    return [aliases.get(i) for i in range(compiled.out_tree.num_leaves)]


def outputs_in_place(compiled, first_input: int) -> bool:
    """Whether output leaf i is written in place of input leaf first_input + i, for every i: each buffer then keeps
    its address from call to call. (jax pairs each output with the first unused donated input of the same shape and
    dtype, in order: outputs in another order than their inputs trade buffers among same-shaped leaves on every
    call — the 48B step's 28 [1] int32 leaves did — and XLA re-records the step's CUDA graph each time.)"""
    return aliased_inputs(compiled) == list(range(first_input, first_input + compiled.out_tree.num_leaves))


def make_decode_step(model, num_experts: int):
    def decode_step(params, cache, tokens, distinct_sum):
        """tokens [B], distinct_sum [n_moe] int32 -> (cache, greedy next tokens [B] int32, distinct_sum + the
        distinct experts chosen per MoE layer in this step): the outputs in the order of the donated inputs, so that
        each is written in place of its own input (`outputs_in_place`)."""
        logits, variables = model.apply({"params": params, "cache": cache}, tokens[:, None],
                                        model_mode="autoregressive", mutable=["cache", "intermediates"])
        # each MoE layer's routing, as it sows it (whichever launch routed: the router's, or the post-attention
        # norm's with moe_router_in_norm)
        sown = flax.traverse_util.flatten_dict(flax.core.unfreeze(variables.get("intermediates", {})))
        routings = {key: value for key, value in sown.items() if key[-1] == "routing"}
        by_layer = sorted(routings.items(), key=lambda kv: int(re.search(r"layers_(\d+)", "/".join(kv[0])).group(1)))
        if len(by_layer) != distinct_sum.shape[0]:
            raise ValueError(f"expected the routing of {distinct_sum.shape[0]} MoE layers in the step's "
                             f"intermediates, got {len(by_layer)}: {sorted('/'.join(k) for k in routings)}")
        if by_layer:  # value: ((weights, expert ids),); one comparison for all layers (a per-layer scatter made a
            # kernel of ~45 us per step on an H200: instrumentation, not model work)
            ids = jnp.stack([output[0][1].reshape(-1) for _, output in by_layer])  # [n_moe, N*k]
            used = jnp.any(ids[:, :, None] == jnp.arange(num_experts, dtype=ids.dtype), axis=1)  # [n_moe, E]
            distinct = jnp.sum(used, axis=1, dtype=jnp.int32)
        else:
            distinct = jnp.zeros((0,), jnp.int32)
        return variables["cache"], jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), distinct_sum + distinct
    return decode_step


def unrolled(step, steps_per_call: int):
    """`step` applied `steps_per_call` times in one program (a Python loop: the steps' kernels in one graph, one host
    dispatch for all): the same signature and outputs, tokens of the last step."""
    if steps_per_call == 1:
        return step

    def decode_step(params, cache, tokens, distinct_sum):  # named as the one step: the profile finds DECODE_MODULE
        for _ in range(steps_per_call):
            cache, tokens, distinct_sum = step(params, cache, tokens, distinct_sum)
        return cache, tokens, distinct_sum
    return decode_step


def batch_cache(setup: Setup, prefilled, batch: int, context: int,
                config: ml_collections.FrozenConfigDict | None = None):
    """A `batch`-row cache at `context` tokens with the entries of `config`'s cache (default: the setup's): the
    prefilled 1-row cache repeated (an entry the prefill's config does not make, e.g. a kernel's counters, as zeros),
    or (no prefill) a synthetic one (random latents and states, `context` valid positions); decode cost does not
    depend on the values."""
    shardings = setup.cache_shardings(batch, config)
    abstract = setup.abstract_cache(batch, config)
    if prefilled is not None:
        def from_prefill(one_row):  # (the prefilled cache an argument: no constants in the program)
            leaves = dict(jax.tree_util.tree_flatten_with_path(one_row)[0])
            return jax.tree_util.tree_map_with_path(
                lambda path, leaf: jnp.repeat(leaves[path], batch, axis=0) if path in leaves
                else jnp.zeros(leaf.shape, leaf.dtype), abstract)
        return jax.jit(from_prefill, out_shardings=shardings)(prefilled)

    def synthetic(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        key = jax.random.fold_in(jax.random.key(1, impl="rbg"), zlib.crc32(jax.tree_util.keystr(path).encode()))
        if name == "index":
            return jnp.full(leaf.shape, context, leaf.dtype)
        if name == "key_valid":
            return jnp.broadcast_to(jnp.arange(leaf.shape[-1]) < context, leaf.shape)
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            return (0.1 * jax.random.normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype)
        return jnp.zeros(leaf.shape, leaf.dtype)

    return jax.jit(lambda: jax.tree_util.tree_map_with_path(synthetic, abstract), out_shardings=shardings)()


XLA_OPTION_PREFIX = "xla_"
# A --decode-variants key of this script, not of the config: decode steps per call of the timed program (`unrolled`).
STEPS_PER_CALL = "steps_per_call"


def variant_overrides(variant: str) -> dict[str, str]:
    """A --decode-variants value, 'key=value,key=value' ('' = none), as a dict: config overrides, and XLA options
    of the decode step's compile for keys that start with 'xla_' (`variant_xla_options`)."""
    pairs = [item.split("=", 1) for item in variant.split(",") if item.strip()]
    if any(len(pair) != 2 or not pair[0].strip() for pair in pairs):
        raise ValueError(f"decode variant {variant!r}: expected comma-separated key=value config overrides")
    return {key.strip(): value.strip() for key, value in pairs}


def variant_config_overrides(variant: str) -> dict[str, str]:
    """The config overrides of a --decode-variants value (its keys that are neither XLA options nor
    STEPS_PER_CALL)."""
    return {k: v for k, v in variant_overrides(variant).items()
            if not k.startswith(XLA_OPTION_PREFIX) and k != STEPS_PER_CALL}


def variant_steps_per_call(variant: str) -> int:
    """A --decode-variants value's STEPS_PER_CALL (default 1): decode steps per call of the timed program."""
    value = variant_overrides(variant).get(STEPS_PER_CALL, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"decode variant {variant!r}: {STEPS_PER_CALL}={value!r}, expected an integer >= 1")
    return int(value)


def variant_xla_options(variant: str) -> dict[str, str | bool]:
    """The XLA options of a --decode-variants value (keys 'xla_...', e.g. xla_gpu_autotune_level=0): passed to the
    decode step's compile only (`jax.stages.Lowered.compile`), so one process compares programs that differ only in
    them, on the same params and cache. The values true / false (any case) become Python bools (XLA's parser of a
    boolean option's string takes only 'True' / 'False'); the others pass as strings. XLA refuses an unknown option
    or value when the step compiles."""
    def value(text: str) -> str | bool:
        return {"true": True, "false": False}.get(text.lower(), text)

    return {k: value(v) for k, v in variant_overrides(variant).items() if k.startswith(XLA_OPTION_PREFIX)}


def cache_checksum(cache) -> int:
    """A checksum of every bit of `cache` (any change of a bit changes it): per leaf, on the device, the sum
    modulo 2^32 of its elements' bits (as unsigned words) times odd position weights; then the crc32 of those sums.
    Two settings that ran the same arithmetic from the same cache agree on it bit for bit."""
    def leaf_sum(leaf):
        if leaf.dtype == jnp.bool_:
            words = leaf.astype(jnp.uint32)
        else:
            words = jax.lax.bitcast_convert_type(leaf, jnp.dtype(f"uint{leaf.dtype.itemsize * 8}")).astype(jnp.uint32)
        words = words.ravel()
        return jnp.sum(words * (2 * jnp.arange(words.size, dtype=jnp.uint32) + 1), dtype=jnp.uint32)

    sums = jax.jit(lambda leaves: jnp.stack([leaf_sum(leaf) for leaf in leaves]))(jax.tree.leaves(cache))
    return zlib.crc32(np.asarray(sums).tobytes())


def decode_setting(batch: int, moe: str, variant: str) -> str:
    """A decode setting's name in the log and the errors: 'B=8 moe=auto fused_projections=true'."""
    return f"B={batch} moe={moe}" + (f" {variant}" if variant else "")


def run_decode(setup: Setup, args, batch: int, moe: str, variant: str, prefilled, copy_bw: float | None,
               profile: bool) -> dict:
    """Times (and profiles) the decode step at `batch` rows with MoE dispatch `moe` and the config overrides of
    `variant` (same params); returns its result row."""
    multiple = sharding.batch_multiple(setup.mesh, setup.config)
    if batch % multiple:
        raise ValueError(f"batch {batch} is not a multiple of the mesh's {multiple} batch shards")
    config = load_benchmark_config(args, moe_grouped_matmul=moe, **variant_config_overrides(variant))
    setting = decode_setting(batch, moe, variant)
    per_call = variant_steps_per_call(variant)
    if args.warmup % per_call or args.steps % per_call or args.synced_steps % per_call:
        raise ValueError(f"{setting}: --warmup {args.warmup}, --steps {args.steps} and --synced-steps "
                         f"{args.synced_steps} must be multiples of {STEPS_PER_CALL}={per_call}")
    cache = batch_cache(setup, prefilled, batch, args.prompt_len, config)
    params, param_shardings = setup.params_for(config)
    rng = np.random.default_rng(batch)
    tokens = jax.device_put(rng.choice(config.vocab_size, batch, replace=False).astype(np.int32), setup.rows(1))
    cache_shardings = setup.cache_shardings(batch, config)
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    counts = jax.device_put(np.zeros((config.mlp_types.count("moe"),), np.int32), replicated)  # distinct_sum
    step, compile_s = setup.compile(
        unrolled(make_decode_step(KimiLinearForCausalLM(config), config.num_experts), per_call),
        (params, cache, tokens, counts),
        in_shardings=(param_shardings, cache_shardings, setup.rows(1), replicated),
        out_shardings=(cache_shardings, setup.rows(1), replicated), donate_argnums=(1, 2, 3),
        xla_options={**decode_compiler_options(config), **variant_xla_options(variant)})
    log(f"decode {setting}: compiled in {compile_s:.1f} s")
    in_place = outputs_in_place(step, first_input=len(jax.tree.leaves(params)))
    if not in_place:
        log(f"decode {setting}: XLA does not write every output in place of its own input (buffers move between "
            f"steps: CUDA graphs touching them are re-recorded every step)")

    warmup_tokens = []  # greedy tokens of the untimed steps: equal across XLA flags / variants of the same program
    for _ in range(args.warmup // per_call):
        cache, tokens, counts = step(params, cache, tokens, counts)
        warmup_tokens.append(np.asarray(tokens))
    # Several steps per call give only every per_call-th token: no tokens crc (the cache's stands).
    tokens_crc32 = zlib.crc32(np.stack(warmup_tokens).tobytes()) if warmup_tokens and per_call == 1 else None
    cache_crc32 = cache_checksum(cache) if warmup_tokens else None  # every bit of the cache after those steps
    timed_from = np.asarray(counts)
    blocks, issued = [], []
    for _ in range(args.repeats):  # steps issued back to back, one wait per block
        start = time.perf_counter()
        for _ in range(args.steps // per_call):
            cache, tokens, counts = step(params, cache, tokens, counts)
        issued.append((time.perf_counter() - start) / args.steps)  # host time to issue a step (per_call: its share)
        jax.block_until_ready((tokens, counts, cache))
        blocks.append((time.perf_counter() - start) / args.steps)
    per_layer = (np.asarray(counts) - timed_from) / (args.repeats * args.steps)
    synced = []
    for _ in range(args.synced_steps // per_call):
        start = time.perf_counter()
        cache, tokens, counts = jax.block_until_ready(step(params, cache, tokens, counts))
        synced.append((time.perf_counter() - start) / per_call)
    tpot = statistics.median(blocks)
    uniform = expected_distinct_experts(config.num_experts, config.num_experts_per_tok, batch)
    row = {"batch": batch, "moe": moe, "variant": variant, "moe_impl": moe_implementation(config, setup.mesh),
           "dense_impl": dense_implementation(config, setup.mesh, batch),
           "fused_projections": bool(config.fused_projections), "outputs_in_place": in_place,
           "context": args.prompt_len,
           "cache": "prefill" if prefilled is not None else "synthetic", "compile_s": compile_s,
           "tpot_ms": tpot * 1e3, "tokens_per_s": batch / tpot,
           "block_ms": [b * 1e3 for b in blocks], "dispatch_ms": statistics.median(issued) * 1e3,
           "synced_step_ms": statistics.median(synced) * 1e3 if synced else None,
           "distinct_experts_per_layer": per_layer.tolist(),
           "distinct_experts_mean": float(per_layer.mean()) if per_layer.size else 0.0,
           "distinct_experts_uniform": uniform, "warmup_tokens_crc32": tokens_crc32,
           "warmup_cache_crc32": cache_crc32}
    row["bytes"] = decode_bytes_per_step(config, batch, args.prompt_len, per_layer if per_layer.size else 0.0)
    if copy_bw:
        row["roofline_ms"] = roofline_ms(row["bytes"]["total"], copy_bw, setup.mesh)
        row["tpot_over_roofline"] = row["tpot_ms"] / row["roofline_ms"]
        row["roofline_uniform_ms"] = roofline_ms(
            decode_bytes_per_step(config, batch, args.prompt_len, uniform)["total"], copy_bw, setup.mesh)
    ratio = f", roofline {row['roofline_ms']:.3f} ms (x{row['tpot_over_roofline']:.2f})" if copy_bw else ""
    log(f"decode {setting}: TPOT {row['tpot_ms']:.3f} ms, {row['tokens_per_s']:.1f} tokens/s{ratio}; "
        f"host dispatch {row['dispatch_ms']:.3f} ms per step; synced step {row['synced_step_ms'] or 0:.3f} ms; "
        f"distinct experts/layer {row['distinct_experts_mean']:.1f} "
        f"(uniform {uniform:.1f}); warm-up tokens crc32 {tokens_crc32}, cache crc32 {cache_crc32}{memory_note()}")
    if row["distinct_experts_mean"] < 0.8 * uniform:
        log(f"decode B={batch}: the rows route to fewer experts than uniform routing would; the roofline uses the "
            f"measured counts")
    if profile and args.profile_steps:
        row["profile"] = profile_decode(step, params, cache, tokens, counts, args, config, tpot, per_call,
                                        profile_tag("", setting))
    return row


def traced_profile(args, tag: str, module_name: str, run, breakdown_of) -> dict:
    """Runs `run(trace_dir)` (which writes a jax.profiler trace there), reads the device ops of XLA program
    `module_name` from it and returns `breakdown_of(trace, op_times)` (with the graphs note where it applies), or
    {'error': why} when tracing or parsing fails (logged; the timing stands without the profile). The trace lies
    under --trace-dir/`tag` (kept), else in a temporary folder."""
    trace_dir = os.path.join(args.trace_dir, tag) if args.trace_dir else tempfile.mkdtemp(prefix="model_decode_")
    try:
        run(trace_dir)
        trace = read_trace(trace_dir)
        op_times = device_op_times(trace, module_name, jax.default_backend() != "cpu")
        if not op_times.nanoseconds:
            raise ValueError(f"no device events of {module_name} in the trace ({op_times.source})")
        return with_graph_note(breakdown_of(trace, op_times), tag)
    except Exception as e:  # noqa: BLE001 -- the timing stands without the profile
        traceback.print_exc()
        log(f"profile {tag}: FAILED to trace or parse the profile ({type(e).__name__}: {e}); no breakdown")
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:
        if not args.trace_dir:
            shutil.rmtree(trace_dir, ignore_errors=True)


def profile_tag(prefix: str, setting: str) -> str:
    """A trace folder's name for a setting: one folder per setting under --trace-dir."""
    return prefix + re.sub(r"[^A-Za-z0-9_.=-]+", "_", setting)


def profile_decode(step, params, cache, tokens, counts, args, config, step_seconds: float, per_call: int,
                   tag: str) -> dict:
    """Traces --profile-steps decode steps (rounded up to calls of `per_call` steps) and returns the per-step
    breakdown (or {'error': why} when parsing fails)."""
    calls = -(-args.profile_steps // per_call)

    def run(trace_dir):
        state = (cache, tokens, counts)
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                state = step(params, *state)
            jax.block_until_ready(state)

    def breakdown_of(trace, op_times):
        breakdown = profile_breakdown(op_times, hlo_op_names(step.as_text()), config, calls * per_call,
                                      step_seconds, args.top)
        breakdown["host"] = host_event_times(trace, calls * per_call)
        log(f"profile {tag}: {breakdown['num_ops']} ops, device busy {breakdown['busy_ms']:.3f} (covered "
            f"{breakdown['covered_ms']:.3f}) of {breakdown['step_ms']:.3f} ms per step; host: the step's call "
            f"{breakdown['host']['step_call_ms']:.3f}, CUDA graph launches "
            f"{breakdown['host']['graph_launch_ms']:.3f} ms per step ({breakdown['source']})")
        return breakdown
    return traced_profile(args, tag, DECODE_MODULE, run, breakdown_of)


GRAPHS_AS_OPS_NOTE = ("XLA ran the step as CUDA graph(s) (command buffers), which the trace shows as one op each: "
                      "rerun with XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true (the graphs' kernels, "
                      "side by side) or --xla_gpu_enable_command_buffer= (no graphs; the TPOT of that run is then "
                      "without them)")


def with_graph_note(breakdown: dict, tag: str) -> dict:
    """`breakdown`, with a note where the trace shows CUDA graphs as single ops (their kernels unseen)."""
    if any(op["op"].startswith("command_buffer") for op in breakdown["top_ops"]):
        add_note(breakdown, GRAPHS_AS_OPS_NOTE, tag)
    return breakdown


def add_note(breakdown: dict, note: str, tag: str) -> None:
    """Appends `note` to the profile's notes (the report prints them) and logs it."""
    breakdown["note"] = "; ".join(filter(None, [breakdown.get("note"), note]))
    log(f"profile {tag}: {note}")


LOOP_GRAPHS_PROFILE_NOTE = (
    "the decode loop ran as one CUDA graph with conditional nodes (decode_loop_graphs): a trace of it held ~30 of the "
    "48B step's ~640 kernel launches per step (covered 0.12 of 2.55 ms; benchmarks/RESULTS.md, twenty-eighth "
    "session), so this breakdown misses most kernels; profile an Engine variant with decode_loop_graphs=false")


def profile_engine(engine, prompts, new_tokens: int, step_seconds: float, args, tag: str) -> dict:
    """One more `engine.generate(prompts, new_tokens)` with its decoding traced (`profile_dir`): its decode loop's
    device time per step (the program `engine.DECODE_PROGRAM` over new_tokens - 1 steps) by kernel, as
    `profile_breakdown` (components unnamed: the loop's HLO is not at hand), or {'error': why}."""
    from MaxText.inference.engine import DECODE_PROGRAM  # pylint: disable=import-outside-toplevel

    def breakdown_of(_, op_times):
        breakdown = profile_breakdown(op_times, {}, engine.config, new_tokens - 1, step_seconds, args.top)
        log(f"profile {tag}: {breakdown['num_ops']} ops, device busy {breakdown['busy_ms']:.3f} (covered "
            f"{breakdown['covered_ms']:.3f}) of {breakdown['step_ms']:.3f} ms per step, "
            f"{breakdown['launches_per_step']:.0f} launches per step ({breakdown['source']})")
        if engine.config.decode_loop_graphs and jax.default_backend() == "gpu":
            add_note(breakdown, LOOP_GRAPHS_PROFILE_NOTE, tag)
        return breakdown
    return traced_profile(args, tag, DECODE_PROGRAM,
                          lambda trace_dir: engine.generate(prompts, new_tokens, profile_dir=trace_dir),
                          breakdown_of)


def run_engine(engine, args, batch: int, variant: str, copy_bw: float | None, decode_rows: Sequence[dict],
               profile: bool = False) -> dict:
    """`engine.generate` (an Engine on the setup's params, its config with the overrides of `variant`) at `batch` rows
    (the `engine` stage): its decode loop's time per step; with `profile`, one more call traced (`profile_engine`)."""
    config, new_tokens = engine.config, args.engine_tokens
    prompts = [[1 + (7 * row + 3 * i) % (config.vocab_size - 1) for i in range(args.engine_prompt_len)]
               for row in range(batch)]
    start = time.perf_counter()
    engine.generate(prompts, new_tokens)
    compile_s = time.perf_counter() - start
    per_step, prefill_s = [], []
    for _ in range(args.repeats):
        tokens = engine.generate(prompts, new_tokens)
        stats = engine.last_stats
        per_step.append(stats.decode_seconds / (new_tokens - 1))
        prefill_s.append(stats.prefill_seconds)
    ms = statistics.median(per_step) * 1e3
    measured = [r for r in decode_rows if r["batch"] == batch and r["distinct_experts_mean"]]
    distinct = measured[0]["distinct_experts_mean"] if measured else \
        expected_distinct_experts(config.num_experts, config.num_experts_per_tok, batch)
    context = args.engine_prompt_len + new_tokens // 2
    row = {"batch": batch, "variant": variant, "prompt_len": args.engine_prompt_len, "new_tokens": new_tokens,
           "ms_per_step": ms, "runs_ms_per_step": [t * 1e3 for t in per_step], "tokens_per_s": batch / (ms / 1e3),
           "prefill_ms": statistics.median(prefill_s) * 1e3, "first_call_s": compile_s,
           "distinct_experts": distinct, "distinct_experts_from": "decode stage" if measured else "uniform",
           "tokens_crc32": zlib.crc32(np.asarray(tokens, np.int32).tobytes()),
           "bytes": decode_bytes_per_step(config, batch, context, distinct)}
    if copy_bw:
        row["roofline_ms"] = roofline_ms(row["bytes"]["total"], copy_bw, engine.mesh)
        row["over_roofline"] = ms / row["roofline_ms"]
    setting = decode_setting(batch, config.moe_grouped_matmul, variant)
    ratio = f", roofline {row['roofline_ms']:.3f} ms (x{row['over_roofline']:.2f})" if copy_bw else ""
    log(f"engine {setting}: {ms:.3f} ms per decode step ({row['tokens_per_s']:.1f} tokens/s){ratio}; prefill "
        f"{row['prefill_ms']:.1f} ms; first call {compile_s:.1f} s{memory_note()}")
    if profile:
        row["profile"] = profile_engine(engine, prompts, new_tokens, ms / 1e3, args,
                                        profile_tag("engine_", setting))
    return row


# ------------------------------------------------------------------------------------------------ report


def environment(argv: Sequence[str]) -> dict[str, Any]:
    import jaxlib  # pylint: disable=import-outside-toplevel
    device = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "benchmarks/model_decode.py", *argv]), "jax": jax.__version__,
            "jaxlib": getattr(jaxlib, "__version__", "?"), "python": platform.python_version(),
            "platform": device.platform, "device": device.device_kind, "num_devices": jax.device_count(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def write_json(out_dir: str, results: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model_decode.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def report(results: dict) -> str:
    """The results as markdown tables."""
    env, lines = results["env"], []
    lines.append(f"## Kimi-Linear model benchmark: {env['device']} x {env['num_devices']}, JAX {env['jax']}, "
                 f"{env['date']}")
    lines.append(f"`{env['command']}`\n")
    if "params" in results:
        p = results["params"]
        lines.append(f"- params: {p['count'] / 1e9:.3f} B, {p['bytes'] / 1e9:.2f} GB, mesh {p['mesh']}, created on "
                     f"device in {p['init_s']:.1f} s ({p['generators']} compiled generators: compile "
                     f"{p['compile_s']:.1f} s, generate {p['generate_s']:.1f} s)")
    bw = results.get("copy_bandwidth")
    if bw:
        parts = ", ".join(f"{k.split('_')[0]} {v / 1e12:.3f} TB/s" for k, v in bw.items() if k != "used_Bps")
        lines.append(f"- copy bandwidth (read + write): {parts}; the roofline uses {bw['used_Bps'] / 1e12:.3f} TB/s")
    pre = results.get("prefill")
    if pre:
        lines.append(f"- prefill, batch 1, {pre['prompt_len']} tokens in chunks of {pre['chunk']} "
                     f"(moe {setting_label(pre)}): {pre['ms']:.1f} ms, {pre['tokens_per_s']:.0f} tokens/s "
                     f"(compile {pre['compile_s']:.1f} s)")
    if results.get("decode"):
        lines.append(f"\n### Decode, context {results['decode'][0]['context']} (TPOT: median over blocks of "
                     f"back-to-back steps)\n")
        lines.append("| batch | moe | dense | TPOT ms | tokens/s | roofline ms | TPOT / roofline | host dispatch ms | "
                     "synced step ms | distinct experts / layer (uniform) | GB / step | compile s | "
                     "warm-up tokens / cache crc32 |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        first_crc = {}  # batch -> the first setting's warm-up (tokens, cache) crc32s
        for r in results["decode"]:
            roof = (f"{r['roofline_ms']:.3f} | {r['tpot_over_roofline']:.2f}" if "roofline_ms" in r else "- | -")
            crc = (r.get("warmup_tokens_crc32"), r.get("warmup_cache_crc32"))
            first = first_crc.setdefault(r["batch"], crc)
            same = "first" if first is crc else " / ".join(  # vs the batch's first setting
                "-" if None in (mine, theirs) else "same" if mine == theirs else "DIFFER"
                for mine, theirs in zip(crc, first))
            lines.append(f"| {r['batch']} | {setting_label(r)} | {r.get('dense_impl', '-')} | {r['tpot_ms']:.3f} | "
                         f"{r['tokens_per_s']:.1f} | {roof} | {r.get('dispatch_ms', 0):.3f} | "
                         f"{r['synced_step_ms'] or 0:.3f} | {r['distinct_experts_mean']:.1f} "
                         f"({r['distinct_experts_uniform']:.1f}) | {r['bytes']['total'] / 1e9:.2f} | "
                         f"{r['compile_s']:.1f} | {crc[0]} / {crc[1]} ({same}) |")
        lines.append("\nBytes per decode step (GB): the roofline's terms (decode_bytes_per_step)\n")
        lines.append("| batch | moe | other weights | routed experts | KDA state + conv | MLA latent cache | total |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in results["decode"]:
            b = {k: v / 1e9 for k, v in r["bytes"].items()}
            state = b["kda_state"] + b["kda_conv_state"]
            whole = b["total"] - b["routed_experts"] - state - b["mla_latent_cache"]
            lines.append(f"| {r['batch']} | {setting_label(r)} | {whole:.3f} | {b['routed_experts']:.3f} | "
                         f"{state:.3f} | {b['mla_latent_cache']:.3f} | {b['total']:.3f} |")
        for r in results["decode"]:
            if r.get("profile"):
                lines += profile_lines(f"Profile, batch {r['batch']}, moe {setting_label(r)}", r["profile"])
    if results.get("engine"):
        lines.append("\n### Engine.generate (one while_loop program for all decode steps)\n")
        lines.append("| batch | variant | prompt | new tokens | ms / step | tokens/s | roofline ms | ms / step / "
                     "roofline | distinct experts / layer (from) | prefill ms | first call s | tokens crc32 |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results["engine"]:
            roof = f"{r['roofline_ms']:.3f} | {r['over_roofline']:.2f}" if "roofline_ms" in r else "- | -"
            lines.append(f"| {r['batch']} | {r['variant'] or 'defaults'} | {r['prompt_len']} | {r['new_tokens']} | "
                         f"{r['ms_per_step']:.3f} | {r['tokens_per_s']:.1f} | {roof} | {r['distinct_experts']:.1f} "
                         f"({r['distinct_experts_from']}) | {r['prefill_ms']:.1f} | {r['first_call_s']:.1f} | "
                         f"{r['tokens_crc32']} |")
        for r in results["engine"]:
            if r.get("profile"):
                lines += profile_lines(f"Profile, Engine.generate's decode loop, batch {r['batch']}, "
                                       f"{r['variant'] or 'defaults'}", r["profile"])
    for stage, error in results["errors"].items():
        lines.append(f"\n**stage {stage} failed**: {error}")
    return "\n".join(lines)


def profile_lines(title: str, prof: dict) -> list[str]:
    """The report's section of one profile (`profile_breakdown`'s dict, or {'error': why})."""
    lines = [f"\n### {title}"]
    if "error" in prof:
        return lines + [f"profile unavailable: {prof['error']}"]
    if "host" in prof:
        lines.append(f"host per step (under the profiler): the step's call {prof['host']['step_call_ms']:.3f} ms, "
                     f"CUDA graph launches {prof['host']['graph_launch_ms']:.3f} ms\n")
    lines.append(f"device busy {prof['busy_ms']:.3f} ms (kernel time summed; {prof['covered_ms']:.3f} ms covered by at "
                 f"least one kernel) of a {prof['step_ms']:.3f} ms step ({prof['num_ops']} ops, "
                 f"{prof['launches_per_step']:.0f} kernel launches per step; {prof['source']})\n")
    if prof.get("note"):
        lines.append(f"note: {prof['note']}\n")
    lines.append("| component | ms / step | % of step | ops | launches / step | µs / launch |\n"
                 "|---|---|---|---|---|---|")
    lines += [f"| {c['component']} | {c['ms']:.3f} | {c['pct_of_step']:.1f} | {c['ops']} | "
              f"{c['launches_per_step']:.1f} | {c['ms'] * 1e3 / max(c['launches_per_step'], 1e-9):.1f} |"
              for c in prof["components"]]
    lines.append("\n| op | component | kernel | ms / step | % of step | launches / step |\n"
                 "|---|---|---|---|---|---|")
    lines += [f"| {o['op']} | {o['component']} | {(o['kernel'] or '')[:60]} | {o['ms']:.3f} | "
              f"{o['pct_of_step']:.1f} | {o['launches_per_step']:.1f} |" for o in prof["top_ops"]]
    return lines


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    parser.add_argument("--config", default=None, help="model yml (default configs/kimi_linear.yml; --smoke: tiny)")
    parser.add_argument("--smoke", action="store_true", help="tiny config and sizes: the whole script in seconds")
    parser.add_argument("--layers", type=int, default=0, help="keep the config's first N layers (0 = all)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of model_decode.json")
    parser.add_argument("--prompt-len", type=int, default=4096, help="prompt tokens = decode context")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="prompt tokens per prefill call")
    parser.add_argument("--prefill-repeats", type=int, default=2, help="timed prefills after one warm-up")
    parser.add_argument("--prefill-moe", default="auto", choices=grouped_matmul.CHOICES,
                        help="moe_grouped_matmul of the prefill")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="decode batch sizes")
    parser.add_argument("--decode-moe", nargs="+", default=["auto"], choices=grouped_matmul.CHOICES,
                        help="moe_grouped_matmul values to decode with (each one is a decode setting)")
    parser.add_argument("--decode-variants", nargs="+", default=[""],
                        help="config overrides per decode setting, each 'key=value,...' ('' = none), on the same "
                             "params (e.g. 'fused_projections=true' 'dense_matmul=xla'); keys 'xla_...' are XLA "
                             "options of the step's compile (e.g. 'xla_gpu_autotune_level=0', "
                             "'xla_gpu_enable_pdl=true': true / false pass as booleans); 'steps_per_call=N' "
                             "unrolls N steps in each timed call")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed block")
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks per decode setting")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps before timing")
    parser.add_argument("--synced-steps", type=int, default=8, help="individually synchronized steps")
    parser.add_argument("--profile-steps", type=int, default=3, help="decode steps traced by the profiler")
    parser.add_argument("--top", type=int, default=20, help="ops listed per profile")
    parser.add_argument("--trace-dir", default="", help="keep the profiler traces here (default: a deleted temp dir)")
    parser.add_argument("--engine-prompt-len", type=int, default=64, help="prompt tokens of the engine stage")
    parser.add_argument("--engine-tokens", type=int, default=64, help="new tokens per Engine.generate call")
    parser.add_argument("--engine-variants", nargs="+", default=[""],
                        help="config overrides per Engine of the engine stage, each 'key=value,...' ('' = none), "
                             "on the same params (e.g. 'decode_loop_graphs=false')")
    args = parser.parse_intermixed_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():  # the smoke sizes, where the command line kept the default
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    args.config = args.config or "configs/kimi_linear.yml"
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        parser.error(f"--stages {','.join(unknown)} unknown; choose from {','.join(STAGES)}")
    if "profile" in args.stages and not {"decode", "engine"} & set(args.stages):
        parser.error("the profile stage traces the decode settings and the Engines: add 'decode' or 'engine' to "
                     "--stages")
    if "engine" in args.stages and (args.engine_tokens < 2 or args.engine_prompt_len < 1):
        parser.error(f"the engine stage needs --engine-tokens >= 2 (one decode step) and --engine-prompt-len >= 1, "
                     f"got {args.engine_tokens} and {args.engine_prompt_len}")
    for variant in args.decode_variants:
        try:
            variant_overrides(variant)
            variant_steps_per_call(variant)
        except ValueError as e:
            parser.error(f"--decode-variants: {e}")
    for variant in args.engine_variants:
        try:
            step_only = [key for key in variant_overrides(variant) if key not in variant_config_overrides(variant)]
        except ValueError as e:
            parser.error(f"--engine-variants: {e}")
        if step_only:
            parser.error(f"--engine-variants {variant!r}: {', '.join(step_only)} apply to the decode stage's step "
                         f"only; an Engine takes config keys (its XLA options come from the config)")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    results: dict[str, Any] = {"env": environment(argv), "args": vars(args), "stages": {}, "errors": {},
                               "decode": [], "engine": []}
    log(json.dumps(results["env"]))
    state: dict[str, Any] = {"setup": None, "prefilled": None}

    def stage(name: str, fn) -> None:
        log(f"stage {name} ...")
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- record it, keep the other stages' results
            traceback.print_exc()
            results["errors"][name] = f"{type(e).__name__}: {str(e)[:800]}"
            log(f"stage {name} FAILED: {results['errors'][name]}")
        results["stages"][name] = time.perf_counter() - start
        log(f"stage {name} done in {results['stages'][name]:.1f} s; wrote {write_json(args.out, results)}")

    def copy():
        results["copy_bandwidth"] = measure_copy_bandwidth(small=args.smoke)
        log("copy bandwidth: " + ", ".join(f"{k} {v / 1e12:.3f} TB/s" for k, v in results["copy_bandwidth"].items()))

    def init():
        state["setup"] = init_setup(args, results)
        results["config"] = {"path": args.config, "layers": state["setup"].config.num_decoder_layers,
                             "max_target_length": state["setup"].config.max_target_length,
                             "overrides": list(args.overrides)}

    def prefill():
        state["prefilled"] = run_prefill(state["setup"], args, results)

    def decode():
        copy_bw = results.get("copy_bandwidth", {}).get("used_Bps")
        for batch in args.batches:
            for moe, variant in itertools.product(args.decode_moe, args.decode_variants):
                setting = f"decode {decode_setting(batch, moe, variant)}"
                try:
                    results["decode"].append(run_decode(state["setup"], args, batch, moe, variant, state["prefilled"],
                                                        copy_bw, "profile" in args.stages))
                except Exception as e:  # noqa: BLE001 -- one setting failing (e.g. out of memory) leaves the others
                    traceback.print_exc()
                    results["errors"][setting] = f"{type(e).__name__}: {str(e)[:800]}"
                    log(f"{setting} FAILED: {type(e).__name__}: {str(e)[:300]}")
                write_json(args.out, results)

    def engine():
        from MaxText.inference.engine import Engine  # pylint: disable=import-outside-toplevel

        setup = state["setup"]
        copy_bw = results.get("copy_bandwidth", {}).get("used_Bps")
        for variant in args.engine_variants:
            config = load_benchmark_config(args, **variant_config_overrides(variant))
            user_engine = Engine(config, setup.params_for(config)[0], setup.mesh)  # the same arrays: no copy
            for batch in args.batches:
                results["engine"].append(run_engine(user_engine, args, batch, variant, copy_bw, results["decode"],
                                                    "profile" in args.stages))
                write_json(args.out, results)

    if "copy" in args.stages:
        stage("copy", copy)
    if set(args.stages) & {"init", "prefill", "decode", "engine"}:
        stage("init", init)
    if state["setup"] is not None:
        if "prefill" in args.stages:
            stage("prefill", prefill)
        if "decode" in args.stages:
            stage("decode", decode)
        if "engine" in args.stages:
            stage("engine", engine)
    kda_kernels.log("\n" + report(results))
    log(f"wrote {write_json(args.out, results)}")
    return results


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
