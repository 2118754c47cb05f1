// The module of the AMX build (speculant_cpu_kernels, Intel Sapphire Rapids and later): the bf16
// matmul on AMX tiles, the row-invariant attention, and the prompt prefill through int4 weights
// in bf16 (int4_prefill_amx.cpp). Generated tokens of int4 layers run on int4_x86.cpp's module on
// every x86-64 CPU, AMX ones included (its AMX path: int4_amx_x86.cpp).
#include <torch/extension.h>

#include "amx_tiles.h"

torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed);  // attention.cpp
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor wp, torch::Tensor bias);  // bf16_amx.cpp
torch::Tensor int4_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor scales, torch::Tensor bias,
                              bool out_fp32);  // int4_prefill_amx.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "row-invariant attention of a few tokens over a bf16 KV cache (AVX-512)");
  m.def("bf16_mm", &bf16_mm, "bf16 matmul on AMX, up to 32 rows per pass over the weights");
  m.def("int4_prefill_mm", &int4_prefill_mm, "int4 weights widened to bf16 on AMX: prompt prefill (not int4_gemm's bits)");
  m.def("amx_available", &speculant_amx::permitted, "can this process use AMX tiles (kernel permission granted)");
}
