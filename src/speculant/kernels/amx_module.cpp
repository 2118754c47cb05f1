// The module of the AMX build (speculant_cpu_kernels, Intel Sapphire Rapids and later): the bf16
// matmul on AMX tiles, the row-invariant attention, and the prompt prefill through int4 weights
// and a GGUF file's blocks widened to bf16 (int4_prefill_amx.cpp). Generated tokens of int4 and
// block layers run on int4_x86.cpp's module on every x86-64 CPU, AMX ones included (its AMX path:
// int4_amx_x86.cpp).
#include <torch/extension.h>

#include "amx_tiles.h"

torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed);  // attention.cpp
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor wp, torch::Tensor bias);  // bf16_amx.cpp
// int4_prefill_amx.cpp: int4 weights, and a GGUF file's blocks as int4_x86.cpp's entry points take them
torch::Tensor int4_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor scales, torch::Tensor bias,
                              bool out_fp32);
torch::Tensor kquant_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor kd, torch::Tensor km,
                                torch::Tensor bias, bool out_fp32);
torch::Tensor q5k_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor qh, torch::Tensor kd, torch::Tensor km,
                             torch::Tensor bias, bool out_fp32);
torch::Tensor q6k_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor qh, torch::Tensor kd, torch::Tensor km,
                             torch::Tensor bias, bool out_fp32);
torch::Tensor f32_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor sf, torch::Tensor qh,
                             torch::Tensor bias, bool out_fp32);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "row-invariant attention of a few tokens over a bf16 KV cache (AVX-512)");
  m.def("bf16_mm", &bf16_mm, "bf16 matmul on AMX, up to 32 rows per pass over the weights");
  m.def("int4_prefill_mm", &int4_prefill_mm, "int4 weights widened to bf16 on AMX: prompt prefill (not int4_gemm's bits)");
  m.def("kquant_prefill_mm", &kquant_prefill_mm, "Q4_K blocks widened to bf16 on AMX: prompt prefill");
  m.def("q5k_prefill_mm", &q5k_prefill_mm, "Q5_K blocks widened to bf16 on AMX: prompt prefill");
  m.def("q6k_prefill_mm", &q6k_prefill_mm, "Q6_K blocks widened to bf16 on AMX: prompt prefill");
  m.def("f32_prefill_mm", &f32_prefill_mm, "Q4_0/Q4_1/Q5_0/Q5_1 blocks (fp32 scales) widened to bf16 on AMX: prompt prefill");
  m.def("amx_available", &speculant_amx::permitted, "can this process use AMX tiles (kernel permission granted)");
}
