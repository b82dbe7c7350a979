// Element types of the kernels and the rule for the type they accumulate in, shared by the CPU ops,
// the CUDA kernels and launchers, and the torch bindings of both.
//
// Plain C++ (no torch, no CUDA headers), so that the torch-free CUDA kernels, their host plans and
// host tests use the same enum as the torch-facing code. Written once because the rule has to agree
// in two forms: the dtype of the tensors an op allocates for its statistics (lse, log-probabilities,
// the Intention factor) and the C++ type its kernel writes them with.
#pragma once

namespace attn_ext {

/// Element type of a kernel's inputs and outputs.
enum class ScalarType : int {
  kFloat32 = 0,
  kFloat16 = 1,   ///< IEEE half (c10::Half, __half)
  kBFloat16 = 2,  ///< bfloat16 (c10::BFloat16, __nv_bfloat16)
  kFloat64 = 3,   ///< CPU ops (gradcheck) and the Cholesky kernels; the CUDA attention kernels refuse it
};

/// The accumulation rule: sums, softmax statistics and everything an op returns besides its outputs
/// proper (lse, log-probabilities, the Intention factor) are fp32 for fp16, bf16 and fp32 inputs and
/// fp64 for fp64 inputs, which gradcheck needs. 16-bit accumulation would lose the softmax's sums.
constexpr ScalarType accumulation_type(ScalarType input) {
  return input == ScalarType::kFloat64 ? ScalarType::kFloat64 : ScalarType::kFloat32;
}

/// The same rule on element types, for kernels templated on theirs: acc_type<scalar_t> is double for
/// double and float for float and every 16-bit type (c10::Half, __half, __nv_bfloat16, ...), which
/// this header cannot name without their headers, hence the size test instead of a list.
template <typename scalar_t>
struct Accumulation {
  static_assert(sizeof(scalar_t) <= 4, "fp64 is the only element type wider than fp32");
  using type = float;
};
template <>
struct Accumulation<double> {
  using type = double;
};
template <typename scalar_t>
using acc_type = typename Accumulation<scalar_t>::type;

/// Bytes of one element.
constexpr int element_size(ScalarType t) {
  return t == ScalarType::kFloat64 ? 8 : t == ScalarType::kFloat32 ? 4 : 2;
}

static_assert(sizeof(acc_type<double>) == element_size(accumulation_type(ScalarType::kFloat64)) &&
                  sizeof(acc_type<float>) == element_size(accumulation_type(ScalarType::kFloat32)) &&
                  sizeof(acc_type<short>) == element_size(accumulation_type(ScalarType::kFloat16)),
              "the two forms of the accumulation rule agree");

}  // namespace attn_ext
