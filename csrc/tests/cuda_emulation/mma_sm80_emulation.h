// Host emulation of the sm_80 tensor-core primitives of common/mma_sm80.cuh (its comment gives the API
// and the PTX fragment layouts), so that kernels written on them run under cuda_emulator.h. That
// header includes this one under g++, after declaring MmaA/MmaB/MmaC and pack_pair: include it, not
// this file.
//
// mma and ldmatrix are warp-collective, like the shuffles: each lane posts its operands (mma) or its
// row address (ldmatrix) in its slot of cuda_emu::Block's tensor mailboxes for the parity of its
// generation, stamped with the generation and the operation, and yields (Sync::kShuffle). After the
// yield it checks that all 32 lanes of its warp posted the same operation in the same generation, so
// a kernel whose lanes diverge around a collective (undefined on a GPU) aborts instead of mixing
// operands. A slot is rewritten two generations later, after every lane of the warp has read it.
//  * mma: after the yield each lane computes its own accumulators from all lanes' A and B registers.
//  * ldmatrix: the lane that completes the warp's posts reads all its rows from shared memory, before
//    the yield. At that moment every lane of the warp has done all that precedes the ldmatrix in
//    program order and none has gone on, so no lane's later shared-memory write can be seen (on a GPU
//    the warp's ldmatrix is one instruction). Warps later in the scheduling order have not yet run
//    this round: a kernel that reads another warp's cp.async data without a __syncthreads after the
//    wait reads stale shared memory here, which is the race a GPU would have.
//  * cp.async: nothing is copied at issue. The copies are recorded per thread, grouped by commit, and
//    performed when cp_async_wait<N> leaves at most N groups pending (copies issued after the last
//    commit belong to no group and stay pending, as in PTX), so shared memory read before the wait
//    is stale, as on a GPU. Reading global memory only then is exact: kernel inputs do not change
//    during a launch. A thread that finishes with copies pending aborts (cuda_emulator.h).
// Shared memory is the dynamic shared memory the emulation tests define (smem_raw, in
// emulator_extras_tree.h); shared_address() maps a pointer into it to a 32-bit shared-window address
// and ldmatrix maps such addresses back. Pointers elsewhere, addresses outside it, and misaligned ones
// (ldmatrix rows, cp.async source and destination: 16 bytes) abort, since the GPU would fault on them
// or read something else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cuda_emulator.h"
#include "emulator_extras_tree.h"  // smem_raw, the shared memory

namespace attn_ext {
namespace cuda {
namespace detail {

template <>
inline uint32_t pack_pair<__half>(float lo, float hi) {
  return static_cast<uint32_t>(__float2half_rn(lo).bits) | static_cast<uint32_t>(__float2half_rn(hi).bits) << 16;
}
template <>
inline uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  return static_cast<uint32_t>(__float2bfloat16_rn(lo).bits) |
         static_cast<uint32_t>(__float2bfloat16_rn(hi).bits) << 16;
}

namespace mma_emulation {

/// The shared-window address of smem_raw[0]. Not 0, since nothing promises a kernel's shared memory
/// starts there (sm_80 and later reserve 1 KB of it per block): a kernel passing plain byte offsets
/// where shared_address() results are due reads other rows or aborts here.
constexpr uint32_t kSharedWindowBase = 1024;

/// The host pointer of the `bytes` bytes at shared-window address `address`; aborts outside smem_raw.
inline unsigned char* shared_pointer(uint32_t address, size_t bytes, const char* what) {
  if (address < kSharedWindowBase || address - kSharedWindowBase > sizeof(smem_raw) - bytes) ::cuda_emu::fail(what);
  return reinterpret_cast<unsigned char*>(smem_raw) + (address - kSharedWindowBase);
}

/// The collectives a stamp names: all lanes of a warp must execute the same one (PTX .aligned).
enum Op : uint32_t { kMmaF16 = 1, kMmaBf16, kLdmatrixX4, kLdmatrixX4Trans, kLdmatrixX2, kLdmatrixX2Trans };

/// This lane's place in the tensor mailboxes for one collective.
struct Slot {
  unsigned int warp, lane, parity;
  uint32_t stamp;
};

/// Takes the calling lane's next generation and stamps its slot (after the lane stored its operands).
inline Slot stamp(Op op) {
  ::cuda_emu::Fiber& f = ::cuda_emu::self();
  const Slot s{f.linear_id / 32, f.linear_id % 32, f.tensor_generation & 1u, (f.tensor_generation << 3) | op};
  ++f.tensor_generation;
  ::cuda_emu::block().tensor_stamp[s.parity][s.warp][s.lane] = s.stamp;
  return s;
}
inline Slot next_slot() {
  const ::cuda_emu::Fiber& f = ::cuda_emu::self();
  return Slot{f.linear_id / 32, f.linear_id % 32, f.tensor_generation & 1u, 0};
}

/// Whether every lane of the warp has posted the collective `s` names.
inline bool warp_posted(const Slot& s) {
  for (const uint32_t other : ::cuda_emu::block().tensor_stamp[s.parity][s.warp]) {
    if (other != s.stamp) return false;
  }
  return true;
}
inline void check_warp(const Slot& s, const char* what) {
  if (!warp_posted(s)) ::cuda_emu::fail(what);
}

template <typename scalar_t>
float element(uint32_t reg, unsigned int half) {
  return to_float(scalar_t{static_cast<uint16_t>(reg >> (16 * half))});
}

/// The 8×8 matrices of one ldmatrix, read for the whole warp (see the file comment): matrix m's row j
/// is at lane 8m + j's address; lane l's register m gets (row l/4, cols 2(l%4), 2(l%4)+1), or with
/// kTrans (rows 2(l%4), 2(l%4)+1; col l/4), the lower-numbered element in the low half.
template <int kMatrices, bool kTrans>
void gather_ldmatrix(const Slot& s) {
  ::cuda_emu::Block& b = ::cuda_emu::block();
  for (int m = 0; m < kMatrices; ++m) {
    uint16_t tile[8][8];
    for (int j = 0; j < 8; ++j) {
      const uint32_t row = b.ldmatrix_rows[s.parity][s.warp][8 * m + j];
      std::memcpy(tile[j], shared_pointer(row, sizeof tile[j], "ldmatrix: a row is outside shared memory"),
                  sizeof tile[j]);
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      const uint16_t lo = kTrans ? tile[2 * t][g] : tile[g][2 * t];
      const uint16_t hi = kTrans ? tile[2 * t + 1][g] : tile[g][2 * t + 1];
      b.ldmatrix_fragments[s.parity][s.warp][l][m] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
    }
  }
}

template <int kMatrices, bool kTrans>
void ldmatrix(uint32_t* r, uint32_t row, Op op) {
  ::cuda_emu::Block& b = ::cuda_emu::block();
  const Slot next = next_slot();
  // Only lanes 0..8·kMatrices-1 give addresses (sm_80 and later ignore the others' addresses).
  if (next.lane < 8u * kMatrices && row % 16 != 0) {
    ::cuda_emu::fail("ldmatrix: a row address is not 16-byte aligned");
  }
  b.ldmatrix_rows[next.parity][next.warp][next.lane] = row;
  const Slot s = stamp(op);
  if (warp_posted(s)) gather_ldmatrix<kMatrices, kTrans>(s);  // this lane completed the warp
  ::cuda_emu::yield(::cuda_emu::Sync::kShuffle);
  check_warp(s, "ldmatrix: the lanes of a warp did not all execute the same ldmatrix");
  for (int m = 0; m < kMatrices; ++m) r[m] = b.ldmatrix_fragments[s.parity][s.warp][s.lane][m];
}

}  // namespace mma_emulation

/// acc += a · b. The 16 products of 16-bit values are exact in double; each element sums them and
/// its C value in double and rounds once to fp32. The tensor cores' internal summation order and
/// rounding are not modelled bit for bit, which is why tests compare with a tolerance derived from
/// fp32 accumulation rather than exactly.
template <typename scalar_t>
void mma_m16n8k16(MmaC& acc, const MmaA& a, const MmaB& b) {
  static_assert(std::is_same<scalar_t, __half>::value || std::is_same<scalar_t, __nv_bfloat16>::value,
                "mma_m16n8k16 takes __half or __nv_bfloat16 operands");
  namespace emu = mma_emulation;
  ::cuda_emu::Block& blk = ::cuda_emu::block();
  const emu::Slot next = emu::next_slot();
  uint32_t* mine = blk.mma_operands[next.parity][next.warp][next.lane];
  for (int i = 0; i < 4; ++i) mine[i] = a.r[i];
  for (int i = 0; i < 2; ++i) mine[4 + i] = b.r[i];
  const emu::Slot s = emu::stamp(std::is_same<scalar_t, __half>::value ? emu::kMmaF16 : emu::kMmaBf16);
  ::cuda_emu::yield(::cuda_emu::Sync::kShuffle);
  emu::check_warp(s, "mma_m16n8k16: the lanes of a warp did not all execute the same mma");
  const uint32_t(&ops)[32][6] = blk.mma_operands[s.parity][s.warp];
  // A(row, k): lane 4(row % 8) + (k % 8)/2, register row/8 + 2(k/8); B(k, n): lane 4n + (k % 8)/2,
  // register 4 + k/8; both in half k % 2 (mma_sm80.cuh's layouts, inverted).
  const unsigned int g = s.lane / 4, t = s.lane % 4;
  for (int i = 0; i < 4; ++i) {
    const unsigned int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
    double sum = acc.r[i];
    for (unsigned int k = 0; k < 16; ++k) {
      const float x = emu::element<scalar_t>(ops[4 * (row % 8) + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2);
      const float y = emu::element<scalar_t>(ops[4 * col + (k % 8) / 2][4 + k / 8], k % 2);
      sum += static_cast<double>(x) * y;
    }
    acc.r[i] = static_cast<float>(sum);
  }
}

/// The shared-window address of a pointer into shared memory (smem_raw); one past its end is allowed,
/// like any pointer, and fails only when accessed.
inline uint32_t shared_address(const void* p) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p), base = reinterpret_cast<uintptr_t>(smem_raw);
  if (at < base || at - base > sizeof(smem_raw)) ::cuda_emu::fail("shared_address: a pointer not into shared memory");
  return mma_emulation::kSharedWindowBase + static_cast<uint32_t>(at - base);
}

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t row) {
  mma_emulation::ldmatrix<4, false>(r, row, mma_emulation::kLdmatrixX4);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t row) {
  mma_emulation::ldmatrix<4, true>(r, row, mma_emulation::kLdmatrixX4Trans);
}
inline void ldmatrix_x2(uint32_t (&r)[2], uint32_t row) {
  mma_emulation::ldmatrix<2, false>(r, row, mma_emulation::kLdmatrixX2);
}
inline void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t row) {
  mma_emulation::ldmatrix<2, true>(r, row, mma_emulation::kLdmatrixX2Trans);
}

inline void cp_async_16(void* dst, const void* src, bool valid) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    ::cuda_emu::fail("cp_async_16: an address is not 16-byte aligned");
  }
  const uintptr_t at = reinterpret_cast<uintptr_t>(dst), base = reinterpret_cast<uintptr_t>(smem_raw);
  if (at < base || at - base > sizeof(smem_raw) - 16) {
    ::cuda_emu::fail("cp_async_16: a destination outside shared memory");
  }
  ::cuda_emu::self().async_open.push_back(::cuda_emu::AsyncCopy{dst, src, valid});
}
/// Closes the group of copies issued since the last commit (an empty group when there are none, as in
/// PTX: pipelines commit one per stage so that their wait counts stay uniform).
inline void cp_async_commit() {
  ::cuda_emu::Fiber& f = ::cuda_emu::self();
  f.async_groups.push_back(std::move(f.async_open));
  f.async_open.clear();
}
template <int kPending>
void cp_async_wait() {
  static_assert(kPending >= 0, "cp.async.wait_group takes a non-negative count");
  ::cuda_emu::Fiber& f = ::cuda_emu::self();
  size_t done = 0;
  for (; f.async_groups.size() - done > static_cast<size_t>(kPending); ++done) {
    for (const ::cuda_emu::AsyncCopy& c : f.async_groups[done]) {
      if (c.valid) {
        std::memcpy(c.dst, c.src, 16);
      } else {
        std::memset(c.dst, 0, 16);  // src-size 0: nothing is read
      }
    }
  }
  f.async_groups.erase(f.async_groups.begin(), f.async_groups.begin() + static_cast<std::ptrdiff_t>(done));
}

}  // namespace detail
}  // namespace cuda
}  // namespace attn_ext
