// Compiles the kernel body named by VEC16_BODY (a header written against vec16.h's V) once per code
// path: namespaces portable, avx2 (AVX2 + FMA) and avx512 (AVX-512F), each for its instruction set.
// Include after vec16.h, inside an anonymous namespace, with VEC16_BODY defined as a quoted file name.
namespace portable {
#include VEC16_BODY
}
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include VEC16_BODY
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace avx512 {
#include VEC16_BODY
}
#pragma GCC pop_options
#undef VEC16_BODY
