// The two warp-level tile products of the tensor-core attention kernels (forward and backward), on
// 16-bit operands in shared memory with fp32 results in shared memory. One warp computes a 16-row
// strip; every wmma call is warp-collective, so all 32 lanes must call these together.
//
// Fragments are used only through load/store/mma/fill (their element-to-lane mapping is
// unspecified), which is also what lets csrc/tests/cuda_emulation/mma.h run them on the host.
#pragma once

#include <type_traits>

#include <cuda_bf16.h>
#include <mma.h>

#include "common/dtypes.cuh"
#include "common/pair_mask.cuh"

namespace attn_ext {
namespace cuda {
namespace detail {

/// Whether this compilation pass has 16×16×16 WMMA fragments of `scalar_t`: fp16 from sm_70, bf16 only
/// from sm_80 (<mma.h> declares the bf16 fragments for __CUDA_ARCH__ >= 800 only). The host pass and
/// the host emulator have both. A tensor-core kernel instantiated for a type its pass lacks compiles
/// to a trap instead of its body, so that one build serves sm_70/sm_75 and newer; the launch plans
/// refuse bf16 below compute capability 8.0 (common/compute_capability.h), so the trap is never reached.
template <typename scalar_t>
constexpr bool kWmmaHasFragments =
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    !std::is_same<scalar_t, __nv_bfloat16>::value;
#else
    true;
#endif

/// out[16][kOther] (fp32, stride out_ld) = a[16][kDim] · b[kOther][kDim]ᵀ, a and b row-major 16-bit.
template <typename scalar_t, int kDim, int kOther>
__device__ __forceinline__ void warp_gemm_abt(float* out, int out_ld, const scalar_t* a, const scalar_t* b, int ld) {
  namespace wmma = nvcuda::wmma;
#pragma unroll
  for (int j = 0; j < kOther / 16; ++j) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll 4
    for (int kk = 0; kk < kDim; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::col_major> fb;  // row-major b = col-major bᵀ
      wmma::load_matrix_sync(fa, a + kk, ld);
      wmma::load_matrix_sync(fb, b + 16 * j * ld + kk, ld);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + 16 * j, acc, out_ld, wmma::mem_row_major);
  }
}

/// acc[16][kDim] (fp32, stride acc_ld) += coef[16][kOther] · rows[kOther][kDim], 16-bit row-major inputs.
template <typename scalar_t, int kDim, int kOther>
__device__ __forceinline__ void warp_gemm_acc(float* acc, int acc_ld, const scalar_t* coef, int coef_ld,
                                              const scalar_t* rows, int rows_ld) {
  namespace wmma = nvcuda::wmma;
#pragma unroll 1
  for (int j = 0; j < kDim / 16; ++j) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::load_matrix_sync(c, acc + 16 * j, acc_ld, wmma::mem_row_major);
#pragma unroll
    for (int kk = 0; kk < kOther; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, scalar_t, wmma::row_major> fa;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, scalar_t, wmma::row_major> fb;
      wmma::load_matrix_sync(fa, coef + kk, coef_ld);
      wmma::load_matrix_sync(fb, rows + kk * rows_ld + 16 * j, rows_ld);
      wmma::mma_sync(c, fa, fb, c);
    }
    wmma::store_matrix_sync(acc + 16 * j, c, acc_ld, wmma::mem_row_major);
  }
}

/// warp_gemm_acc's product in fp32 scalar arithmetic, with masked pairs' coefficients (−0.0,
/// common/pair_mask.cuh) contributing nothing whatever `rows` holds: the pair-mask kernels take it
/// for a streamed tile that holds inf or NaN. The warp's lanes split the [16][kDim] accumulator.
template <typename scalar_t, int kDim, int kOther>
__device__ __forceinline__ void warp_gemm_acc_exact(float* acc, int acc_ld, const scalar_t* coef, int coef_ld,
                                                    const scalar_t* rows, int rows_ld, int lane) {
  for (int idx = lane; idx < 16 * kDim; idx += 32) {
    const int r = idx / kDim, c = idx % kDim;
    float sum = acc[r * acc_ld + c];
    for (int t = 0; t < kOther; ++t) sum = masked_fma(to_float(coef[r * coef_ld + t]), to_float(rows[t * rows_ld + c]), sum);
    acc[r * acc_ld + c] = sum;
  }
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
