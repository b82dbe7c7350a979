// te_attention_mlp.h's loops, compiled once per instruction set (as vectorized_rows.cpp: ATTN_EXT_TARGET copies of
// one template, picked by isa_level() at the first call). Both loops walk the hidden units kTeUnits at a time and,
// inside, the tile's pairs a vector at a time: a block's four pre-activations stay in registers while each feature
// row is read once, so a multiply-add costs a broadcast weight and no extra memory traffic.
#include "te_attention_mlp.h"

#include <cstring>

#include "isa_level.h"
#include "simd_vector.h"

namespace attn_ext::cpu {

namespace {

using simd::kLanes;
using simd::load;
using simd::store;

template <typename T, int VB>
using Vec = typename simd::Vector<T, VB>::type;

template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE Vec<T, VB> splat(T x) {
  return Vec<T, VB>{} + x;  // one broadcast (a lane-by-lane fill went through the stack)
}

template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE T lane_sum(const Vec<T, VB>& v) {
  T s = 0;
  for (int i = 0; i < kLanes<T, VB>; ++i) s += v[i];
  return s;
}

/// act(x) per lane; relu in vector form (the activation of TE-TNP's models), the others per lane.
template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE Vec<T, VB> activate(TeActivation a, Vec<T, VB> x) {
  if (a == TeActivation::kRelu) {
    const Vec<T, VB> zero{};
    return x < zero ? zero : x;  // NaN stays NaN
  }
  for (int i = 0; i < kLanes<T, VB>; ++i) x[i] = te_activate<T>(a, x[i]);
  return x;
}

template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE Vec<T, VB> derivative(TeActivation a, Vec<T, VB> x) {
  if (a == TeActivation::kRelu) {
    const Vec<T, VB> zero{}, one = splat<T, VB>(T(1));
    return x > zero ? one : zero;
  }
  for (int i = 0; i < kLanes<T, VB>; ++i) x[i] = te_activation_derivative<T>(a, x[i]);
  return x;
}

/// a[u][i] ← the pre-activations of unit u (bias splat b[u], weights w1 + u·F) over pair vector i from p.
template <typename T, int VB, int U>
ATTN_EXT_ALWAYS_INLINE void preactivations(const T* w1, const Vec<T, VB>* b, const T* x, int64_t F, int64_t P,
                                           int64_t p, Vec<T, VB> (&a)[kTeUnits][U]) {
  constexpr int W = kLanes<T, VB>;
#pragma GCC unroll 4
  for (int u = 0; u < kTeUnits; ++u) {
#pragma GCC unroll 2
    for (int i = 0; i < U; ++i) a[u][i] = b[u];
  }
  for (int64_t f = 0; f < F; ++f) {
    Vec<T, VB> xf[U];
#pragma GCC unroll 2
    for (int i = 0; i < U; ++i) xf[i] = load<T, VB>(x + f * P + p + i * W);
#pragma GCC unroll 4
    for (int u = 0; u < kTeUnits; ++u) {
      const Vec<T, VB> w = splat<T, VB>(w1[u * F + f]);
#pragma GCC unroll 2
      for (int i = 0; i < U; ++i) a[u][i] += w * xf[i];
    }
  }
}

/// One register block of te_logits: kTeUnits hidden units (pre-activations from `b`, the hoisted bias splats) over
/// U vectors of pairs from p.
template <typename T, int VB, int U>
ATTN_EXT_ALWAYS_INLINE void logits_block(const TeMlp<T>& mlp, const T* w1, const T* w2, const Vec<T, VB>* b,
                                         const T* x, T* logits, int64_t P, int64_t p) {
  constexpr int W = kLanes<T, VB>;
  const int64_t F = mlp.features, H = mlp.heads;
  Vec<T, VB> a[kTeUnits][U];
  preactivations<T, VB, U>(w1, b, x, F, P, p, a);
#pragma GCC unroll 4
  for (int u = 0; u < kTeUnits; ++u) {
#pragma GCC unroll 2
    for (int i = 0; i < U; ++i) a[u][i] = activate<T, VB>(mlp.activation, a[u][i]);
  }
  for (int64_t h = 0; h < H; ++h) {
#pragma GCC unroll 2
    for (int i = 0; i < U; ++i) {
      T* row = logits + h * P + p + i * W;
      Vec<T, VB> l = load<T, VB>(row);
#pragma GCC unroll 4
      for (int u = 0; u < kTeUnits; ++u) l += w2[u * H + h] * a[u][i];
      store<T, VB>(row, l);
    }
  }
}

template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE void te_logits_impl(const TeMlp<T>& mlp, const T* x, T* logits, int64_t P) {
  constexpr int W = kLanes<T, VB>;
  const int64_t H = mlp.heads;
  for (int64_t h = 0; h < H; ++h) {
    const Vec<T, VB> b = splat<T, VB>(mlp.b2[h]);
    for (int64_t p = 0; p < P; p += W) store<T, VB>(logits + h * P + p, b);
  }
  for (int64_t c = 0; c < mlp.hidden; c += kTeUnits) {
    const T* w1 = mlp.w1 + c * mlp.features;
    const T* w2 = mlp.w2t + c * H;
    Vec<T, VB> b[kTeUnits];
    for (int u = 0; u < kTeUnits; ++u) b[u] = splat<T, VB>(mlp.b1[c + u]);
    int64_t p = 0;
    for (; p + 2 * W <= P; p += 2 * W) logits_block<T, VB, 2>(mlp, w1, w2, b, x, logits, P, p);
    for (; p < P; p += W) logits_block<T, VB, 1>(mlp, w1, w2, b, x, logits, P, p);
  }
}

/// One register block of te_logits_backward over U vectors of pairs from p: the units' pre-activations again, their
/// gradients, the lane-wise partial sums of the weight gradients in `part` (per unit: F for w1, H for w2, 1 for b1),
/// and dx (written by the first block of units, added to by the others).
template <typename T, int VB, int U>
ATTN_EXT_ALWAYS_INLINE void backward_block(const TeMlp<T>& mlp, const T* w1, const T* w2, const Vec<T, VB>* b,
                                           const T* x, const T* dl, T* dx, int64_t P, int64_t p, bool first,
                                           T* const* part) {
  constexpr int W = kLanes<T, VB>;
  const int64_t F = mlp.features, H = mlp.heads;
  Vec<T, VB> a[kTeUnits][U], dh[kTeUnits][U] = {};
  preactivations<T, VB, U>(w1, b, x, F, P, p, a);
  Vec<T, VB> hid[kTeUnits][U];  // the activations; `a` becomes their derivatives
#pragma GCC unroll 4
  for (int u = 0; u < kTeUnits; ++u) {
#pragma GCC unroll 2
    for (int i = 0; i < U; ++i) {
      hid[u][i] = activate<T, VB>(mlp.activation, a[u][i]);
      a[u][i] = derivative<T, VB>(mlp.activation, a[u][i]);
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    Vec<T, VB> d[U];
#pragma GCC unroll 2
    for (int i = 0; i < U; ++i) d[i] = load<T, VB>(dl + h * P + p + i * W);
#pragma GCC unroll 4
    for (int u = 0; u < kTeUnits; ++u) {
      const Vec<T, VB> w = splat<T, VB>(w2[u * H + h]);
      Vec<T, VB> g = d[0] * hid[u][0];
      dh[u][0] += w * d[0];
#pragma GCC unroll 2
      for (int i = 1; i < U; ++i) {
        g += d[i] * hid[u][i];
        dh[u][i] += w * d[i];
      }
      T* acc = part[u] + (F + h) * W;
      store<T, VB>(acc, load<T, VB>(acc) + g);
    }
  }
#pragma GCC unroll 4
  for (int u = 0; u < kTeUnits; ++u) {
    Vec<T, VB> g{};
#pragma GCC unroll 2
    for (int i = 0; i < U; ++i) {
      dh[u][i] *= a[u][i];  // now the pre-activation's gradient
      g += dh[u][i];
    }
    T* acc = part[u] + (F + H) * W;
    store<T, VB>(acc, load<T, VB>(acc) + g);
  }
  for (int64_t f = 0; f < F; ++f) {
    Vec<T, VB> xf[U], out[U];
#pragma GCC unroll 2
    for (int i = 0; i < U; ++i) {
      xf[i] = load<T, VB>(x + f * P + p + i * W);
      out[i] = first ? Vec<T, VB>{} : load<T, VB>(dx + f * P + p + i * W);
    }
#pragma GCC unroll 4
    for (int u = 0; u < kTeUnits; ++u) {
      const Vec<T, VB> w = splat<T, VB>(w1[u * F + f]);
      Vec<T, VB> g = dh[u][0] * xf[0];
      out[0] += w * dh[u][0];
#pragma GCC unroll 2
      for (int i = 1; i < U; ++i) {
        g += dh[u][i] * xf[i];
        out[i] += w * dh[u][i];
      }
      T* acc = part[u] + f * W;
      store<T, VB>(acc, load<T, VB>(acc) + g);
    }
#pragma GCC unroll 2
    for (int i = 0; i < U; ++i) store<T, VB>(dx + f * P + p + i * W, out[i]);
  }
}

/// The scratch holds one register block's lane-wise partial sums of the weight gradients: per unit, F for w1, H for
/// w2 and one for b1, each a vector (W lanes ≤ kTePairAlign); reduced into `grads` once per block.
template <typename T, int VB>
ATTN_EXT_ALWAYS_INLINE void te_logits_backward_impl(const TeMlp<T>& mlp, const T* x, const T* dl, T* dx, int64_t P,
                                                    const TeMlpGrads<T>& grads, T* scratch) {
  constexpr int W = kLanes<T, VB>;
  const int64_t F = mlp.features, H = mlp.heads, per_unit = (F + H + 1) * W;
  for (int64_t h = 0; h < H; ++h) {
    Vec<T, VB> s{};
    for (int64_t p = 0; p < P; p += W) s += load<T, VB>(dl + h * P + p);
    grads.b2[h] += lane_sum<T, VB>(s);
  }
  for (int64_t c = 0; c < mlp.hidden; c += kTeUnits) {
    const T* w1 = mlp.w1 + c * F;
    const T* w2 = mlp.w2t + c * H;
    std::memset(scratch, 0, sizeof(T) * kTeUnits * per_unit);
    T* const part[kTeUnits] = {scratch, scratch + per_unit, scratch + 2 * per_unit, scratch + 3 * per_unit};
    Vec<T, VB> b[kTeUnits];
    for (int u = 0; u < kTeUnits; ++u) b[u] = splat<T, VB>(mlp.b1[c + u]);
    int64_t p = 0;
    for (; p + 2 * W <= P; p += 2 * W) backward_block<T, VB, 2>(mlp, w1, w2, b, x, dl, dx, P, p, c == 0, part);
    for (; p < P; p += W) backward_block<T, VB, 1>(mlp, w1, w2, b, x, dl, dx, P, p, c == 0, part);
    for (int u = 0; u < kTeUnits; ++u) {
      for (int64_t f = 0; f < F; ++f) grads.w1[(c + u) * F + f] += lane_sum<T, VB>(load<T, VB>(part[u] + f * W));
      for (int64_t h = 0; h < H; ++h) grads.w2t[(c + u) * H + h] += lane_sum<T, VB>(load<T, VB>(part[u] + (F + h) * W));
      grads.b1[c + u] += lane_sum<T, VB>(load<T, VB>(part[u] + (F + H) * W));
    }
  }
  if (mlp.hidden == 0) std::memset(dx, 0, sizeof(T) * F * P);
}

template <typename T>
struct MlpKernels {
  void (*logits)(const TeMlp<T>&, const T*, T*, int64_t);
  void (*backward)(const TeMlp<T>&, const T*, const T*, T*, int64_t, const TeMlpGrads<T>&, T*);
};

#define ATTN_EXT_TE_MLP_KERNELS(name, target, VB)                                                                    \
  template <typename T>                                                                                              \
  target void te_logits_##name(const TeMlp<T>& mlp, const T* x, T* logits, int64_t P) {                              \
    te_logits_impl<T, VB>(mlp, x, logits, P);                                                                        \
  }                                                                                                                  \
  template <typename T>                                                                                              \
  target void te_logits_backward_##name(const TeMlp<T>& mlp, const T* x, const T* dl, T* dx, int64_t P,              \
                                        const TeMlpGrads<T>& grads, T* scratch) {                                    \
    te_logits_backward_impl<T, VB>(mlp, x, dl, dx, P, grads, scratch);                                               \
  }                                                                                                                  \
  template <typename T>                                                                                              \
  constexpr MlpKernels<T> kMlpKernels_##name{te_logits_##name<T>, te_logits_backward_##name<T>};

ATTN_EXT_TE_MLP_KERNELS(baseline, , 16)
#ifdef ATTN_EXT_X86_KERNELS
ATTN_EXT_TE_MLP_KERNELS(avx2, ATTN_EXT_TARGET("arch=x86-64-v3"), 32)
ATTN_EXT_TE_MLP_KERNELS(avx512, ATTN_EXT_TARGET("arch=x86-64-v4"), 64)
#endif

template <typename T>
const MlpKernels<T>& mlp_kernels() {
  // Read once: ATTN_EXT_CPU_ISA caps the level for tests, as for the row kernels.
  static const IsaLevel level = isa_level();
  switch (level) {
#ifdef ATTN_EXT_X86_KERNELS
    case IsaLevel::kAvx512: return kMlpKernels_avx512<T>;
    case IsaLevel::kAvx2: return kMlpKernels_avx2<T>;
#endif
    default: return kMlpKernels_baseline<T>;
  }
}

}  // namespace

int64_t te_backward_scratch_size(int64_t features, int64_t heads) {
  return kTeUnits * (features + heads + 1) * kTePairAlign;
}

void te_logits(const TeMlp<float>& mlp, const float* x, float* logits, int64_t P) {
  mlp_kernels<float>().logits(mlp, x, logits, P);
}
void te_logits(const TeMlp<double>& mlp, const double* x, double* logits, int64_t P) {
  mlp_kernels<double>().logits(mlp, x, logits, P);
}
void te_logits_backward(const TeMlp<float>& mlp, const float* x, const float* dlogits, float* dx, int64_t P,
                        const TeMlpGrads<float>& grads, float* scratch) {
  mlp_kernels<float>().backward(mlp, x, dlogits, dx, P, grads, scratch);
}
void te_logits_backward(const TeMlp<double>& mlp, const double* x, const double* dlogits, double* dx, int64_t P,
                        const TeMlpGrads<double>& grads, double* scratch) {
  mlp_kernels<double>().backward(mlp, x, dlogits, dx, P, grads, scratch);
}

}  // namespace attn_ext::cpu
