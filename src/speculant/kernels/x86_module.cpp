// The kernels for every x86-64 CPU, one module whatever the CPU: each code path is compiled for
// its instruction set (#pragma GCC target) and chosen at run time from what the CPU has.
#include <torch/extension.h>

torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor qpack, torch::Tensor scales, torch::Tensor bias, bool out_fp32,
                        int64_t isa);  // int4_x86.cpp
torch::Tensor int4_gemm_kquant(torch::Tensor x, torch::Tensor qpack, torch::Tensor kd, torch::Tensor km,
                               torch::Tensor bias, bool out_fp32, int64_t isa);
torch::Tensor int4_gemm_q5k(torch::Tensor x, torch::Tensor qpack, torch::Tensor qh, torch::Tensor kd, torch::Tensor km,
                            torch::Tensor bias, bool out_fp32, int64_t isa);
torch::Tensor int4_gemm_q6k(torch::Tensor x, torch::Tensor qpack, torch::Tensor qh, torch::Tensor kd, torch::Tensor km,
                            torch::Tensor bias, bool out_fp32, int64_t isa);
torch::Tensor int4_gemm_f32(torch::Tensor x, torch::Tensor qpack, torch::Tensor sf, torch::Tensor qh, torch::Tensor bias,
                            bool out_fp32, int64_t isa);
int64_t int4_best_isa();
bool int4_isa_supported(int64_t isa);
torch::Tensor attend_x86(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed, int64_t past,
                         int64_t isa);  // attention_x86.cpp
torch::Tensor attend_capped_x86(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed,
                                int64_t past, double scale, double cap, int64_t isa);
bool attend_isa_supported(int64_t isa);
torch::Tensor rms_norm_x86(torch::Tensor x, torch::Tensor w, double eps, int64_t isa);  // layer_x86.cpp
torch::Tensor silu_mul_x86(torch::Tensor gu, int64_t isa);
torch::Tensor rope_qkv_x86(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t Hq, int64_t Hkv,
                           torch::Tensor slab, int64_t start, int64_t isa);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_gemm", &int4_gemm, "int4 weight x int8 activation matmul, row-invariant, the same bits on every code path");
  m.def("int4_gemm_kquant", &int4_gemm_kquant, "int4_gemm with a GGUF file's Q4_K scales as they are (groups of 32)");
  m.def("int4_gemm_q5k", &int4_gemm_q5k, "int4_gemm_kquant with a GGUF file's Q5_K codes (5 bits: a plane of fifth bits)");
  m.def("int4_gemm_q6k", &int4_gemm_q6k, "int4_gemm with a GGUF file's Q6_K codes and scales as they are (groups of 16)");
  m.def("int4_gemm_f32", &int4_gemm_f32, "int4_gemm with fp32 group scales and offsets, 4- or 5-bit codes (GGUF Q4_0, Q4_1, Q5_0, Q5_1; Q8_0 as two planes)");
  m.def("int4_best_isa", &int4_best_isa, "the code path int4_gemm takes here: 1 avx512-vnni, 2 avx2-vnni, 3 avx2, 4 portable, 5 amx");
  m.def("int4_isa_supported", &int4_isa_supported, "whether this CPU runs an int4_gemm code path");
  m.def("attend", &attend_x86, "row-invariant attention over a bf16 KV cache, the same bits on every code path");
  m.def("attend_capped", &attend_capped_x86, "attend with a scale of its own and soft-capped scores (Gemma 2)");
  m.def("attend_isa_supported", &attend_isa_supported, "whether this CPU runs an attend code path (1, 3, 4)");
  m.def("rms_norm", &rms_norm_x86, "RMSNorm of bf16 rows, rounded once to bf16");
  m.def("silu_mul", &silu_mul_x86, "silu(gate) * up of bf16 rows [gate | up]");
  m.def("rope_qkv", &rope_qkv_x86, "RoPE of q and k from a joined q/k/v projection; k and v written into the KV cache");
}
