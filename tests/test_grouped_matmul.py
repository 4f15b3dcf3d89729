"""The MoE grouped matmul (MaxText/kernels/grouped_matmul): the Pallas kernel's tile schedule and, through the Pallas
interpreter on CPU, its results against the gather oracle; the dispatcher's choices and errors. The Triton compile
and the GPU speed are checked by benchmarks/grouped_matmul.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.kernels import grouped_matmul as gmm
from MaxText.kernels.grouped_matmul import pallas_gmm
from MaxText.kernels.grouped_matmul.naive import gather_matmul

GROUP_SIZES = {
    "decode, one row per expert": [0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 0],
    "uneven, empty groups, groups over block_m": [3, 0, 40, 1, 0, 17, 16, 0, 23],
    "one group": [37],
}


def _problem(sizes, contract, out_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    rows = jnp.asarray(rng.normal(size=(int(sizes.sum()), contract)), dtype)
    weights = jnp.asarray(rng.normal(size=(len(sizes), contract, out_dim)) / np.sqrt(contract), dtype)
    row_groups = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes), jnp.int32)
    return rows, weights, jnp.asarray(sizes), row_groups


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("name", list(GROUP_SIZES))
def test_tile_schedule_covers_every_row_once_within_its_group(name, block_m):
    sizes = np.asarray(GROUP_SIZES[name])
    group, start, end = (np.asarray(a) for a in pallas_gmm.tile_schedule(jnp.asarray(sizes), int(sizes.sum()),
                                                                         block_m))
    owner = np.repeat(np.arange(len(sizes)), sizes)
    covered = np.zeros(sizes.sum(), int)
    for g, s, e in zip(group, start, end):
        if s == e:
            continue
        rows = np.arange(s, min(s + block_m, e))
        assert (owner[rows] == g).all(), (g, s, e)  # a tile holds rows of its own group only
        covered[rows] += 1
    assert (covered == 1).all()
    assert len(group) >= sum(-(-n // block_m) for n in sizes)  # the static bound holds every real tile


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("rowwise_max_rows", [0, 1000])  # the `tiles` grid, the `rows` grid
@pytest.mark.parametrize("name", list(GROUP_SIZES))
def test_pallas_interpret_matches_gather_fp32(name, rowwise_max_rows, split_k):
    rows, weights, sizes, row_groups = _problem(GROUP_SIZES[name], 64, 48, jnp.float32)
    want = gather_matmul(rows, weights, row_groups, precision=jax.lax.Precision.HIGHEST)
    got = pallas_gmm.grouped_matmul(rows, weights, sizes, row_groups, block_k=32, split_k=split_k,
                                    rowwise_max_rows=rowwise_max_rows, interpret=True)  # 2 K blocks, N blocks of 16
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_rows_grid_on_tensor_cores_matches_gather(dtype, tol):
    """rows_mma: each row padded to a 16-row tile and multiplied on the tensor cores (3-pass tf32 for fp32), with
    extra weights and K split too."""
    rows, weights, sizes, row_groups = _problem(GROUP_SIZES["decode, one row per expert"], 64, 48, dtype)
    extra = jnp.asarray(np.random.default_rng(9).normal(size=(1, 64, 48)) / 8, dtype)
    row_groups = row_groups.at[3].set(len(sizes))  # one row of the extra group
    want = gather_matmul(rows.astype(jnp.float32), jnp.concatenate([weights, extra]).astype(jnp.float32), row_groups,
                         precision=jax.lax.Precision.HIGHEST)
    call = functools.partial(pallas_gmm.grouped_matmul, weights=weights, group_sizes=sizes, row_groups=row_groups,
                             extra_weights=extra, block_k=32, split_k=2, interpret=True)
    got = call(rows, rows_mma=True)
    assert got.dtype == dtype
    for mma in (False, True):  # the kernel multiplies on the tensor cores only with rows_mma
        assert ("dot_general" in str(jax.make_jaxpr(functools.partial(call, rows_mma=mma))(rows))) == mma
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= tol


@pytest.mark.parametrize("mma", [False, True])
def test_rows_grid_reads_extra_weights_stored_out_in(mma):
    """extra_out_in: the extra group's matrix stored [X, N, K] (an out_in model's shared expert) is read transposed:
    the products equal those with the same matrix stored [X, K, N]; a [X, K, N] array is refused by shape."""
    rows, weights, sizes, row_groups = _problem(GROUP_SIZES["decode, one row per expert"], 64, 48, jnp.float32)
    extra = jnp.asarray(np.random.default_rng(9).normal(size=(1, 64, 48)) / 8, jnp.float32)  # [1, K, N]
    row_groups = row_groups.at[3].set(len(sizes))  # one row of the extra group
    call = functools.partial(pallas_gmm.grouped_matmul, rows, weights, sizes, row_groups, block_k=32, split_k=2,
                             rows_mma=mma, interpret=True)
    want = call(extra_weights=extra)
    got = call(extra_weights=jnp.swapaxes(extra, 1, 2), extra_out_in=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"expected one extra weight array \[X, 48, 64\] per weight array"):
        call(extra_weights=extra, extra_out_in=True)


def test_pallas_interpret_matches_gather_bf16_prefill_tiles():
    sizes = GROUP_SIZES["uneven, empty groups, groups over block_m"] * 12  # 1200 rows: block_m 64
    rows, weights, sizes, row_groups = _problem(sizes, 128, 64, jnp.bfloat16, seed=1)
    want = gather_matmul(rows.astype(jnp.float32), weights.astype(jnp.float32), row_groups,
                         precision=jax.lax.Precision.HIGHEST)
    got = pallas_gmm.grouped_matmul(rows, weights, sizes, row_groups, interpret=True)
    assert got.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= 1e-2, f"bf16 relative L2 error {rel:.3g}"


@pytest.mark.parametrize("rows_one_launch", [False, True])
def test_rows_grid_extra_weights_serve_the_groups_past_e(rows_one_launch):
    """Rows of group E + x meet extra matrix x (as if it were appended to the [E, K, N] arrays), for a tuple of
    weight arrays in one or several launches; too many rows for the rows grid, or mismatched extras, are refused."""
    rng = np.random.default_rng(3)
    weights = [jnp.asarray(rng.normal(size=(6, 64, 48)) / 8, jnp.float32) for _ in range(2)]
    extras = [jnp.asarray(rng.normal(size=(2, 64, 48)) / 8, jnp.float32) for _ in range(2)]
    row_groups = jnp.asarray([3, 6, 0, 7, 6, 5, 3], jnp.int32)  # 6 and 7: the extra matrices
    rows = jnp.asarray(rng.normal(size=(7, 64)), jnp.float32)
    sizes = jnp.zeros((6,), jnp.int32)  # unused by the rows grid
    got = pallas_gmm.grouped_matmul(rows, tuple(weights), sizes, row_groups, extra_weights=tuple(extras), block_k=32,
                                    split_k=2, rows_one_launch=rows_one_launch, interpret=True)
    for g, w, x in zip(got, weights, extras):
        want = gather_matmul(rows, jnp.concatenate([w, x]), row_groups, precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="extra_weights need the rows grid"):
        pallas_gmm.grouped_matmul(rows, weights[0], sizes, row_groups, extra_weights=extras[0], rowwise_max_rows=4,
                                  interpret=True)
    with pytest.raises(ValueError, match=r"one extra weight array \[X, 64, 48\] per weight array"):
        pallas_gmm.grouped_matmul(rows, tuple(weights), sizes, row_groups, extra_weights=extras[0], interpret=True)


def test_vector_matrix_partials_sum_to_the_product_of_a_bf16_kernel_under_fp32_rows():
    """One partial product per 128-channel block of K, the kernel read as stored (bf16) and multiplied in fp32:
    each part is that block's exact product, and they sum to the fp32 product."""
    rng = np.random.default_rng(2)
    rows = jnp.asarray(rng.normal(size=(3, 384)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(384, 64)), jnp.bfloat16)
    parts = pallas_gmm.vector_matrix_partials(rows, kernel, block_n=32, interpret=True)
    assert parts.shape == (3, 3, 64) and parts.dtype == jnp.float32
    exact = np.asarray(kernel, np.float64)
    for block in range(3):
        want = np.asarray(rows, np.float64)[:, block * 128:(block + 1) * 128] @ exact[block * 128:(block + 1) * 128]
        np.testing.assert_allclose(np.asarray(parts[block]), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(rows, np.float64) @ exact, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"expected a kernel \[384, N\] for rows \[3, 384\], got \(64, 384\)"):
        pallas_gmm.vector_matrix_partials(rows, kernel.T, interpret=True)


def test_dispatcher_choices_and_errors():
    assert gmm.resolve("auto") == "gather"  # CPU
    assert gmm.resolve("ragged_dot") == "ragged_dot"
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU.*'cpu'"):
        gmm.resolve("pallas")
    with pytest.raises(ValueError, match="moe_grouped_matmul='dense' is unknown"):
        gmm.resolve("dense")
    with pytest.raises(ValueError, match="split_k=3 must divide the 2 blocks of 32"):
        pallas_gmm.grouped_matmul(*_problem([2, 3], 64, 16, jnp.float32), block_k=32, split_k=3, interpret=True)
    with pytest.raises(ValueError, match="multiple of 16, got 40"):
        pallas_gmm.grouped_matmul(*_problem([2, 3], 40, 16, jnp.float32), interpret=True)


def test_auto_on_one_gpu_takes_pallas_and_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(gmm.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gmm, "pallas_unavailable_reason", lambda *a: None)
    assert gmm.resolve("auto") == "pallas"
    assert gmm.resolve("gather") == "gather"  # an explicit choice is kept
    monkeypatch.setattr(gmm, "pallas_unavailable_reason", lambda *a: "a 2-device mesh is current")
    assert gmm.resolve("auto") == "ragged_dot"
    with pytest.raises(RuntimeError, match="pallas was requested, but a 2-device mesh is current"):
        gmm.resolve("pallas")


@pytest.mark.parametrize("glu", [False, True])
def test_pallas_gradients_equal_the_gather_paths(glu):
    """Training on a GPU gets the Pallas forward: its custom VJP (ragged_dot's backward; with glu, of the gate and up
    products and SiLU(gate) * up) must give the same gradients as the differentiable gather oracle. Without the
    VJP, jax.grad fails on the pallas_call."""
    rows, weights, sizes, row_groups = _problem(GROUP_SIZES["uneven, empty groups, groups over block_m"], 32, 16,
                                                jnp.float32, seed=4)
    weights = (weights, weights[:, ::-1] * 0.5 - 0.1) if glu else weights  # (gate, up) with glu
    cotangent = jnp.asarray(np.random.default_rng(5).normal(size=(rows.shape[0], 16)), jnp.float32)
    highest = jax.lax.Precision.HIGHEST

    def loss(fn):
        return lambda r, w: jnp.sum(fn(r, w) * cotangent)

    def oracle(r, w):
        if not glu:
            return gather_matmul(r, w, row_groups, precision=highest)
        gate, up = (gather_matmul(r, x, row_groups, precision=highest) for x in w)
        return jax.nn.silu(gate) * up

    want = jax.grad(loss(oracle), argnums=(0, 1))(rows, weights)
    with jax.default_matmul_precision("highest"):
        got = jax.grad(loss(lambda r, w: pallas_gmm.grouped_matmul(r, w, sizes, row_groups, glu=glu,
                                                                   interpret=True)), argnums=(0, 1))(rows, weights)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rowwise_max_rows,rows_one_launch", [(0, False), (1000, False), (1000, True)])
def test_pallas_several_weights_in_one_kernel_match_separate_products(rowwise_max_rows, rows_one_launch):
    """A tuple of weights (an MoE's gate and up) gives one product per array, each equal to the gather oracle: on the
    `tiles` grid, on the `rows` grid one launch per array, and on the `rows` grid in one launch (rows_one_launch)."""
    rows, gate, sizes, row_groups = _problem(GROUP_SIZES["uneven, empty groups, groups over block_m"], 64, 48,
                                             jnp.float32, seed=6)
    up = gate[:, ::-1, :] * 0.5 + 0.1  # [E, K, N], another matrix per group
    got = pallas_gmm.grouped_matmul(rows, (gate, up), sizes, row_groups, block_k=32, split_k=2,
                                    rowwise_max_rows=rowwise_max_rows, rows_one_launch=rows_one_launch,
                                    interpret=True)
    assert isinstance(got, tuple) and len(got) == 2
    for out, w in zip(got, (gate, up)):
        want = gather_matmul(rows, w, row_groups, precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="all of one shape"):
        pallas_gmm.grouped_matmul(rows, (gate, up[:, :, :16]), sizes, row_groups, interpret=True)


def _pallas_output_shapes(fn, *args) -> list[list[tuple]]:
    """The output shapes of each pallas_call in fn's jaxpr (nested ones, e.g. under a custom VJP, included)."""
    calls = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                calls.append([tuple(v.aval.shape) for v in eqn.outvars])
                continue
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr's jaxpr, or a Jaxpr
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return calls


def _pallas_outputs(fn, *args) -> list[int]:
    """The number of outputs of each pallas_call in fn's jaxpr."""
    return [len(shapes) for shapes in _pallas_output_shapes(fn, *args)]


@pytest.mark.parametrize("rowwise_max_rows,rows_one_launch,split_k,in_kernel", [
    (0, False, 1, True), (0, False, 2, False), (1000, False, 1, False), (1000, True, 1, True), (1000, True, 2, False)])
def test_glu_is_silu_of_gate_times_up(rowwise_max_rows, rows_one_launch, split_k, in_kernel):
    """glu=True returns SiLU(rows @ gate) * (rows @ up) as one array, computed inside the kernel (one output per
    pallas_call) where one program holds both products and K is whole (the `tiles` grid, the `rows` grid in one
    launch), else from the products after it; the rows grid's extra (shared-expert) rows included."""
    rows, gate, sizes, row_groups = _problem(GROUP_SIZES["decode, one row per expert"], 64, 48, jnp.float32, seed=8)
    up = gate[:, ::-1, :] * 0.5 + 0.1
    rng = np.random.default_rng(10)
    extras = tuple(jnp.asarray(rng.normal(size=(1, 64, 48)) / 8, jnp.float32) for _ in range(2))
    if rowwise_max_rows:  # one row of the extra group
        row_groups = row_groups.at[2].set(len(sizes))
    else:
        extras = None
    call = functools.partial(pallas_gmm.grouped_matmul, group_sizes=sizes, row_groups=row_groups, extra_weights=extras,
                             block_k=32, split_k=split_k, rowwise_max_rows=rowwise_max_rows,
                             rows_one_launch=rows_one_launch, glu=True, interpret=True)
    got = call(rows, (gate, up))
    products = [gather_matmul(rows, jnp.concatenate([w, x]) if extras else w, row_groups,
                              precision=jax.lax.Precision.HIGHEST) for w, x in zip((gate, up), extras or (0, 0))]
    want = jax.nn.silu(products[0]) * products[1]
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert sum(_pallas_outputs(call, rows, (gate, up))) == (1 if in_kernel else 2)  # outputs written
    with pytest.raises(ValueError, match="expected two weight arrays, got 1"):
        call(rows, (gate,))


def _fused_inputs_problem():
    """Two tokens routed to 3 of 6 experts each (row_groups lists their 6 routed rows), a shared expert as extra
    group 0 (one more row per token), the gate / up / down arrays, and the rows they stand for."""
    rng = np.random.default_rng(11)
    tokens = jnp.asarray(rng.normal(size=(2, 64)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(6, 64, 48)) / 8, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(6, 48, 64)) / 7, jnp.float32)
    extras = tuple(jnp.asarray(rng.normal(size=(1, *w.shape[1:])) / 8, jnp.float32) for w in (gate, up, down))
    routed = jnp.asarray([3, 0, 5, 1, 3, 2], jnp.int32)
    every_row = jnp.concatenate([routed, jnp.full((2,), 6, jnp.int32)])  # the materialized rows' groups
    return tokens, (gate, up, down), extras, routed, every_row


def _materialized_moe_rows(tokens, weights, extras, every_row):
    """The oracle of `_fused_inputs_problem`: the expanded rows, SiLU(gate) * up and the down product."""
    rows = gmm.token_rows(tokens, 3, extra_rows=True)  # [8, 64]
    gate, up, down = (jnp.concatenate([w, x]) for w, x in zip(weights, extras))
    product = functools.partial(gather_matmul, row_groups=every_row, precision=jax.lax.Precision.HIGHEST)
    hidden = jax.nn.silu(product(rows, gate)) * product(rows, up)
    return hidden, product(hidden, down)


def _primitives(fn, *args) -> set[str]:
    """The primitives of fn's jaxpr (top level: a pallas_call's body not included)."""
    return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).jaxpr.eqns}


@pytest.mark.parametrize("rows_one_launch,split_k,deferred", [(False, 2, True), (True, 2, True), (True, 1, False)])
def test_rows_grid_reads_tokens_and_defers_the_glu_to_the_down_product(rows_one_launch, split_k, deferred):
    """rows_per_token: 2 tokens stand for their 3 routed rows each and one extra (shared-expert) row each, row_groups
    listing only the 6 routed rows; partial_rows hands the down product the gate / up K-split products (one
    PartialRows), whose activation it computes as it loads them. The same results as the materialized rows and
    activation, with no XLA op between the launches (no repeat, concatenate, sum or activation)."""
    tokens, (gate, up, down), extras, routed, every_row = _fused_inputs_problem()
    sizes = jnp.zeros((6,), jnp.int32)  # unused by the rows grid

    def fused(tokens):
        hidden = pallas_gmm.grouped_matmul(tokens, (gate, up), sizes, routed, extra_weights=extras[:2], block_k=32,
                                           split_k=split_k, rows_one_launch=rows_one_launch, glu=True,
                                           rows_per_token=3, partial_rows=True, interpret=True)
        return hidden, pallas_gmm.grouped_matmul(hidden, down, sizes, routed, extra_weights=extras[2], block_k=16,
                                                 interpret=True)

    hidden, out = fused(tokens)
    want_hidden, want_out = _materialized_moe_rows(tokens, (gate, up, down), extras, every_row)
    assert isinstance(hidden, gmm.PartialRows) == deferred
    if deferred:
        assert [part.shape for part in hidden.parts] == [(split_k, 8, 48)] * 2 and hidden.shape == (8, 48)
        hidden = hidden.materialize()
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(want_hidden), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    assert not _primitives(fused, tokens) & {"concatenate", "broadcast_in_dim", "gather", "reduce_sum", "add", "mul",
                                             "exp", "logistic", "div"}
    with pytest.raises(ValueError, match="rows_per_token need the rows grid"):
        pallas_gmm.grouped_matmul(tokens, gate, sizes, routed, rows_per_token=3, rowwise_max_rows=4, interpret=True)
    with pytest.raises(ValueError, match=r"row_groups \[6\] \(with extra weights: at least one row\), got .* \(5,\)"):
        pallas_gmm.grouped_matmul(tokens, gate, sizes, routed[:5], rows_per_token=3, interpret=True)


@pytest.mark.parametrize("rowwise_max_rows", [16, 0])
def test_partial_rows_of_one_product_are_summed_by_the_next(rowwise_max_rows):
    """partial_rows without glu (K split in 2): one PartialRows part per weight array, which the next product sums
    as it loads its rows (the rows grid) or materializes first (the tiles grid): the product of the summed rows."""
    rows, weights, sizes, row_groups = _problem(GROUP_SIZES["decode, one row per expert"], 64, 48, jnp.float32,
                                                seed=13)
    nxt = weights[:, :48, :32] * 1.5
    call = functools.partial(pallas_gmm.grouped_matmul, group_sizes=sizes, row_groups=row_groups, block_k=16,
                             rowwise_max_rows=rowwise_max_rows, interpret=True)
    part = call(rows, weights, split_k=2, partial_rows=True)
    assert isinstance(part, gmm.PartialRows) and part.parts[0].shape == (2, 8, 48)
    summed = call(rows, weights, split_k=2)
    np.testing.assert_array_equal(np.asarray(part.materialize()), np.asarray(summed))
    np.testing.assert_allclose(np.asarray(call(part, nxt)), np.asarray(call(summed, nxt)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation", ["gather", "pallas"])
def test_dispatcher_expands_fused_inputs_where_the_rows_grid_does_not_run(implementation, monkeypatch):
    """The dispatcher takes rows_per_token, partial_rows and PartialRows rows everywhere: the Pallas rows grid reads
    them as they are, other implementations get the expanded rows and the activation; the results agree."""
    tokens, (gate, up, down), _, routed, _ = _fused_inputs_problem()
    sizes = jnp.bincount(routed, length=6).astype(jnp.int32)
    if implementation == "pallas":
        monkeypatch.setattr(gmm, "resolve", lambda *a: "pallas")
        monkeypatch.setattr(pallas_gmm, "grouped_matmul", functools.partial(pallas_gmm.grouped_matmul, block_k=16,
                                                                             interpret=True))
    call = functools.partial(gmm.grouped_matmul, group_sizes=sizes, row_groups=routed, implementation=implementation,
                             precision=jax.lax.Precision.HIGHEST)
    with jax.default_matmul_precision("highest"):
        hidden = call(tokens, (gate, up), glu=True, rows_per_token=3, partial_rows=True)
        out = call(hidden, down)
    assert isinstance(hidden, gmm.PartialRows) == (implementation == "pallas")
    rows = gmm.token_rows(tokens, 3, extra_rows=False)
    product = functools.partial(gather_matmul, row_groups=routed, precision=jax.lax.Precision.HIGHEST)
    want_hidden = jax.nn.silu(product(rows, gate)) * product(rows, up)
    materialized = hidden.materialize() if isinstance(hidden, gmm.PartialRows) else hidden
    np.testing.assert_allclose(np.asarray(materialized), np.asarray(want_hidden), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(product(want_hidden, down)), rtol=1e-5, atol=1e-5)


def _dispatcher_problem(implementation, monkeypatch):
    """An MoE's rows, gate and up arrays, group sizes and row groups for the dispatcher; with 'pallas' the dispatcher
    resolves to the kernel, run by the interpreter (as it would run on one GPU)."""
    rows, gate, sizes, row_groups = _problem(GROUP_SIZES["uneven, empty groups, groups over block_m"], 32, 16,
                                             jnp.float32, seed=7)
    if implementation == "pallas":
        monkeypatch.setattr(gmm, "resolve", lambda *a: "pallas")
        monkeypatch.setattr(pallas_gmm, "grouped_matmul",
                            functools.partial(pallas_gmm.grouped_matmul, interpret=True))
    return rows, gate, gate * -2.0 + 0.3, sizes, row_groups


@pytest.mark.parametrize("implementation", ["gather", "ragged_dot", "pallas"])
def test_dispatcher_glu_on_every_implementation(implementation, monkeypatch):
    """The MoE's SwiGLU hidden activation from the dispatcher: glu_output of the gate and up products everywhere."""
    rows, gate, up, sizes, row_groups = _dispatcher_problem(implementation, monkeypatch)
    with jax.default_matmul_precision("highest"):
        got = gmm.grouped_matmul(rows, (gate, up), sizes, row_groups, implementation=implementation,
                                 precision=jax.lax.Precision.HIGHEST, glu=True)
    products = [gather_matmul(rows, w, row_groups, precision=jax.lax.Precision.HIGHEST) for w in (gate, up)]
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.nn.silu(products[0]) * products[1]), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("implementation", ["gather", "ragged_dot", "pallas"])
def test_dispatcher_takes_a_tuple_of_weights_on_every_implementation(implementation, monkeypatch):
    """The MoE passes its gate and up projections as one tuple: every implementation returns one product per array.
    (pallas: the kernel in interpret mode, as the dispatcher would run it on one GPU.)"""
    rows, gate, up, sizes, row_groups = _dispatcher_problem(implementation, monkeypatch)
    with jax.default_matmul_precision("highest"):
        got = gmm.grouped_matmul(rows, (gate, up), sizes, row_groups, implementation=implementation,
                                 precision=jax.lax.Precision.HIGHEST)
    assert isinstance(got, tuple) and len(got) == 2
    for out, w in zip(got, (gate, up)):
        want = gather_matmul(rows, w, row_groups, precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_tiles_pipeline_fits_shared_memory():
    """Prefill tiles (block_m 64, bf16, block_n 128): one weight keeps 3 stages (144 KiB); gate and up together
    need 80 KiB a stage, and 3 (240 KiB) made Triton refuse the kernel on an H200 (227 KiB): 2 stages."""
    assert pallas_gmm.tiles_pipeline_stages(3, 64, 128, 128, 1, jnp.bfloat16) == 3
    assert pallas_gmm.tiles_pipeline_stages(3, 64, 128, 128, 2, jnp.bfloat16) == 2
    assert pallas_gmm.tiles_pipeline_stages(3, 64, 128, 64, 1, jnp.float32) == 3
    assert pallas_gmm.tiles_pipeline_stages(3, 64, 128, 128, 4, jnp.float32) == 1


def test_default_tiles_for_few_rows():
    """Up to 16 bf16 rows: the tensor-core rows grid with block_n 64, K split in two from 16 blocks on (the 48B
    gate/up: 18 blocks of 128), else K whole (down: 8 blocks); bf16 rows on the FMA grid (rows_mma False): 2 warps,
    block_n 64, K in two from 16 blocks else in four; gate and up in one launch: block_n 64 on the tensor cores;
    float32 rows keep the FMA grid with 6 K splits where they divide K's blocks, else 2, else 1; more rows keep K
    whole on the tiles grid."""
    tiles = pallas_gmm.default_tiles
    assert tiles(8, jnp.bfloat16, 18) == {"block_m": 16, "block_n": 64, "split_k": 2, "rows_mma": True,
                                          "num_warps": 4}
    assert tiles(8, jnp.bfloat16, 8) == {"block_m": 16, "block_n": 64, "split_k": 1, "rows_mma": True,
                                         "num_warps": 4}
    assert tiles(16, jnp.bfloat16, 17)["split_k"] == 1
    fma = {k: tiles(9, jnp.bfloat16, k, rows_mma=False) for k in (18, 8, 9)}
    assert [t["split_k"] for t in fma.values()] == [2, 4, 1]
    assert all(t["num_warps"] == 2 and t["block_n"] == 64 and not t["rows_mma"] for t in fma.values())
    assert tiles(9, jnp.bfloat16, 18, one_launch=True) == {"block_m": 16, "block_n": 64, "split_k": 2,
                                                            "rows_mma": True, "num_warps": 4}
    assert [tiles(8, jnp.float32, k)["split_k"] for k in (18, 8, 9)] == [6, 2, 1]
    assert not tiles(8, jnp.float32, 18)["rows_mma"]
    assert tiles(64, jnp.bfloat16, 18) == {"block_m": 16, "block_n": 128, "split_k": 1, "rows_mma": False,
                                           "num_warps": 4}


def test_bf16_rows_grid_multiplies_on_the_tensor_cores_by_default():
    rows, weights, sizes, row_groups = _problem(GROUP_SIZES["decode, one row per expert"], 256, 48, jnp.bfloat16)
    jaxprs = {dtype: str(jax.make_jaxpr(functools.partial(
        pallas_gmm.grouped_matmul, weights=weights.astype(dtype), group_sizes=sizes, row_groups=row_groups,
        interpret=True))(rows.astype(dtype))) for dtype in (jnp.bfloat16, jnp.float32)}
    assert "dot_general" in jaxprs[jnp.bfloat16] and "dot_general" not in jaxprs[jnp.float32]


def test_pallas_gradients_of_several_weights_equal_the_gather_paths():
    rows, gate, sizes, row_groups = _problem([3, 0, 5, 2], 32, 16, jnp.float32, seed=7)
    up = gate * -0.5
    cotangents = [jnp.asarray(np.random.default_rng(s).normal(size=(rows.shape[0], 16)), jnp.float32) for s in (8, 9)]
    highest = jax.lax.Precision.HIGHEST

    def loss(products):
        return lambda r, g, u: sum(jnp.sum(p * c) for p, c in zip(products(r, g, u), cotangents))

    want = jax.grad(loss(lambda r, g, u: [gather_matmul(r, w, row_groups, precision=highest) for w in (g, u)]),
                    argnums=(0, 1, 2))(rows, gate, up)
    with jax.default_matmul_precision("highest"):
        got = jax.grad(loss(lambda r, g, u: pallas_gmm.grouped_matmul(r, (g, u), sizes, row_groups, interpret=True)),
                       argnums=(0, 1, 2))(rows, gate, up)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("contract,out_dim,want", [(2304, 4096, 4), (4096, 2304, 8), (2304, 1024, 18),
                                                    (1024, 2304, 8), (256, 128, 4), (128, 4096, 1)])
def test_dense_split_k_reaches_enough_programs_or_splits_every_block(contract, out_dim, want):
    """Kimi-Linear-48B's q/k/v, o, shared-expert gate/up and down projections (blocks of 64): >= 256 programs;
    KDA's f_b / g_b (K = 128: 16 KiB per program's slice) keep K whole, no partial-sum kernel."""
    assert pallas_gmm.dense_split_k(contract, out_dim, 64, 64) == want


@pytest.mark.parametrize("num_rows", [1, 5])
@pytest.mark.parametrize("grid", ["tiles", "rows"])
def test_pallas_dense_matmul_interpret_matches_dot(num_rows, grid):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(num_rows, 256)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(size=(256, 128)) / 16, jnp.bfloat16)
    want = np.asarray(jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32),
                              precision=jax.lax.Precision.HIGHEST))
    got = pallas_gmm.dense_matmul(x, kernel, grid=grid, interpret=True)  # 4 K splits of one block each
    assert got.shape == (num_rows, 128) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="grid='cols': expected 'tiles' or 'rows'"):
        pallas_gmm.dense_matmul(x, kernel, grid="cols", interpret=True)


@pytest.mark.parametrize("num_rows", [1, 5, 16, 20])
def test_tiles_grid_reads_few_rows_unpadded_with_masks(num_rows):
    """pad_rows=False (dense_matmul's default): one group of fewer than 16 rows is read and written with masks, no
    pad before the launch (and an unpadded [K splits, M, N] output); 16 rows and more pad as with pad_rows=True. The
    same products."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(num_rows, 256)), jnp.bfloat16)
    kernels = tuple(jnp.asarray(rng.normal(size=(256, 128)) / 16, jnp.bfloat16) for _ in range(2))
    padded = functools.partial(pallas_gmm.dense_matmul, pad_rows=True, interpret=True)
    masked = functools.partial(pallas_gmm.dense_matmul, interpret=True)  # the default
    for want, got in zip(padded(x, kernels), masked(x, kernels)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    unpadded = num_rows < 16
    assert ("pad" in str(jax.make_jaxpr(masked)(x, kernels))) != unpadded
    assert _pallas_output_shapes(masked, x, kernels) == [[(4, num_rows + (0 if unpadded else 16), 128)] * 2]


@pytest.mark.parametrize("grid", ["tiles", "rows"])
def test_pallas_dense_matmul_of_several_kernels_in_one_launch(grid):
    """A tuple of same-shape kernels (q / k / v of one input): one launch, each product as alone; shapes must match.
    Neither grid pads the row (the tiles grid reads it with masked loads: dense_pad_rows false, the default)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(1, 256)), jnp.bfloat16)
    kernels = tuple(jnp.asarray(rng.normal(size=(256, 128)) / 16, jnp.bfloat16) for _ in range(3))
    call = functools.partial(pallas_gmm.dense_matmul, grid=grid, interpret=True)
    got = call(x, kernels)
    assert isinstance(got, tuple) and len(got) == 3
    for out, kernel in zip(got, kernels):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(call(x, kernel)))
    assert _pallas_outputs(call, x, kernels) == [3]  # one launch writing the three products
    assert "pad" not in str(jax.make_jaxpr(call)(x, kernels))
    with pytest.raises(ValueError, match="must share a shape"):
        call(x, (kernels[0], kernels[1][:, :64]))


def test_dense_matmul_grid_reaches_the_kernel(monkeypatch):
    """The config keys dense_matmul_grid and dense_pad_rows reach the Pallas dense kernel for every projection
    (`project`)."""
    from MaxText import pyconfig
    from MaxText.layers.linears import project
    seen = []
    monkeypatch.setattr(gmm, "resolve_dense", lambda *a: "pallas")  # as at batch-1 decode on one GPU
    monkeypatch.setattr(pallas_gmm, "dense_matmul", lambda x, kernels, grid, pad_rows: seen.append(
        (grid, pad_rows)) or tuple(x @ k for k in kernels))
    x = jnp.ones((1, 1, 32), jnp.float32)
    for grid, pad_rows in (("tiles", False), ("rows", True)):
        config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {"dense_matmul_grid": grid, "dense_pad_rows": pad_rows,
                                                                  "dense_kernel_layout": "in_out"})
        assert project(config, x, jnp.ones((32, 8), jnp.float32)).shape == (1, 1, 8)
    assert seen == [("tiles", False), ("rows", True)]
    assert pyconfig.load_config(pyconfig.BASE_CONFIG_PATH).dense_matmul_grid == "tiles"  # the default
    with pytest.raises(ValueError, match="dense_matmul_grid"):
        pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, {"dense_matmul_grid": "cols"})


def test_dense_dispatcher_choices_and_errors(monkeypatch):
    assert gmm.resolve_dense("auto", jnp.bfloat16, 256, 128, 1) == "xla"  # CPU
    with pytest.raises(RuntimeError, match="dense_matmul=pallas was requested, but .*NVIDIA GPU"):
        gmm.resolve_dense("pallas", jnp.bfloat16, 256, 128, 1)
    with pytest.raises(ValueError, match="dense_matmul='cublas' is unknown"):
        gmm.resolve_dense("cublas", jnp.bfloat16, 256, 128, 1)
    monkeypatch.setattr(gmm.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gmm, "pallas_unavailable_reason", lambda *a: None)
    assert gmm.resolve_dense("auto", jnp.bfloat16, 256, 128, gmm.DENSE_PALLAS_MAX_ROWS) == "pallas"  # decode
    assert gmm.resolve_dense("auto", jnp.bfloat16, 256, 128, gmm.DENSE_PALLAS_MAX_ROWS + 1) == "xla"  # prefill
    assert gmm.resolve_dense("auto", jnp.float32, 256, 128, 1) == "xla"
    assert gmm.resolve_dense("pallas", jnp.float32, 256, 128, 64) == "pallas"  # an explicit choice is kept


def test_dense_layer_takes_the_pallas_kernel_when_resolved(monkeypatch):
    """linears.Dense (every projection of the model) routes through dense_matmul: with the Pallas kernel resolved
    (run by the interpreter here) a [B, T, K] input gives XLA's product."""
    from MaxText import pyconfig
    from MaxText.layers.linears import Dense
    config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, ["dtype=bfloat16", "weight_dtype=bfloat16",
                                                              "dense_kernel_layout=in_out"])
    calls, kernel_fn = [], pallas_gmm.dense_matmul

    def interpreted(rows, kernel, **options):
        calls.append(rows.shape)
        return kernel_fn(rows, kernel, interpret=True, **options)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 1, 256)), jnp.bfloat16)
    layer = Dense(config, 128)
    params = layer.init(jax.random.key(0), x)
    want = layer.apply(params, x)
    monkeypatch.setattr(gmm, "resolve_dense", lambda *a: "pallas")
    monkeypatch.setattr(pallas_gmm, "dense_matmul", interpreted)
    got = layer.apply(params, x)
    assert calls == [(2, 256)] and got.shape == (2, 1, 128)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_out_in_kernels_take_xla_products_on_a_gpu(monkeypatch):
    """dense_kernel_layout out_in (the default): `auto` multiplies by XLA where the Pallas dense kernel would run for
    in_out kernels (a one-row product on one NVIDIA GPU), on the [out, in] param read in place; same values."""
    import flax
    from MaxText import pyconfig
    from MaxText.layers.linears import Dense
    monkeypatch.setattr(gmm.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gmm, "pallas_unavailable_reason", lambda *a: None)
    calls = []
    monkeypatch.setattr(pallas_gmm, "dense_matmul", lambda rows, kernels, **options: calls.append(rows.shape) or tuple(
        rows @ k for k in kernels))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, 1, 256)), jnp.bfloat16)
    outs = {}
    for layout in ("out_in", "in_out"):
        config = pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, ["dtype=bfloat16", "weight_dtype=bfloat16",
                                                                  f"dense_kernel_layout={layout}"])
        layer = Dense(config, 128)
        params = flax.linen.unbox(layer.init(jax.random.key(0), x))
        outs[layout] = (params["params"]["kernel"], layer.apply(params, x))
        assert calls == ([] if layout == "out_in" else [(1, 256)] * 2), (layout, calls)  # in_out: init and apply
    (out_in_kernel, out_in_y), (in_out_kernel, in_out_y) = outs["out_in"], outs["in_out"]
    assert out_in_kernel.shape == (128, 256) and in_out_kernel.shape == (256, 128)
    np.testing.assert_allclose(np.asarray(out_in_y, np.float32), np.asarray(x @ out_in_kernel.T, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(in_out_y, np.float32), np.asarray(x @ in_out_kernel, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_mlp_with_fused_projections_projects_gate_and_up_in_one_call(monkeypatch, interpreted_dense_matmul):
    """linears.MLP with fused_projections (the default): gate_proj and up_proj (same params) in one dense_matmul call,
    down_proj alone; the output is the unfused MLP's."""
    from MaxText import pyconfig
    from MaxText.layers.linears import MLP
    keys = ["dtype=bfloat16", "weight_dtype=bfloat16", "emb_dim=256", "dense_kernel_layout=in_out"]
    plain = MLP(pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, keys + ["fused_projections=false"]), 128)
    fused = MLP(pyconfig.load_config(pyconfig.BASE_CONFIG_PATH, keys + ["fused_projections=true"]), 128)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(1, 1, 256)), jnp.bfloat16)
    params = plain.init(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, params, fused.init(jax.random.key(0), x))
    want = plain.apply(params, x)
    calls = interpreted_dense_matmul
    monkeypatch.setattr(gmm, "resolve_dense", lambda *a: "pallas")
    got = fused.apply(params, x)
    assert calls == [2, 1]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("per_token", [8, 9])
def test_benchmark_makes_rows_per_token_sorted_by_expert(per_token):
    """benchmarks/grouped_matmul.py --rows-per-token: 9 rows per token stand for the 48B decode step's routed
    experts plus the shared expert's row."""
    from benchmarks import grouped_matmul as bench
    rows, sizes, groups, _ = bench.routed_rows(np.random.default_rng(0), 3, 32, 2, per_token=per_token)
    for layer_rows, layer_sizes, layer_groups in zip(rows, sizes, groups):
        assert layer_rows.shape == (3 * per_token, 32) and int(layer_sizes.sum()) == 3 * per_token
        assert np.all(np.diff(np.asarray(layer_groups)) >= 0)  # sorted by expert


def test_one_row_products_above_xlas_rewrite_are_written_as_a_reduction():
    """dense_matmul's XLA product of one row by a kernel of more than XLA_ROW_REWRITE_ELEMENTS elements (which XLA:GPU
    would hand to cuBLAS) and at most row_reduce_max_elements: float32 products summed over K, no dot in the program;
    the same values as the dot. More rows, a smaller or larger kernel, or the limit 0: the dot."""
    contract, out_dim = 2560, 4096  # 10.49M elements
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 1, contract), jnp.bfloat16)
    kernel = (jax.random.normal(jax.random.PRNGKey(1), (contract, out_dim), jnp.float32) / 50).astype(jnp.bfloat16)

    def program(rows, w, limit):
        run = functools.partial(gmm.dense_matmul, implementation="xla", row_reduce_max_elements=limit)
        return str(jax.make_jaxpr(run)(rows, w))

    assert "reduce_sum" in program(x, kernel, 15_000_000) and "dot_general" not in program(x, kernel, 15_000_000)
    for rows, w, limit in ((jnp.concatenate([x, x], axis=1), kernel, 15_000_000), (x, kernel, 10_000_000),
                           (x, kernel, 0), (x[..., :2048], kernel[:2048], 15_000_000)):  # 8.4M: XLA's own rewrite
        assert "dot_general" in program(rows, w, limit) and "reduce_sum" not in program(rows, w, limit)
    got = gmm.dense_matmul(x, kernel, implementation="xla", row_reduce_max_elements=15_000_000)
    want = jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (1, 1, out_dim) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)


def _out_in(w):
    return jnp.swapaxes(w, 1, 2)  # [E, K, N] <-> [E, N, K]


@pytest.mark.parametrize("block_rows,chunks_ahead", [(1, 3), (2, 1), (4, 0)])
def test_rows_out_in_kernel_matches_the_oracle_and_the_in_out_products(block_rows, chunks_ahead):
    """pallas_rows_out_in (interpreted): experts stored [E, N, K] with tokens standing for their routed rows and the
    shared expert's rows, SiLU(gate) * up in the launch, then the down product: the oracle's and the [E, K, N]
    products' results; two arrays without glu give one product each; bad tiles and arrays are named."""
    from MaxText.kernels.grouped_matmul import naive, pallas_rows_out_in
    tokens, (gate, up, down), extras, routed, every_row = _fused_inputs_problem()
    call = functools.partial(pallas_rows_out_in.grouped_matmul_out_in, block_rows=block_rows,
                             chunks_ahead=chunks_ahead, interpret=True)
    gate_up, gate_up_extra = (_out_in(gate), _out_in(up)), (_out_in(extras[0]), _out_in(extras[1]))
    hidden, = call(tokens, gate_up, routed, extra_weights=gate_up_extra, rows_per_token=3, glu=True)
    out, = call(hidden, (_out_in(down),), routed, extra_weights=(_out_in(extras[2]),))  # K = 48: 3 chunks of 16
    want_hidden, want_out = _materialized_moe_rows(tokens, (gate, up, down), extras, every_row)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(want_hidden), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    with jax.default_matmul_precision("highest"):
        oracle, = naive.rows_out_in(hidden, (_out_in(down),), routed, extra_weights=(_out_in(extras[2]),))
    np.testing.assert_allclose(np.asarray(out), np.asarray(oracle), rtol=1e-5, atol=1e-5)
    products = call(tokens, gate_up, routed, extra_weights=gate_up_extra, rows_per_token=3)
    rows = gmm.token_rows(tokens, 3, extra_rows=True)
    for got, w, x in zip(products, (gate, up), extras):
        want = gather_matmul(rows, jnp.concatenate([w, x]), every_row, precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="N a multiple of block_rows=5, got N=48"):
        call(tokens, gate_up, routed, extra_weights=gate_up_extra, rows_per_token=3, glu=True, block_rows=5)
    with pytest.raises(ValueError, match="expected two weight arrays, got 1"):
        call(tokens, gate_up[:1], routed, rows_per_token=3, glu=True)
    with pytest.raises(ValueError, match=r"expected rows \[M, 64\] and weights of one shape"):
        call(tokens, (gate_up[0], _out_in(down)), routed, rows_per_token=3)


def test_rows_out_in_streams_several_chunks_of_a_long_row():
    """K = 768: three chunks of 256 per output feature, loaded ahead; plain rows, groups listed for every row."""
    from MaxText.kernels.grouped_matmul import pallas_rows_out_in
    rows, weights, _, row_groups = _problem([0, 1, 1, 0, 2], 768, 8, jnp.float32, seed=3)
    got, = pallas_rows_out_in.grouped_matmul_out_in(rows, (_out_in(weights),), row_groups, interpret=True)
    want = gather_matmul(rows, weights, row_groups, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["gather", "pallas"])
def test_dispatcher_reads_weights_stored_out_in(implementation, monkeypatch):
    """weights_out_in: the dispatcher's products of [E, N, K] weights equal those of the same matrices stored
    [E, K, N]; where the Pallas rows grid would run, pallas_rows_out_in reads them as stored (no transpose in the
    program; the shared expert's extra arrays are transposed only when they come [X, K, N]); gather reads them as
    stored."""
    from MaxText.kernels.grouped_matmul import pallas_rows_out_in
    tokens, (gate, up, down), extras, routed, every_row = _fused_inputs_problem()
    sizes = jnp.bincount(routed, length=6).astype(jnp.int32)
    launches = []
    if implementation == "pallas":
        monkeypatch.setattr(gmm, "resolve", lambda *a: "pallas")
        kernel = pallas_rows_out_in.grouped_matmul_out_in

        def recorded(*args, **kwargs):
            launches.append(kwargs["glu"])
            return kernel(*args, **kwargs, interpret=True)
        monkeypatch.setattr(pallas_rows_out_in, "grouped_matmul_out_in", recorded)
    call = functools.partial(gmm.grouped_matmul, group_sizes=sizes, row_groups=routed, implementation=implementation,
                             precision=jax.lax.Precision.HIGHEST, weights_out_in=True)
    with jax.default_matmul_precision("highest"):
        if implementation == "pallas":  # the rows grid's inputs: tokens, the shared expert as extra rows
            stored = [_out_in(w) for w in (gate, up, down, *extras)]  # every array [.., N, K]

            def moe(tokens, extra_layout):
                g, u, d, *x = stored
                x = x if extra_layout == "out_in" else extras
                hidden = call(tokens, (g, u), extra_weights=tuple(x[:2]), glu=True, rows_per_token=3,
                              partial_rows=True, extra_out_in=extra_layout == "out_in")
                return call(hidden, d, extra_weights=x[2], extra_out_in=extra_layout == "out_in")
            want = _materialized_moe_rows(tokens, (gate, up, down), extras, every_row)[1]
            for extra_layout, transposes in (("out_in", False), ("in_out", True)):
                launches.clear()
                np.testing.assert_allclose(np.asarray(moe(tokens, extra_layout)), np.asarray(want), rtol=1e-5,
                                           atol=1e-5)
                assert launches == [True, False]
                program = jax.make_jaxpr(functools.partial(moe, extra_layout=extra_layout))(tokens).jaxpr
                assert ("transpose" in {eqn.primitive.name for eqn in program.eqns}) == transposes
            got = moe(tokens, "out_in")
        else:
            rows = gmm.token_rows(tokens, 3, extra_rows=False)
            stored = [_out_in(w) for w in (gate, up, down)]
            got = call(call(rows, tuple(stored[:2]), glu=True), stored[2])
            program = jax.make_jaxpr(lambda r: call(r, stored[0]))(rows).jaxpr
            assert "transpose" not in {eqn.primitive.name for eqn in program.eqns}
            product = functools.partial(gather_matmul, row_groups=routed, precision=jax.lax.Precision.HIGHEST)
            want = product(jax.nn.silu(product(rows, gate)) * product(rows, up), down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rowwise_max_rows,mma,glu", [(0, None, False), (0, None, True), (1000, False, False),
                                                      (1000, True, True)])
def test_both_grids_read_weights_stored_out_in(rowwise_max_rows, mma, glu):
    """weights_out_in: the `tiles` grid (prefill) and the `rows` grid read [E, N, K] weights as stored, multiplying
    their blocks transposed: the products of the same matrices stored [E, K, N]; a [E, K, N] array is refused by
    shape."""
    rows, gate, sizes, row_groups = _problem(GROUP_SIZES["uneven, empty groups, groups over block_m"], 64, 48,
                                             jnp.float32, seed=2)
    weights = (gate, gate[:, ::-1] * 0.5 - 0.1) if glu else (gate,)
    call = functools.partial(pallas_gmm.grouped_matmul, rows, group_sizes=sizes, row_groups=row_groups, block_k=32,
                             rowwise_max_rows=rowwise_max_rows, rows_mma=mma, glu=glu, interpret=True)
    want = call(weights=weights)
    got = call(weights=tuple(_out_in(w) for w in weights), weights_out_in=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"expected weights \[E, N, 64\]"):
        call(weights=weights, weights_out_in=True)


def test_gradients_of_weights_stored_out_in_equal_the_gather_paths():
    """Training on [E, N, K] experts (the `tiles` grid's forward, ragged_dot's backward of the transposed matrices):
    the gradients of the gather oracle, the weights' in their stored layout."""
    rows, weights, sizes, row_groups = _problem(GROUP_SIZES["uneven, empty groups, groups over block_m"], 32, 16,
                                                jnp.float32, seed=4)
    cotangent = jnp.asarray(np.random.default_rng(5).normal(size=(rows.shape[0], 16)), jnp.float32)

    def loss(fn):
        return lambda r, w: jnp.sum(fn(r, w) * cotangent)
    oracle = functools.partial(gather_matmul, row_groups=row_groups, precision=jax.lax.Precision.HIGHEST,
                               weights_out_in=True)
    stored = _out_in(weights)
    want = jax.grad(loss(oracle), argnums=(0, 1))(rows, stored)
    with jax.default_matmul_precision("highest"):
        got = jax.grad(loss(lambda r, w: pallas_gmm.grouped_matmul(r, w, sizes, row_groups, weights_out_in=True,
                                                                   interpret=True)), argnums=(0, 1))(rows, stored)
    assert got[1].shape == stored.shape
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_ragged_dot_takes_weights_stored_out_in_transposed():
    """ragged_dot (TPU, sharded GPUs) gets [E, N, K] weights transposed to [E, K, N]: the same products."""
    rows, weights, sizes, row_groups = _problem(GROUP_SIZES["uneven, empty groups, groups over block_m"], 32, 16,
                                                jnp.float32, seed=6)
    call = functools.partial(gmm.grouped_matmul, rows, group_sizes=sizes, row_groups=row_groups,
                             implementation="ragged_dot", precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(call(_out_in(weights), weights_out_in=True)), np.asarray(call(weights)),
                               rtol=1e-6, atol=1e-6)


def test_rows_out_in_refuses_unlisted_rows_without_extra_weights():
    """Rows past row_groups are of extra group 0: without extra weights every row must be listed (named error)."""
    from MaxText.kernels.grouped_matmul import pallas_rows_out_in
    rows, weights, _, row_groups = _problem([0, 1, 1, 0, 2], 64, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"expected row_groups \[4\] .* got \(3,\)"):
        pallas_rows_out_in.grouped_matmul_out_in(rows, (_out_in(weights),), row_groups[:3], interpret=True)
