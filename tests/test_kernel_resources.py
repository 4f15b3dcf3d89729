"""benchmarks/kernel_resources.py: the Triton IR capture and the report parsing (the compile step needs the `triton`
package, which the tests do not install)."""

from benchmarks import kernel_resources


def test_triton_ir_of_each_kernel_variant_is_captured_on_cpu():
    variants = kernel_resources.kernel_variants()
    assert {"diag", "scores halves w1 block_k=16", "packed decode bv64 w2"} <= set(variants)
    for name in ("diag", "scores halves w1 block_k=16", "packed decode bv64 w2"):
        _, _, fn, args = variants[name]
        ir = kernel_resources.triton_ir(fn, args)
        assert "tt.func public @kda_" in ir and "tt.load" in ir and "tt.store" in ir, name
    assert "tt.dot" in kernel_resources.triton_ir(*variants["scores halves w1 block_k=16"][2:])


def test_prefill_kernels_use_the_fast_exponential():
    """diag, scores, wu and recurrence take their decays as exp2 (of a base-2 G with bf16 inputs, as here; of
    x log2 e with fp32: `MaxText/kernels/pallas_exp.py`): no libdevice `__nv_expf` (~9 instructions per element)
    in their Triton IR."""
    import re
    variants = kernel_resources.kernel_variants()
    for name in ("diag", "scores halves w1 block_k=16", "wu w4 stages=2", "recurrence bv32 (one sequence)"):
        externs = set(re.findall(r'symbol = "([^"]+)"', kernel_resources.triton_ir(*variants[name][2:])))
        assert externs == {"__nv_exp2f"}, (name, externs)


def test_ptxas_report_parsed_into_blocks_per_sm():
    line = ("shared=8192 triton=3.5.1 sass=HGMMA.64:4,HMMA.1688.F32.TF32:64,LDG.E:3,LDG.E.128:87,LDGDEPBAR:5,"
            "LDGSTS.E.BYPASS.128:10,MUFU.EX2:7,SHFL.IDX:2,STG.E.128:5 ptxas info : Compiling entry function "
            "'kda_chunk_scores' for 'sm_90a' ptxas info : Function properties for kda_chunk_scores 440 bytes stack "
            "frame, 436 bytes spill stores, 1028 bytes spill loads ptxas info : Used 255 registers, used 1 barriers, "
            "440 bytes cumulative stack size")
    r = kernel_resources.resources(line, warps=1)
    assert (r["registers"], r["spill_stores"], r["spill_loads"], r["shared"]) == (255, 436, 1028, 8192)
    assert r["blocks_per_sm"] == 8  # 65536 // (255 * 32) = 8 by registers; shared memory allows 28
    assert r["sass"] == {"instructions": 187, "global_loads": 100, "global_loads_128": 97, "global_stores": 5,
                         "global_stores_128": 5, "mma": 68, "shuffles": 2, "exp2": 7}  # LDGDEPBAR is no load
    assert kernel_resources.resources(line.replace("255 registers", "64 registers"), warps=1)["blocks_per_sm"] == 28
    assert kernel_resources.resources(line.replace("255 registers", "32 registers"), warps=4)["blocks_per_sm"] == 16
    # 81 registers take 88 a thread (a warp's 2816 in units of 256): 23 warps, 5 blocks of 4 (not 65536 // (81 * 128))
    assert kernel_resources.resources(line.replace("255 registers", "81 registers"), warps=4)["blocks_per_sm"] == 5


def test_every_kernel_variant_lowers_to_triton_ir_on_cpu():
    """Every registered kernel (the KDA prefill, decode and verify kernels, the norms, the MoE router and experts in
    either layout, MLA's absorbed query, latent attention and combine) passes JAX's Pallas Triton lowering on this CPU
    machine: the lowering the GPU runs, which the interpreted tests never reach (e.g. a comparison of an i1 with an
    i32 fails here, not on the GPU)."""
    variants = kernel_resources.kernel_variants()
    assert {"verify 4 tokens", "moe norm and route 1 token", "mla latent attention 1 row",
            "moe experts out_in down 9 rows"} <= set(variants)
    for name, (_, _, fn, args) in variants.items():
        ir = kernel_resources.triton_ir(fn, args)
        assert "tt.func public @" in ir and "tt.store" in ir, name
