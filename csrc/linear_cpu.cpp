// Small-row linear layer on the CPU; see linear.h.
//
// Work unit: kColBlock (4) weight rows x kRowBlock (6) rows of x, 24 float32 accumulators
// of 16 lanes held in registers while k advances 32 (bf16) or 16 (fp32) elements at a time;
// each accumulator is summed across its lanes once at the end.  Threads split the output
// columns (disjoint weight rows, so the weight is read once in all).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "cpu_parallel.h"
#include "dtype.h"
#include "linear.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DSPEC_LINEAR_X86 1
#define DSPEC_AVX512F __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define DSPEC_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,fma,avx512bf16")))
#else
#define DSPEC_LINEAR_X86 0
#endif

namespace dspec {
namespace {

constexpr int kRowBlock = 6;
constexpr int kColBlock = 4;
constexpr int kPrefetchBlocks = 2;   // prefetch distance in column blocks (~2 x 4 weight rows)
// below this many weight elements per thread a call stays on one thread
constexpr std::int64_t kElementsPerThread = std::int64_t(1) << 17;

// res[i * NR + j] = dot(x row i, weight row j), float32
// pf: the weight rows this thread reads a few blocks later (null: none), prefetched while
// this block is computed: a block's rows are only 1-3 KB apart, too short a stream for the
// hardware prefetcher to ramp up on, and at a few rows the layer waits on memory.
using Micro = void (*)(const void* x, std::int64_t ldx, const void* w, std::int64_t ldw, std::int64_t k,
                       float* res, const void* pf);

// ---------------------------------------------------------------------- portable code

template <int DT, int MR, int NR>
void micro_generic(const void* xv, std::int64_t ldx, const void* wv, std::int64_t ldw, std::int64_t k,
                   float* res, const void*) {
  using E = dt::elem_t<DT>;
  const E* x = static_cast<const E*>(xv);
  const E* w = static_cast<const E*>(wv);
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      const E* xr = x + i * ldx;
      const E* wr = w + j * ldw;
      float lanes[16] = {0};
      std::int64_t kk = 0;
      for (; kk + 16 <= k; kk += 16) {
        for (int l = 0; l < 16; ++l) lanes[l] += dt::to_float<DT>(xr[kk + l]) * dt::to_float<DT>(wr[kk + l]);
      }
      for (int l = 0; kk + l < k; ++l) lanes[l] += dt::to_float<DT>(xr[kk + l]) * dt::to_float<DT>(wr[kk + l]);
      float s = 0.0f;
      for (int l = 0; l < 16; ++l) s += lanes[l];
      res[i * NR + j] = s;
    }
  }
}

// ---------------------------------------------------------------------- AVX-512 code

#if DSPEC_LINEAR_X86
// One step of k for the two element types: Step elements per 64-byte load, a full and a
// masked (tail) load, and acc += x * w over the step in 16 float32 lanes.
struct Bf16Step {
  using E = std::uint16_t;
  using V = __m512i;
  static constexpr int kStep = 32;
  DSPEC_AVX512BF16 static inline V load(const E* p) { return _mm512_loadu_si512(p); }
  DSPEC_AVX512BF16 static inline V load_tail(const E* p, std::int64_t n) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((std::uint64_t(1) << n) - 1), p);
  }
  DSPEC_AVX512BF16 static inline __m512 dot(__m512 acc, V x, V w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
};

struct F32Step {
  using E = float;
  using V = __m512;
  static constexpr int kStep = 16;
  DSPEC_AVX512F static inline V load(const E* p) { return _mm512_loadu_ps(p); }
  DSPEC_AVX512F static inline V load_tail(const E* p, std::int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  DSPEC_AVX512F static inline __m512 dot(__m512 acc, V x, V w) { return _mm512_fmadd_ps(x, w, acc); }
};

template <class S, int MR, int NR>
DSPEC_AVX512BF16 inline __attribute__((always_inline)) void micro_step(
    __m512 (&acc)[MR][NR], const typename S::E* x, std::int64_t ldx, const typename S::E* w, std::int64_t ldw,
    std::int64_t kk, std::int64_t tail) {
  typename S::V wr[NR];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) wr[j] = tail ? S::load_tail(w + j * ldw + kk, tail) : S::load(w + j * ldw + kk);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const typename S::V xr = tail ? S::load_tail(x + i * ldx + kk, tail) : S::load(x + i * ldx + kk);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = S::dot(acc[i][j], xr, wr[j]);
  }
}

// The AVX-512 tile.  Both instantiations carry the bf16 target attribute (a superset of the
// fp32 tile's); only the bf16 tile contains an AVX512_BF16 instruction (checked with
// objdump: the fp32 tiles run on AVX-512 CPUs without it), and linear_has_avx512 gates it.
template <class S, int MR, int NR>
DSPEC_AVX512BF16 void micro_avx512(const void* xv, std::int64_t ldx, const void* wv, std::int64_t ldw,
                                   std::int64_t k, float* res, const void* pfv) {
  using E = typename S::E;
  const E* x = static_cast<const E*>(xv);
  const E* w = static_cast<const E*>(wv);
  const E* pf = static_cast<const E*>(pfv);
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  std::int64_t kk = 0;
  for (; kk + S::kStep <= k; kk += S::kStep) {
    if (pf != nullptr) {
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * ldw + kk), _MM_HINT_T0);
    }
    micro_step<S, MR, NR>(acc, x, ldx, w, ldw, kk, 0);
  }
  if (kk < k) micro_step<S, MR, NR>(acc, x, ldx, w, ldw, kk, k - kk);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) res[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif

// ---------------------------------------------------------------------- dispatch tables

template <template <int, int> class Pick, int MR, int... NRs>
void fill_row(Micro (&row)[kColBlock], std::integer_sequence<int, NRs...>) {
  ((row[NRs] = Pick<MR, NRs + 1>::fn), ...);
}

template <template <int, int> class Pick, int... MRs>
void fill(Micro (&table)[kRowBlock][kColBlock], std::integer_sequence<int, MRs...>) {
  (fill_row<Pick, MRs + 1>(table[MRs], std::make_integer_sequence<int, kColBlock>{}), ...);
}

template <int DT>
struct PickGeneric {
  template <int MR, int NR>
  struct At {
    static constexpr Micro fn = &micro_generic<DT, MR, NR>;
  };
};

struct Table {
  Micro fn[kRowBlock][kColBlock];
};

template <class Picker>
Table make_table() {
  Table t{};
  fill<Picker::template At>(t.fn, std::make_integer_sequence<int, kRowBlock>{});
  return t;
}

#if DSPEC_LINEAR_X86
template <class S>
struct PickAvx512 {
  template <int MR, int NR>
  struct At {
    static constexpr Micro fn = &micro_avx512<S, MR, NR>;
  };
};
#endif

const Table& table_for(int dtype, bool avx512) {
  static const Table generic_f32 = make_table<PickGeneric<kFloat32>>();
  static const Table generic_f16 = make_table<PickGeneric<kFloat16>>();
  static const Table generic_bf16 = make_table<PickGeneric<kBFloat16>>();
#if DSPEC_LINEAR_X86
  static const Table avx_f32 = make_table<PickAvx512<F32Step>>();
  static const Table avx_bf16 = make_table<PickAvx512<Bf16Step>>();
  if (avx512 && dtype == kFloat32) return avx_f32;
  if (avx512 && dtype == kBFloat16) return avx_bf16;
#endif
  (void)avx512;
  return dtype == kFloat32 ? generic_f32 : (dtype == kFloat16 ? generic_f16 : generic_bf16);
}

template <int DT>
void columns(const LinearArgs& a, const Table& table, std::int64_t c0, std::int64_t c1) {
  const std::int64_t item = DT == kFloat32 ? 4 : 2;
  const char* x = static_cast<const char*>(a.x);
  const char* w = static_cast<const char*>(a.weight);
  float res[kRowBlock * kColBlock];
  for (std::int64_t j0 = c0; j0 < c1; j0 += kColBlock) {
    const int nr = static_cast<int>(std::min<std::int64_t>(kColBlock, c1 - j0));
    const std::int64_t pf_rows = j0 + (kPrefetchBlocks + 1) * kColBlock;   // rows the prefetch touches
    float bias[kColBlock] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (a.bias != nullptr) {
      for (int j = 0; j < nr; ++j) bias[j] = dt::load<DT>(a.bias, j0 + j);
    }
    for (std::int64_t i0 = 0; i0 < a.m; i0 += kRowBlock) {
      const int mr = static_cast<int>(std::min<std::int64_t>(kRowBlock, a.m - i0));
      table.fn[mr - 1][nr - 1](x + i0 * a.ldx * item, a.ldx, w + j0 * a.ldw * item, a.ldw, a.k, res,
                               i0 == 0 && pf_rows <= c1 ? w + (j0 + kPrefetchBlocks * kColBlock) * a.ldw * item
                                                        : nullptr);
      for (int i = 0; i < mr; ++i) {
        for (int j = 0; j < nr; ++j) dt::store<DT>(a.out, (i0 + i) * a.ldo + j0 + j, res[i * nr + j] + bias[j]);
      }
    }
  }
}

template <int DT>
void mask_lora_rows(const MaskLoraArgs& a) {
  using E = dt::elem_t<DT>;
  const E* x = static_cast<const E*>(a.x);
  E* y = static_cast<E*>(a.y);
  std::vector<float> xf(static_cast<std::size_t>(a.k)), h(static_cast<std::size_t>(a.rank));
  for (std::int64_t i = 0; i < a.num_rows; ++i) {
    const std::int64_t row = a.rows[i];
    for (std::int64_t c = 0; c < a.k; ++c) xf[c] = dt::to_float<DT>(x[row * a.k + c]);
    for (std::int64_t r = 0; r < a.rank; ++r) {
      const float* ar = a.a + r * a.k;
      float s = 0.0f;
      for (std::int64_t c = 0; c < a.k; ++c) s += ar[c] * xf[c];
      h[r] = s;
    }
    for (std::int64_t o = 0; o < a.n; ++o) {
      const float* br = a.b + o * a.rank;
      float s = 0.0f;
      for (std::int64_t r = 0; r < a.rank; ++r) s += br[r] * h[r];
      // delta.to(dtype), then the dtype's add
      dt::store<DT>(y, row * a.n + o, dt::to_float<DT>(y[row * a.n + o]) + dt::round_to<DT>(s * a.scale));
    }
  }
}

}  // namespace

void mask_lora_cpu(const MaskLoraArgs& a) {
  switch (a.dtype) {
    case kFloat16: mask_lora_rows<kFloat16>(a); break;
    case kBFloat16: mask_lora_rows<kBFloat16>(a); break;
    default: mask_lora_rows<kFloat32>(a); break;
  }
}

bool linear_has_avx512(int dtype) {
#if DSPEC_LINEAR_X86
  if (dtype == kFloat32) return cpu::has_avx512();
  if (dtype == kBFloat16) return cpu::has_avx512_bf16();
#endif
  (void)dtype;
  return false;
}

void linear_group_cpu(const LinearArgs* parts, int count) {
  const LinearArgs& a = parts[0];
  if (a.m == 0) return;
  const bool avx512 = a.isa == kLinearGeneric ? false : linear_has_avx512(a.dtype);
  const Table& table = table_for(a.dtype, avx512);
  // the parts' column blocks back to back: first[p] is part p's first global block
  std::vector<std::int64_t> first(static_cast<std::size_t>(count) + 1, 0);
  std::int64_t weight_elements = 0;
  for (int p = 0; p < count; ++p) {
    first[p + 1] = first[p] + (parts[p].n + kColBlock - 1) / kColBlock;
    weight_elements += parts[p].n * std::max<std::int64_t>(parts[p].k, 1);
  }
  const std::int64_t blocks = first[count];
  if (blocks == 0) return;
  const std::int64_t by_work = weight_elements / kElementsPerThread + 1;
  const std::int64_t cap = std::min<std::int64_t>(a.num_threads, static_cast<std::int64_t>(cpu::max_threads()));
  const int threads = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>({by_work, blocks, cap})));
  // a few chunks per thread, so that a thread that starts late (its core busy) leaves
  // its share to the others
  const int chunks = static_cast<int>(std::min<std::int64_t>(blocks, threads == 1 ? 1 : 4 * threads));
  auto body = [&](int c) {
    const std::int64_t g0 = blocks * c / chunks, g1 = blocks * (c + 1) / chunks;
    for (int p = 0; p < count; ++p) {
      const std::int64_t lo = std::max(g0, first[p]), hi = std::min(g1, first[p + 1]);
      if (lo >= hi) continue;
      const LinearArgs& part = parts[p];
      const std::int64_t c0 = (lo - first[p]) * kColBlock, c1 = std::min(part.n, (hi - first[p]) * kColBlock);
      switch (part.dtype) {
        case kFloat16: columns<kFloat16>(part, table, c0, c1); break;
        case kBFloat16: columns<kBFloat16>(part, table, c0, c1); break;
        default: columns<kFloat32>(part, table, c0, c1); break;
      }
    }
  };
  cpu::parallel_chunks(chunks, threads, body);
}

void linear_cpu(const LinearArgs& a) { linear_group_cpu(&a, 1); }

}  // namespace dspec
