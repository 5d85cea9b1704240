// The decoder layers in one call; see decoder.h.
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "cpu_parallel.h"
#include "decoder.h"
#include "dtype.h"
#include "layer_ops.h"
#include "linear.h"
#include "mask_lora.h"

namespace dspec {
namespace {

// silu(g) = g / (1 + exp(-g)), written with exp of a non-positive argument only (e =
// exp(-|g|): g / (1 + e) for g >= 0, g e / (1 + e) below), branch-free so it vectorises.
DSPEC_CPU_INLINE float silu(float g) {
  const float e = cpu::exp_nonpos(g >= 0.0f ? -g : g);
  return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

template <int DT>
DSPEC_CPU_INLINE void silu_mul_range(std::int64_t lo, std::int64_t hi, const void* gate, const void* up, void* out) {
  for (std::int64_t i = lo; i < hi; ++i) {
    const float s = dt::round_to<DT>(silu(dt::load<DT>(gate, i)));  // F.silu rounds to the dtype
    dt::store<DT>(out, i, s * dt::load<DT>(up, i));
  }
}

// One entry point per dtype (DSPEC_CPU_MULTI: AVX-512, AVX2 + FMA and baseline copies).

DSPEC_CPU_MULTI(void, silu_mul_f32, (std::int64_t lo, std::int64_t hi, const void* g, const void* u, void* o),
                (lo, hi, g, u, o)) {
  silu_mul_range<kFloat32>(lo, hi, g, u, o);
}
DSPEC_CPU_MULTI(void, silu_mul_f16, (std::int64_t lo, std::int64_t hi, const void* g, const void* u, void* o),
                (lo, hi, g, u, o)) {
  silu_mul_range<kFloat16>(lo, hi, g, u, o);
}
DSPEC_CPU_MULTI(void, silu_mul_bf16, (std::int64_t lo, std::int64_t hi, const void* g, const void* u, void* o),
                (lo, hi, g, u, o)) {
  silu_mul_range<kBFloat16>(lo, hi, g, u, o);
}

// x += y, rounded to the dtype (torch's x + y)
template <int DT>
DSPEC_CPU_INLINE void add_rows(void* x, const void* y, std::int64_t count) {
  for (std::int64_t i = 0; i < count; ++i) dt::store<DT>(x, i, dt::load<DT>(x, i) + dt::load<DT>(y, i));
}

DSPEC_CPU_MULTI(void, add_f32, (void* x, const void* y, std::int64_t count), (x, y, count)) {
  add_rows<kFloat32>(x, y, count);
}
DSPEC_CPU_MULTI(void, add_f16, (void* x, const void* y, std::int64_t count), (x, y, count)) {
  add_rows<kFloat16>(x, y, count);
}
DSPEC_CPU_MULTI(void, add_bf16, (void* x, const void* y, std::int64_t count), (x, y, count)) {
  add_rows<kBFloat16>(x, y, count);
}

// x[rows, width] += y, over the pool's threads by rows
void add_in_place(int dtype, void* x, const void* y, std::int64_t rows, std::int64_t width, int num_threads) {
  const std::int64_t item = dtype == kFloat32 ? 4 : 2;
  cpu::parallel_rows(
      rows, width, num_threads,
      [&](std::int64_t lo, std::int64_t hi) {
        void* xs = static_cast<char*>(x) + lo * width * item;
        const void* ys = static_cast<const char*>(y) + lo * width * item;
        const std::int64_t count = (hi - lo) * width;
        switch (dtype) {
          case kFloat16: add_f16(xs, ys, count); break;
          case kBFloat16: add_bf16(xs, ys, count); break;
          default: add_f32(xs, ys, count); break;
        }
      },
      kLayerOpElementsPerThread);
}

constexpr std::int64_t kLoraSplitMaxRows = 64;

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
  MaskLoraArgs updates[3];
  int num_updates = 0;
  int i = 0;
  for (int p : which) {
    const LinearArgs& l = parts[i++];
    if (w.lora_a[p] == nullptr) continue;
    MaskLoraArgs& m = updates[num_updates++];
    m.dtype = a.dtype;
    m.num_rows = a.num_mask_rows;
    m.k = k;
    m.n = l.n;
    m.rank = a.lora_rank;
    m.rows = a.mask_rows;
    m.x = x;
    m.weight_dtype = a.lora_dtype;
    m.a = w.lora_a[p];
    m.bt = w.lora_b[p];
    m.packed = w.lora_packed[p];
    m.scale = w.lora_scale[p];
    m.y = l.out;
    m.num_threads = a.num_threads;
  }
  // a few [MASK] rows keep one thread per update (each streams its adapter from memory): two
  // or three updates of one input go to two threads, the first alone, the rest on the other
  if (num_updates >= 2 && a.num_threads >= 2 && a.num_mask_rows <= kLoraSplitMaxRows) {
    cpu::parallel_for(2, [&](int t) {
      for (int u = t == 0 ? 0 : 1; u < (t == 0 ? 1 : num_updates); ++u) {
        MaskLoraArgs m = updates[u];
        m.num_threads = 1;
        mask_lora_cpu(m);
      }
    });
    return;
  }
  for (int u = 0; u < num_updates; ++u) mask_lora_cpu(updates[u]);
}

}  // namespace

void silu_mul_cpu(int dtype, std::int64_t rows, std::int64_t width, const void* gate, const void* up, void* out,
                  int num_threads) {
  cpu::parallel_rows(rows, width * 8, num_threads, [&](std::int64_t r0, std::int64_t r1) {
    const std::int64_t lo = r0 * width, hi = r1 * width;
    switch (dtype) {
      case kFloat16: silu_mul_f16(lo, hi, gate, up, out); break;
      case kBFloat16: silu_mul_bf16(lo, hi, gate, up, out); break;
      default: silu_mul_f32(lo, hi, gate, up, out); break;
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
    add_in_place(a.dtype, x, t, rows, a.hidden, a.num_threads);

    norm.weight = w.post_norm;
    rms_norm_cpu(norm);
    project(a, w, h, a.hidden, {kProjGate, kProjUp}, {gate, up}, {a.intermediate, a.intermediate});
    silu_mul_cpu(a.dtype, rows, a.intermediate, gate, up, gate, a.num_threads);
    project(a, w, gate, a.intermediate, {kProjDown}, {t}, {a.hidden});
    add_in_place(a.dtype, x, t, rows, a.hidden, a.num_threads);

    const int slot = l < a.record.size() ? a.record[l] : -1;
    if (slot >= 0) {
      std::memcpy(static_cast<char*>(a.hidden_out) + slot * rows * a.hidden * item, x,
                  static_cast<std::size_t>(rows * a.hidden * item));
    }
  }
}

}  // namespace dspec
