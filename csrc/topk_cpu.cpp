// topk_tokens / mass_candidates on the CPU: one pass over each row keeps the k largest
// logits (a sorted buffer behind a threshold: a block of columns whose vector max does not
// beat the k-th value is skipped), and the row's max and NaN / +inf flags; a second
// pass over the same row (now in L2) sums exp((x - max) / T) with the vectorised exp.  Rows
// are independent and spread over threads.  Semantics of dspec/reference/topk.py: ranking
// by logit, ties to the lower id; invalid rows (a NaN, a +inf, only -inf) give -1 / NaN
// (topk) or count 0 / -1 / -inf (mass).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_avx512.h"
#include "cpu_features.h"
#include "cpu_math.h"
#include "cpu_parallel.h"
#include "dtype.h"
#include "topk.h"

namespace dspec {
namespace {

constexpr int kChunk = 16;
// Columns per pass-1 block.  Blocks of 512 rescanned ~5x the columns on random logits
// (topk k = 8 at B 64 x 17 x 49152 fp32, AMX Xeon, 2 threads: 76 -> 67 ms at 64; 32 the same).
constexpr std::int64_t kBlock = 64;
constexpr std::int64_t kLargeK = 64;  // above: partial sort instead of the insertion buffer
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct RowScan {
  float max = kNegInf;
  bool nan = false;
};

// Keeps the best `k` (value, id) pairs, best first; equal values keep the lower id first
// because columns arrive in increasing id order and only a strictly larger value displaces.
struct Best {
  std::vector<float> v;
  std::vector<std::int64_t> id;
  std::int64_t k = 0, size = 0;

  void reset(std::int64_t kk) {
    k = kk;
    size = 0;
    v.resize(static_cast<std::size_t>(kk));
    id.resize(static_cast<std::size_t>(kk));
  }
  bool full() const { return size == k; }
  void put(float x, std::int64_t i) {
    if (full() && !(x > v[k - 1])) return;
    std::int64_t pos = full() ? k - 1 : size;
    // shift down everything strictly smaller (ties stay ahead: lower ids first)
    while (pos > 0 && v[pos - 1] < x) {
      v[pos] = v[pos - 1];
      id[pos] = id[pos - 1];
      --pos;
    }
    v[pos] = x;
    id[pos] = i;
    if (!full()) ++size;
  }
};

// The insertions of columns [c0, c1) into `best` (NaNs skipped); `full` and `thr` (the k-th
// value once full) follow the buffer.
template <int DT>
DSPEC_CPU_INLINE void insert_block(const dt::elem_t<DT>* p, std::int64_t c0, std::int64_t c1, Best& best, bool& full,
                                   float& thr) {
  for (std::int64_t i = c0; i < c1; ++i) {
    const float x = dt::to_float<DT>(p[i]);
    if (x == x && (!full || x > thr)) {
      best.put(x, i);
      full = best.full();
      if (full) thr = best.v[best.k - 1];
    }
  }
}

// pass 1: best k, max over non-NaN values, NaN flag.  Blocks of kBlock columns: a
// branch-free vector pass gives the block's max (NaN as -inf) and NaN flag; only a block
// whose max beats the current k-th value is scanned again for insertions (after the first
// few blocks, almost none on real logits).
template <int DT>
DSPEC_CPU_INLINE RowScan select_row(const dt::elem_t<DT>* p, std::int64_t vocab, Best& best) {
  RowScan s;
  float mx[kChunk];
  std::int32_t nan_lane[kChunk];
  for (int l = 0; l < kChunk; ++l) {
    mx[l] = kNegInf;
    nan_lane[l] = 0;
  }
  float thr = kNegInf;  // the k-th best so far (-inf until the buffer is full)
  bool full = false;
  for (std::int64_t c0 = 0; c0 < vocab; c0 += kBlock) {
    const std::int64_t c1 = std::min(vocab, c0 + kBlock);
    float bm[kChunk];
    for (int l = 0; l < kChunk; ++l) bm[l] = kNegInf;
    std::int64_t c = c0;
    for (; c + kChunk <= c1; c += kChunk) {
      for (int l = 0; l < kChunk; ++l) {
        const float x = dt::to_float<DT>(p[c + l]);
        const bool nan = x != x;
        nan_lane[l] |= static_cast<std::int32_t>(nan);
        const float xc = nan ? kNegInf : x;
        bm[l] = xc > bm[l] ? xc : bm[l];
      }
    }
    float block_max = kNegInf;
    for (int l = 0; l < kChunk; ++l) {
      mx[l] = bm[l] > mx[l] ? bm[l] : mx[l];
      block_max = bm[l] > block_max ? bm[l] : block_max;
    }
    for (; c < c1; ++c) {  // the tail of the last block
      const float x = dt::to_float<DT>(p[c]);
      if (x != x) {
        nan_lane[0] = 1;
        continue;
      }
      block_max = x > block_max ? x : block_max;
      mx[0] = x > mx[0] ? x : mx[0];
    }
    if (full && !(block_max > thr)) continue;
    insert_block<DT>(p, c0, c1, best, full, thr);
  }
  std::int32_t any_nan = 0;
  for (int l = 0; l < kChunk; ++l) {
    s.max = mx[l] > s.max ? mx[l] : s.max;
    any_nan |= nan_lane[l];
  }
  s.nan = any_nan != 0;
  return s;
}

#if DSPEC_AVX512_CODE
// select_row and sum_exp_row written for AVX-512 (the compiled loops above reduced each
// block's 16 lane maxima in scalar code and read ~3-4 GB/s): a block's max stays a vector
// (of sortable keys), compared with the k-th value in one mask test; a block that beats it
// offers select_row's insertion only the columns whose keys beat the k-th value (the first
// block, while the buffer fills, all of them), so the chosen (value, id) pairs are the same.
// Measured (keys and the masked insertion against the float compares; B 64 x 17 x 49152, 2 threads, Xeon, from
// memory): k = 8 bf16 13.5 -> 10.8 ms, fp32 15.5 -> 12.4 ms.  Pass 1 prefetches
// cpu::kStreamAhead bytes ahead; pass 2 (exp-bound, re-reading the row from L2) brings the
// thread's next row into L2.
template <int DT>
DSPEC_AVX512 RowScan select_row_avx512(const dt::elem_t<DT>* p, std::int64_t vocab, Best& best) {
  // on the elements' sortable keys (cpu::Keys): a block's max and the NaN check are integer
  // max / min on 512 / w lanes (two vectors per 64-column block for bf16 / fp16), where the
  // float code took a masked compare, a mask or and a masked max per 16 columns
  using K = cpu::Keys<DT>;
  constexpr int kPer = K::kPer;
  static_assert(kBlock % kPer == 0, "a block is whole vectors");
  const __m512i neg_inf = K::set1(K::kNegInfKey);
  __m512i mx = neg_inf, lo = K::set1(K::kPosInf), thr_key = neg_inf;
  float thr = kNegInf;
  bool full = false;
  for (std::int64_t c0 = 0; c0 < vocab; c0 += kBlock) {
    const std::int64_t c1 = std::min(vocab, c0 + kBlock);
    __m512i bm = neg_inf;
    if (c1 - c0 == kBlock) {
      for (int v = 0; v < kBlock / kPer; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(p + c0 + v * kPer) + cpu::kStreamAhead, _MM_HINT_T0);
        const __m512i k = K::key(_mm512_loadu_si512(p + c0 + v * kPer));
        bm = K::max(bm, k);
        lo = K::min(lo, k);
      }
    } else {
      for (std::int64_t c = c0; c < c1; c += kPer) {
        const std::uint64_t in = K::first(c1 - c);
        const __m512i k = K::key(K::load(p + c, in));
        bm = K::mask_max(bm, in, bm, k);
        lo = K::mask_min(lo, in, lo, k);
      }
    }
    mx = K::max(mx, bm);
    // a key above the k-th value's key: a value above it, or a NaN (skipped by the insertion
    // scan), or +0 over a k-th value of -0 (no insertion): the scan decides exactly
    if (full && K::gt(bm, thr_key) == 0) continue;
    if (!full || c1 - c0 != kBlock) {
      insert_block<DT>(p, c0, c1, best, full, thr);
    } else {  // only the columns whose keys beat the k-th value's, in column order
      for (int v = 0; v < kBlock / kPer; ++v) {
        const std::int64_t c = c0 + v * kPer;
        for (std::uint64_t hit = K::gt(K::key(_mm512_loadu_si512(p + c)), thr_key); hit != 0; hit &= hit - 1) {
          const std::int64_t i = c + __builtin_ctzll(hit);
          const float x = dt::to_float<DT>(p[i]);
          if (x == x && x > thr) {  // thr may have risen since the mask
            best.put(x, i);
            thr = best.v[best.k - 1];
          }
        }
      }
    }
    if (full) thr_key = K::set1(cpu::value_key<DT>(thr));
  }
  using Lane = std::conditional_t<DT == kFloat32, std::int32_t, std::int16_t>;
  alignas(64) Lane lmx[kPer], llo[kPer];
  _mm512_store_si512(lmx, mx);
  _mm512_store_si512(llo, lo);
  std::int64_t top = K::kNegInfKey, least = K::kPosInf;
  for (int l = 0; l < kPer; ++l) {
    top = std::max<std::int64_t>(top, lmx[l]);
    least = std::min<std::int64_t>(least, llo[l]);
  }
  RowScan s;
  s.nan = top > K::kPosInf || least < K::kNegInfKey;
  s.max = s.nan ? kNegInf : cpu::key_value<DT>(top);  // a row with a NaN is invalid anyway
  return s;
}

// sum_exp_row: exp((x - m) inv_t) as 2^((x - m) inv_t log2 e), float lane sums folded into
// a double every 256 vectors
template <int DT>
DSPEC_AVX512 double sum_exp_row_avx512(const dt::elem_t<DT>* p, std::int64_t vocab, float m, float inv_t,
                                       const dt::elem_t<DT>* next) {
  const __m512 vm = _mm512_set1_ps(m), scale = _mm512_set1_ps(inv_t * 1.44269504088896341f);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  double total = 0.0;
  alignas(64) float lane[kChunk];
  for (std::int64_t c = 0; c < vocab;) {
    __m512 acc = _mm512_setzero_ps();
    const std::int64_t stop = std::min(vocab, c + std::int64_t(256) * kChunk);
    const std::int64_t body = c + (stop - c) / kChunk * kChunk;  // whole vectors, unmasked
    for (; c < body; c += kChunk) {
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + c), _MM_HINT_T1);
      const __m512 x = cpu::load_f32<DT>(p + c, 0xFFFF);
      acc = _mm512_add_ps(acc, cpu::exp2_nonpos16(_mm512_mul_ps(_mm512_sub_ps(x, vm), scale)));
    }
    if (c < stop) {  // the row's tail
      const __mmask16 in = cpu::lanes(stop - c);
      const __m512 x = _mm512_mask_mov_ps(neg_inf, in, cpu::load_f32<DT>(p + c, in));
      acc = _mm512_add_ps(acc, cpu::exp2_nonpos16(_mm512_mul_ps(_mm512_sub_ps(x, vm), scale)));
      c = stop;
    }
    _mm512_store_ps(lane, acc);
    for (int l = 0; l < kChunk; ++l) total += lane[l];
  }
  return total;
}
#endif

// pass 1 for large k (a sorted insertion buffer would cost O(k) per insert): every
// non-NaN (value, id) into `all`, then a partial sort of the first k by (value desc, id asc)
template <int DT>
DSPEC_CPU_INLINE RowScan select_row_large(const dt::elem_t<DT>* p, std::int64_t vocab, std::int64_t k, Best& best,
                                          std::vector<std::pair<float, std::int64_t>>& all) {
  RowScan s;
  all.clear();
  for (std::int64_t c = 0; c < vocab; ++c) {
    const float x = dt::to_float<DT>(p[c]);
    if (x != x) {
      s.nan = true;
      continue;
    }
    s.max = x > s.max ? x : s.max;
    all.emplace_back(x, c);
  }
  if (s.nan || static_cast<std::int64_t>(all.size()) < k) return s;
  auto better = [](const std::pair<float, std::int64_t>& a, const std::pair<float, std::int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::partial_sort(all.begin(), all.begin() + k, all.end(), better);
  for (std::int64_t j = 0; j < k; ++j) {
    best.v[j] = all[j].first;
    best.id[j] = all[j].second;
  }
  best.size = k;
  return s;
}

// pass 2: sum of exp((x - max) * inv_t) over the row (NaN-free: valid rows only)
template <int DT>
DSPEC_CPU_INLINE double sum_exp_row(const dt::elem_t<DT>* p, std::int64_t vocab, float m, float inv_t) {
  float acc[kChunk];
  for (int l = 0; l < kChunk; ++l) acc[l] = 0.0f;
  double total = 0.0;
  std::int64_t c = 0;
  int rounds = 0;
  for (; c + kChunk <= vocab; c += kChunk) {
    for (int l = 0; l < kChunk; ++l) acc[l] += cpu::exp_nonpos((dt::to_float<DT>(p[c + l]) - m) * inv_t);
    if (++rounds == 256) {  // keep float partial sums short
      for (int l = 0; l < kChunk; ++l) {
        total += acc[l];
        acc[l] = 0.0f;
      }
      rounds = 0;
    }
  }
  for (; c < vocab; ++c) total += cpu::exp_nonpos((dt::to_float<DT>(p[c]) - m) * inv_t);
  for (int l = 0; l < kChunk; ++l) total += acc[l];
  return total;
}

// pass 1 and pass 2 on the vector code the CPU runs
template <int DT>
RowScan select_best(const dt::elem_t<DT>* p, std::int64_t vocab, Best& best) {
#if DSPEC_AVX512_CODE
  if (cpu::has_avx512()) return select_row_avx512<DT>(p, vocab, best);
#endif
  return select_row<DT>(p, vocab, best);
}

template <int DT>
double sum_exp(const dt::elem_t<DT>* p, std::int64_t vocab, float m, float inv_t, const dt::elem_t<DT>* next) {
#if DSPEC_AVX512_CODE
  if (cpu::has_avx512()) return sum_exp_row_avx512<DT>(p, vocab, m, inv_t, next);
#endif
  return sum_exp_row<DT>(p, vocab, m, inv_t);
}

template <int DT>
DSPEC_CPU_INLINE void rows_impl(const TopkArgs& a, std::int64_t lo, std::int64_t hi) {
  using E = dt::elem_t<DT>;
  const E* base = static_cast<const E*>(a.logits);
  const std::int64_t k = a.k;
  const bool mass = a.mass;
  Best best;
  std::vector<std::pair<float, std::int64_t>> all;
  for (std::int64_t r = lo; r < hi; ++r) {
    const E* p = base + r * a.row_stride;
    best.reset(k);
    const RowScan s = k > kLargeK ? select_row_large<DT>(p, a.vocab, k, best, all) : select_best<DT>(p, a.vocab, best);
    std::int64_t* tok = a.tokens + r * k;
    float* val = a.values + r * k;
    const bool valid = !s.nan && std::isfinite(s.max);
    if (!valid) {
      for (std::int64_t j = 0; j < k; ++j) {
        tok[j] = -1;
        val[j] = mass ? kNegInf : std::numeric_limits<float>::quiet_NaN();
      }
      if (mass) a.count[r] = 0;
      continue;
    }
    // the buffer holds at least k values (k <= V and every value of a valid row is a
    // number; -inf ones included)
    const E* next = r + 1 < hi ? base + (r + 1) * a.row_stride : nullptr;
    const double total = sum_exp<DT>(p, a.vocab, s.max, a.inv_t, next);
    const float sum = static_cast<float>(total);
    if (!mass) {
      for (std::int64_t j = 0; j < k; ++j) {
        tok[j] = best.id[j];
        val[j] = std::exp((best.v[j] - s.max) * a.inv_t) / sum;
      }
      continue;
    }
    const float log_sum = std::log(sum);
    float running = 0.0f;
    std::int64_t first = k, nonzero = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      const float prob = std::exp((best.v[j] - s.max) * a.inv_t) / sum;
      nonzero += prob > 0.0f;
      running += prob;
      if (first == k && running >= a.tau) first = j + 1;
    }
    const std::int64_t count = std::min(first, nonzero);
    a.count[r] = count;
    for (std::int64_t j = 0; j < k; ++j) {
      const bool keep = j < count;
      tok[j] = keep ? best.id[j] : -1;
      val[j] = keep ? (best.v[j] - s.max) * a.inv_t - log_sum : kNegInf;
    }
  }
}

DSPEC_CPU_MULTI(void, rows_f32, (const TopkArgs& a, std::int64_t lo, std::int64_t hi), (a, lo, hi)) {
  rows_impl<kFloat32>(a, lo, hi);
}
DSPEC_CPU_MULTI(void, rows_f16, (const TopkArgs& a, std::int64_t lo, std::int64_t hi), (a, lo, hi)) {
  rows_impl<kFloat16>(a, lo, hi);
}
DSPEC_CPU_MULTI(void, rows_bf16, (const TopkArgs& a, std::int64_t lo, std::int64_t hi), (a, lo, hi)) {
  rows_impl<kBFloat16>(a, lo, hi);
}

}  // namespace

void topk_cpu(const TopkArgs& args) {
  auto body = [&](std::int64_t lo, std::int64_t hi) {
    switch (args.dtype) {
      case kFloat16: rows_f16(args, lo, hi); break;
      case kBFloat16: rows_bf16(args, lo, hi); break;
      default: rows_f32(args, lo, hi); break;
    }
  };
  cpu::parallel_rows(args.rows, args.vocab, args.num_threads, body);
}

}  // namespace dspec
