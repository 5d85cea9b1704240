// The decoder layers in one call; see decoder.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "cpu_parallel.h"
#include "decoder.h"
#include "dtype.h"
#include "layer_ops.h"
#include "linear.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DSPEC_DECODER_X86 1
#define DSPEC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#else
#define DSPEC_DECODER_X86 0
#endif

namespace dspec {
namespace {

// exp(x) for the SiLU: Cephes' single-precision polynomial after a Cody-Waite range
// reduction, every step an IEEE operation (fma where written), so that the scalar and the
// AVX-512 code give the same bits.  x is clamped to [-87, 88] (the result stays normal).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_scalar(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kExpP[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpP[i]);
  const float rr = r * r;
  float y = std::fma(p, rr, r);
  y = y + 1.0f;
  const float scale = dt::f32_from_bits(static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23);
  return y * scale;
}

inline float silu_scalar(float g) { return g / (1.0f + exp_scalar(-g)); }

template <int DT>
void silu_mul_rows(std::int64_t lo, std::int64_t hi, const void* gate, const void* up, void* out) {
  for (std::int64_t i = lo; i < hi; ++i) {
    const float s = dt::round_to<DT>(silu_scalar(dt::load<DT>(gate, i)));
    dt::store<DT>(out, i, s * dt::load<DT>(up, i));
  }
}

#if DSPEC_DECODER_X86
DSPEC_AVX512 inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  const __m512 rr = _mm512_mul_ps(r, r);
  __m512 y = _mm512_fmadd_ps(p, rr, r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// float32 -> bfloat16 bits, round to nearest even (dt::float_to_bf16 for non-NaN values;
// a NaN stays a NaN)
DSPEC_AVX512 inline __m256i to_bf16_avx512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_mask_mov_epi32(rounded, nan, quiet), 16));
}

DSPEC_AVX512 inline __m512 from_bf16_avx512(const std::uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

DSPEC_AVX512 void silu_mul_avx512(int dtype, std::int64_t lo, std::int64_t hi, const void* gate, const void* up,
                                  void* out) {
  for (std::int64_t i = lo; i < hi; i += 16) {
    const __mmask16 m = hi - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (hi - i)) - 1);
    if (dtype == kFloat32) {
      const __m512 g = _mm512_maskz_loadu_ps(m, static_cast<const float*>(gate) + i);
      const __m512 u = _mm512_maskz_loadu_ps(m, static_cast<const float*>(up) + i);
      const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_mask_storeu_ps(static_cast<float*>(out) + i, m, _mm512_mul_ps(s, u));
    } else {
      const __m512 g = from_bf16_avx512(static_cast<const std::uint16_t*>(gate) + i, m);
      const __m512 u = from_bf16_avx512(static_cast<const std::uint16_t*>(up) + i, m);
      const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      const __m512 sr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_avx512(s)), 16));
      _mm256_mask_storeu_epi16(static_cast<std::uint16_t*>(out) + i, m, to_bf16_avx512(_mm512_mul_ps(sr, u)));
    }
  }
}
#endif

// x += y, rounded to the dtype (torch's x + y)
template <int DT>
void add_rows(void* x, const void* y, std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) dt::store<DT>(x, i, dt::load<DT>(x, i) + dt::load<DT>(y, i));
}

void add_in_place(int dtype, void* x, const void* y, std::int64_t count) {
  switch (dtype) {
    case kFloat16: add_rows<kFloat16>(x, y, count); break;
    case kBFloat16: add_rows<kBFloat16>(x, y, count); break;
    default: add_rows<kFloat32>(x, y, count); break;
  }
}

// Projections of one input (1..3 of them), with the adapter's update after each.
void project(const DecoderArgs& a, const DecoderLayerWeights& w, const void* x, std::int64_t k,
             std::initializer_list<int> which, std::initializer_list<void*> outs,
             std::initializer_list<std::int64_t> widths) {
  const std::int64_t rows = a.batch * a.n;
  LinearArgs parts[3];
  int count = 0;
  auto o = outs.begin();
  auto n = widths.begin();
  for (int p : which) {
    LinearArgs& l = parts[count++];
    l.dtype = a.dtype;
    l.m = rows;
    l.k = k;
    l.n = *n;
    l.ldx = k;
    l.ldo = *n;
    l.x = x;
    l.weight = w.packed[p];
    l.bias = w.bias[p];
    l.out = *o;
    l.num_threads = a.num_threads;
    ++o;
    ++n;
  }
  linear_group_cpu(parts, count);
  if (a.num_mask_rows == 0) return;
  int i = 0;
  for (int p : which) {
    const LinearArgs& l = parts[i++];
    if (w.lora_a[p] == nullptr) continue;
    MaskLoraArgs m;
    m.dtype = a.dtype;
    m.num_rows = a.num_mask_rows;
    m.k = k;
    m.n = l.n;
    m.rank = a.lora_rank;
    m.rows = a.mask_rows;
    m.x = x;
    m.a = w.lora_a[p];
    m.b = w.lora_b[p];
    m.scale = w.lora_scale[p];
    m.y = l.out;
    mask_lora_cpu(m);
  }
}

}  // namespace

void silu_mul_cpu(int dtype, std::int64_t rows, std::int64_t width, const void* gate, const void* up, void* out,
                  int num_threads) {
  const std::int64_t total = rows * width;
#if DSPEC_DECODER_X86
  const bool avx512 = dtype != kFloat16 && cpu::has_avx512();
#else
  const bool avx512 = false;
#endif
  cpu::parallel_rows(rows, width * 8, num_threads, [&](std::int64_t r0, std::int64_t r1) {
    const std::int64_t lo = r0 * width, hi = std::min(total, r1 * width);
#if DSPEC_DECODER_X86
    if (avx512) {
      silu_mul_avx512(dtype, lo, hi, gate, up, out);
      return;
    }
#endif
    switch (dtype) {
      case kFloat16: silu_mul_rows<kFloat16>(lo, hi, gate, up, out); break;
      case kBFloat16: silu_mul_rows<kBFloat16>(lo, hi, gate, up, out); break;
      default: silu_mul_rows<kFloat32>(lo, hi, gate, up, out); break;
    }
  });
}

void decoder_layers_cpu(const DecoderArgs& a) {
  const std::int64_t rows = a.batch * a.n;
  if (rows == 0 || a.layers.empty()) return;
  const std::int64_t item = a.dtype == kFloat32 ? 4 : 2;
  const std::int64_t qw = a.hq * a.head_dim, kvw = a.hkv * a.head_dim;
  // scratch, reused across calls on this thread: normed x, q, attention out, a projection
  // out, gate and up
  thread_local std::vector<char> scratch;
  const std::int64_t sizes[6] = {a.hidden, qw, qw, a.hidden, a.intermediate, a.intermediate};
  std::int64_t total = 0;
  for (std::int64_t s : sizes) total += rows * s * item;
  if (static_cast<std::int64_t>(scratch.size()) < total) scratch.resize(static_cast<std::size_t>(total));
  char* bufs[6];
  char* at = scratch.data();
  for (int i = 0; i < 6; ++i) {
    bufs[i] = at;
    at += rows * sizes[i] * item;
  }
  char *h = bufs[0], *q = bufs[1], *o = bufs[2], *t = bufs[3], *gate = bufs[4], *up = bufs[5];
  char* x = static_cast<char*>(a.x);

  CascadeAttentionArgs att = a.attention;
  att.q = q;
  att.out = o;
  const std::int64_t q_strides[3] = {a.n * qw, qw, a.head_dim}, kv_strides[3] = {a.n * kvw, kvw, a.head_dim};
  for (int i = 0; i < 3; ++i) {
    att.q_stride[i] = att.out_stride[i] = q_strides[i];
    att.k_stride[i] = att.v_stride[i] = kv_strides[i];
  }
  att.lse = nullptr;
  att.num_threads = a.num_threads;

  RmsNormArgs norm;
  norm.dtype = a.dtype;
  norm.rows = rows;
  norm.hidden = a.hidden;
  norm.eps = a.eps;
  norm.x = x;
  norm.out = h;
  norm.num_threads = a.num_threads;

  RopeArgs rope;
  rope.dtype = a.dtype;
  rope.rows = rows;
  rope.hq = a.hq;
  rope.hkv = a.hkv;
  rope.head_dim = a.head_dim;
  rope.q = q;
  rope.cos = a.cos;
  rope.sin = a.sin;
  rope.num_threads = a.num_threads;

  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    const DecoderLayerWeights& w = a.layers[l];
    char* k = static_cast<char*>(a.k_out) + static_cast<std::int64_t>(l) * rows * kvw * item;
    char* v = static_cast<char*>(a.v_out) + static_cast<std::int64_t>(l) * rows * kvw * item;

    norm.weight = w.input_norm;
    rms_norm_cpu(norm);
    project(a, w, h, a.hidden, {kProjQ, kProjK, kProjV}, {q, k, v}, {qw, kvw, kvw});
    rope.k = k;
    rope_cpu(rope);
    att.k = k;
    att.v = v;
    if (a.prefix_k != nullptr) {
      att.prefix_k = static_cast<const char*>(a.prefix_k) + static_cast<std::int64_t>(l) * a.prefix_layer_stride * item;
      att.prefix_v = static_cast<const char*>(a.prefix_v) + static_cast<std::int64_t>(l) * a.prefix_layer_stride * item;
    }
    cascade_attention_cpu(att);
    project(a, w, o, qw, {kProjO}, {t}, {a.hidden});
    add_in_place(a.dtype, x, t, rows * a.hidden);

    norm.weight = w.post_norm;
    rms_norm_cpu(norm);
    project(a, w, h, a.hidden, {kProjGate, kProjUp}, {gate, up}, {a.intermediate, a.intermediate});
    silu_mul_cpu(a.dtype, rows, a.intermediate, gate, up, gate, a.num_threads);
    project(a, w, gate, a.intermediate, {kProjDown}, {t}, {a.hidden});
    add_in_place(a.dtype, x, t, rows * a.hidden);

    const int slot = l < a.record.size() ? a.record[l] : -1;
    if (slot >= 0) {
      std::memcpy(static_cast<char*>(a.hidden_out) + slot * rows * a.hidden * item, x,
                  static_cast<std::size_t>(rows * a.hidden * item));
    }
  }
}

}  // namespace dspec
