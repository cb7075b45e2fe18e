"""The Triton kernels compile for an H100 (sm_90) on this machine, no GPU needed, and the
memory-bound paths use 16-byte vector accesses (the Adam kernel always; pack, unpack and norm in
their ALIGNED variant, see [Note: aligned variant] in triton_common).

The interpreter checks what the kernels compute; this checks that the compiler accepts them and
emits the loads and stores the bandwidth target depends on.
"""

from __future__ import annotations

import re

import pytest

from hf_zero.kernels import dispatch

pytestmark = [
    pytest.mark.skipif(dispatch.TRITON_IMPORT_ERROR is not None, reason="triton is not importable"),
    pytest.mark.skipif(dispatch.INTERPRET, reason="kernels are interpreted in this process, not compiled"),
]

ADAM_SCALARS = ["grad_scale", "clip_coef", "decay", "weight_decay", "lerp_coeff", "beta2", "one_minus_beta2",
                "step_size", "bias_correction2_sqrt", "eps"]


def _compile_ptx(fn, signature: dict[str, str], constexprs: dict[str, object], aligned: list[str]) -> str:
    """PTX for sm_90, with ``aligned`` arguments specialised as 16-divisible, as launches do."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    try:
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    except TypeError as exc:  # ASTSource's arguments changed across triton releases
        pytest.skip(f"this triton's ASTSource takes other arguments: {exc}")
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "enable_fp_fusion": False})
    return compiled.asm["ptx"]


def _accesses(ptx: str) -> set[str]:
    return set(re.findall(r"(?:ld|st)\.global(?:\.\w+)*", ptx))


@pytest.mark.parametrize(("grad", "out", "factors_on_device"), [
    ("fp32", "bf16", False), ("fp32", "fp16", False), ("bf16", "bf16", False), ("bf16", "fp16", False),
    ("bf16", "bf16", True),  # [Note: step factors] read on the device
], ids=["fp32-bf16", "fp32-fp16", "bf16-bf16", "bf16-fp16", "bf16-bf16-device-factors"])
def test_adam_compiles_with_vector_accesses(grad: str, out: str, factors_on_device: bool) -> None:
    from hf_zero.kernels import triton_adam

    pointers = {"master_ptr": "*fp32", "grad_ptr": f"*{grad}", "exp_avg_ptr": "*fp32", "exp_avg_sq_ptr": "*fp32",
                "out_ptr": f"*{out}"}
    signature = {**pointers, "factors_ptr": "*fp32", "numel": "i32", **{name: "fp32" for name in ADAM_SCALARS}}
    constexprs = {"ADAMW": True, "LERP_FROM_M": True, "HAS_OUT": True, "FACTORS_ON_DEVICE": factors_on_device,
                  "BLOCK_SIZE": triton_adam.BLOCK_SIZE}
    ptx = _compile_ptx(triton_adam._fused_adam_kernel, signature, constexprs, [*pointers, "numel"])
    accesses = _accesses(ptx)
    # [Note: step factors]: three scalar loads per program when they come from the device, and
    # the streams stay vectorised (the skip masks a whole block at once).
    vector = {"ld.global.v4.b32", "st.global.v4.b32"}
    allowed = vector | ({"ld.global.b32"} if factors_on_device else set())
    assert vector <= accesses <= allowed, f"scalar accesses in Adam: {accesses}"
    assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, "division and sqrt must be correctly rounded"


@pytest.mark.parametrize("name", ["_pack_kernel", "_unpack_kernel"])
def test_pack_compiles_with_vector_accesses_when_aligned(name: str) -> None:
    import triton.language as tl

    from hf_zero.kernels import triton_pack

    signature = {"table_ptr": "*i64", "num_units": "i32", "buffer_ptr": "*bf16", "rank_stride": "i64"}
    if name == "_pack_kernel":
        signature["scale"] = "fp32"
    constexprs = {"UNIT_DTYPE": tl.float32, "ALIGNED": True, "BLOCK_SIZE": triton_pack.BLOCK_SIZE}
    ptx = _compile_ptx(getattr(triton_pack, name), signature, constexprs, ["table_ptr", "buffer_ptr", "rank_stride"])
    # The only scalar access left is the 8-byte table read, once per unit.
    assert _accesses(ptx) == {"ld.global.b64", "ld.global.v4.b32", "st.global.v4.b32"}, _accesses(ptx)


@pytest.mark.parametrize("aligned", [True, False])
def test_norm_compiles(aligned: bool) -> None:
    import triton.language as tl

    from hf_zero.kernels import triton_norm

    signature = {"table_ptr": "*i64", "num_tensors": "i32", "partial_ptr": "*fp32", "flag_ptr": "*i32"}
    constexprs = {"DTYPE": tl.bfloat16, "ALIGNED": aligned, "BLOCK_SIZE": triton_norm.BLOCK_SIZE}
    ptx = _compile_ptx(triton_norm._nonfinite_sqnorm_kernel, signature, constexprs, ["table_ptr"])
    assert ("ld.global.v4.b32" in _accesses(ptx)) == aligned, _accesses(ptx)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", ["_quantize_kernel", "_dequantize_kernel", "_quantize_int4_kernel",
                                  "_dequantize_int4_kernel"])
def test_quantization_compiles_with_correct_rounding(name: str, dtype: str) -> None:
    """[Note: blockwise int8], [Note: blockwise int4]: the scale and the inverse are correctly
    rounded divisions, so the GPU gives the reference's codes; no fused multiply-add."""
    import triton.language as tl

    from hf_zero.kernels import triton_quant

    codes = ("packed", "*u8") if "int4" in name else ("codes", "*i8")
    strides = {"numel": "i32"}
    if name.startswith("_quantize"):
        signature = {"values_ptr": f"*{dtype}", f"{codes[0]}_ptr": codes[1], "scales_ptr": "*fp32", **strides,
                     "values_row_stride": "i64", f"{codes[0]}_row_stride": "i64", "scales_row_stride": "i64"}
        constexprs: dict[str, object] = {"BLOCK": 512}
    else:
        signature = {f"{codes[0]}_ptr": codes[1], "scales_ptr": "*fp32", "out_ptr": f"*{dtype}", **strides,
                     f"{codes[0]}_row_stride": "i64", "scales_row_stride": "i64", "out_row_stride": "i64"}
        constexprs = {"OUT_DTYPE": {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}[dtype], "BLOCK": 512}
    ptx = _compile_ptx(getattr(triton_quant, name), signature, constexprs, [])
    assert "fma" not in ptx, "contraction would change the rounding"
    if name.startswith("_quantize"):
        assert ptx.count("div.rn.f32") >= 2 and "div.full" not in ptx and "div.approx" not in ptx
