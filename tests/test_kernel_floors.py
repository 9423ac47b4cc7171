"""minitrain/tools/kernel_floors.py: the floors' arithmetic, which kernel falls in which class, and the table."""

import pytest
import torch

from minitrain.cli import compose_config
from minitrain.model import GPT
from minitrain.model_config import ModelConfig
from minitrain.precision import resolve_precision
from minitrain.tools import kernel_floors as kf

L, H, C, V, T, B = 12, 12, 768, 50304, 1024, 16  # gpt2-124m, the batch of docs/benchmarks.md's profile
TOKENS = B * T
CEILINGS = kf.Ceilings(copy_bytes_per_s=4.0e12, gemm_flops_per_s=7.9e14)


@pytest.fixture(scope="module")
def gpt2_124m():
    with torch.device("meta"):  # shapes only: no memory, no init time
        return GPT(ModelConfig(name="gpt2-124m", n_layer=L, n_head=H, n_embd=C, block_size=T, vocab_size=V))


def _precision(name):
    return resolve_precision(compose_config([f"precision={name}"]).precision, torch.device("cuda"))


def test_the_gemm_and_attention_flops_by_hand(gpt2_124m):
    work = kf.step_work(gpt2_124m, _precision("bf16"), B, T, compiled=True)
    # the matmuls' weights: per block qkv, attention out, MLP in and out (12 C^2) and their biases (9 C); the LM
    # head is the token embedding, counted once; 2 + 2 LayerNorm parameters per norm are counted as the MFU does
    weights = L * (12 * C * C + 9 * C + 4 * C) + V * C + 2 * C
    assert work[kf.GEMM].flops == 3 * 2 * weights * TOKENS  # forward 2 FLOPs per weight, backward twice that
    # per layer and sequence: q k^T and p v, 2 T T C FLOPs each, half of them under the causal mask; x3 backward
    assert work[kf.ATTENTION].flops == 3 * L * B * (2 * (2 * T * T * C) / 2)
    assert work[kf.ATTENTION].bytes == L * TOKENS * C * 2 * (4 + 8)  # fwd q k v out, bwd q k v out dout dq dk dv


def test_the_bytes_by_hand_for_both_recipes(gpt2_124m):
    ours = kf.step_work(gpt2_124m, _precision("bf16"), B, T, compiled=True)
    assert ours[kf.CROSS_ENTROPY].bytes == TOKENS * V * 2 * 2  # bf16 logits read, bf16 gradient written
    mlp = TOKENS * 4 * C * L
    assert ours[kf.GELU_FORWARD].bytes == mlp * 2 * 2  # in, out
    assert ours[kf.GELU_BACKWARD].bytes == mlp * 2 * 3  # grad out and input in, grad in out
    # the first norm reads the embeddings' sum, writes its output; the 2L others also read the branch and
    # write the new residual
    assert ours[kf.LAYER_NORM_FORWARD].bytes == TOKENS * C * (2 + 2 + 2 * L * 4 * 2)
    # ln_f: grad out, input, grad in; the 2L others also read the residual's gradient
    assert ours[kf.LAYER_NORM_BACKWARD].bytes == TOKENS * C * (3 * 2 + 2 * L * 4 * 2)
    params = L * (12 * C * C + 13 * C) + V * C + T * C + 2 * C  # positions too: AdamW updates them
    # bf16 grad read by the norm and the update, fp32 m, v, master read and written, bf16 param written
    assert ours[kf.ADAMW].bytes == params * (2 * 2 + 3 * 2 * 4 + 2)

    ref = kf.step_work(gpt2_124m, _precision("amp_bf16"), B, T, compiled=True)  # fp32 params, bf16 autocast
    assert ref[kf.CROSS_ENTROPY].bytes == ours[kf.CROSS_ENTROPY].bytes  # the logits are bf16 under autocast
    assert ref[kf.GELU_FORWARD].bytes == ours[kf.GELU_FORWARD].bytes  # so are the MLP's activations
    assert ref[kf.GELU_BACKWARD].bytes == ours[kf.GELU_BACKWARD].bytes
    assert ref[kf.LAYER_NORM_FORWARD].bytes == TOKENS * C * ((4 + 2) + 2 * L * (4 + 2 + 4 + 2))  # fp32 residual
    assert ref[kf.LAYER_NORM_BACKWARD].bytes == TOKENS * C * ((2 + 4 + 4) + 2 * L * (2 + 4 + 4 + 4))
    assert ref[kf.ADAMW].bytes == params * (2 * 4 + 2 * 2 * 4 + 2 * 4)  # fp32 grad twice, m v and param in and out
    assert ref[kf.GEMM] == ours[kf.GEMM]

    eager = kf.step_work(gpt2_124m, _precision("bf16"), B, T, compiled=False)
    assert eager[kf.LAYER_NORM_FORWARD] is None and eager[kf.LAYER_NORM_BACKWARD] is None  # adds run apart
    assert eager[kf.GELU_FORWARD] == ours[kf.GELU_FORWARD]


def test_a_floor_is_the_slower_of_its_bytes_and_its_flops():
    assert kf.Work(bytes=8e9, flops=0).seconds(CEILINGS) == 8e9 / 4.0e12
    assert kf.Work(bytes=1e9, flops=7.9e12).seconds(CEILINGS) == 7.9e12 / 7.9e14
    assert kf.floors_ms({"a": kf.Work(bytes=4e9), "b": None}, CEILINGS) == {"a": pytest.approx(1.0), "b": None}


# The kernels of a profile of gpt2-124m, B=16, T=1024, bf16, on an H200 (both recipes; names cut at 90 characters).
PROFILED_KERNELS = {
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": kf.GEMM,
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT": kf.GEMM,
    "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN": kf.GEMM,
    "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": kf.GEMM,
    "nvjet_sm90_tss_192x192_64x3_1x2_h_badd_coopB_NTN": kf.GEMM,
    "nvjet_sm90_tst_256x128_64x4_1x4_h_bz_coopA_splitK_NNT": kf.GEMM,
    "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN": kf.GEMM,
    "nvjet_sm90_tst_128x128_64x6_2x4_h_bz_NTT": kf.GEMM,
    "nvjet_sm90_tst_128x128_64x6_2x2_h_bz_splitK_NTT": kf.GEMM,
    "nvjet_sm90_tss_192x192_64x3_1x2_h_bz_coopB_NTN": kf.GEMM,
    "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": kf.GEMM,
    "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NTN": kf.GEMM,
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16": kf.GEMM,
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x": kf.ATTENTION,
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x": kf.ATTENTION,
    "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*": kf.ATTENTION,
    "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsigned ": kf.ATTENTION,
    "_cross_entropy_rows_kernel": kf.CROSS_ENTROPY,
    "triton_red_fused__log_softmax__to_copy_prepare_softmax_online_18": kf.CROSS_ENTROPY,
    "triton_red_fused__log_softmax__log_softmax_backward_data__to_copy__unsafe_view_arange_clon": kf.CROSS_ENTROPY,
    "_gelu_forward_kernel": kf.GELU_FORWARD,
    "triton_poi_fused_gelu_view_9": kf.GELU_FORWARD,
    "_gelu_backward_kernel": kf.GELU_BACKWARD,
    "triton_poi_fused_gelu_gelu_backward_view_6": kf.GELU_BACKWARD,
    "triton_red_fused_gelu_gelu_backward_sum_view_7": kf.GELU_BACKWARD,
    "triton_per_fused_add_native_layer_norm_view_3": kf.LAYER_NORM_FORWARD,
    "triton_per_fused_add_native_layer_norm_native_layer_norm_backward_view_6": kf.LAYER_NORM_BACKWARD,
    "triton_per_fused__to_copy_add_native_layer_norm_backward_view_9": kf.LAYER_NORM_BACKWARD,
    "triton_per_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_view_15": kf.LAYER_NORM_BACKWARD,
    "_adamw_kernel": kf.ADAMW,
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous n": kf.ADAMW,
    "triton_poi_fused_cat_transpose_view_7": kf.OTHER,
    "triton_red_fused_sum_view_4": kf.OTHER,
    "triton_red_fused_cat_sum_transpose_view_8": kf.OTHER,
    "triton_poi_fused__to_copy_view_2": kf.OTHER,
    "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::func_wrappe": kf.OTHER,
    "a_kernel_no_pattern_knows": kf.OTHER,
}


# As torch spells its eager kernels and its own SDPA backends (CUTLASS inside, so attention must match first).
TORCH_KERNELS = {
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&)":
        kf.GELU_FORWARD,
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluBackwardCUDAKernelImpl(at::TensorIterator":
        kf.GELU_BACKWARD,
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>": kf.LAYER_NORM_FORWARD,
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<c10::BFloat16, float>": kf.LAYER_NORM_BACKWARD,
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t":
        kf.ATTENTION,
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t":
        kf.ATTENTION,
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": kf.GEMM,
}


@pytest.mark.parametrize("name", [*PROFILED_KERNELS, *TORCH_KERNELS])
def test_every_profiled_kernel_falls_in_its_class(name):
    assert kf.classify(name) == {**PROFILED_KERNELS, **TORCH_KERNELS}[name]


def test_the_table_sorts_by_gap_with_ratio_and_gap_and_one_other_row():
    kernels = [("nvjet_a", 12.0, 48.0), ("nvjet_b", 6.0, 24.0), ("_cross_entropy_rows_kernel", 1.5, 7.0),
               ("_gelu_forward_kernel", 0.5, 12.0), ("_adamw_kernel", 0.9, 1.0), ("_sumsq_kernel", 0.1, 1.0),
               ("triton_poi_fused_cat_transpose_view_7", 0.4, 12.0), ("Memset (Device)", 0.01, 3.0),
               ("triton_red_fused_sum_view_4", 0.3, 12.0), ("k1", 0.05, 1.0), ("k2", 0.04, 1.0), ("k3", 0.03, 1.0)]
    floors = {kf.GEMM: 15.0, kf.CROSS_ENTROPY: 0.5, kf.GELU_FORWARD: 0.6, kf.ADAMW: 1.0, kf.ATTENTION: 1.0,
              kf.LAYER_NORM_FORWARD: None}
    rows = kf.floor_table(kernels, floors)
    by_class = {r["class"]: r for r in rows}
    assert [r["class"] for r in rows] == [kf.GEMM, kf.CROSS_ENTROPY, kf.ADAMW, kf.GELU_FORWARD, kf.ATTENTION,
                                          kf.LAYER_NORM_FORWARD, kf.OTHER]  # gaps 3, 1, 0, -0.1, -1; no floor
    gemm = by_class[kf.GEMM]
    assert (gemm["kernels"], gemm["calls_per_step"], gemm["ms_per_step"]) == (2, 72.0, 18.0)
    assert gemm["ratio"] == pytest.approx(18.0 / 15.0) and gemm["gap_ms"] == pytest.approx(3.0)
    assert by_class[kf.ADAMW]["ms_per_step"] == pytest.approx(1.0)  # the norm pass's kernel is the step's too
    assert by_class[kf.ATTENTION]["kernels"] == 0 and by_class[kf.ATTENTION]["gap_ms"] == -1.0  # none matched
    assert by_class[kf.LAYER_NORM_FORWARD]["ratio"] is None and by_class[kf.LAYER_NORM_FORWARD]["gap_ms"] is None
    other = by_class[kf.OTHER]
    assert (other["kernels"], other["ms_per_step"]) == (6, pytest.approx(0.83))
    assert other["floor_ms_per_step"] is None and other["gap_ms"] is None
    assert [k["kernel"] for k in other["largest"]] == ["triton_poi_fused_cat_transpose_view_7",
                                                      "triton_red_fused_sum_view_4", "k1", "k2", "k3"]


def test_the_printed_table_names_the_ceilings_and_marks_what_has_no_floor():
    rows = kf.floor_table([("nvjet_a", 18.0, 48.0), ("k1", 0.5, 2.0)], {kf.GEMM: 15.0})
    lines = kf.format_table({"copy_bytes_per_s": 4.0e12, "gemm_flops_per_s": 7.9e14, "rows": rows})
    assert "copy 4.00 TB/s" in lines[0] and "GEMM 790 TFLOP/s" in lines[0]
    assert lines[2].split() == [kf.GEMM, "1", "48.0", "18.000", "15.000", "1.20", "3.000"]
    assert lines[3].split()[:7] == [kf.OTHER, "1", "2.0", "0.500", "—", "—", "—"]
    assert "largest: k1 0.500" in lines[3]
