// merge_states on the CPU: one pass over the rows (threaded for large inputs).
#include <algorithm>
#include <cstdint>

#include "cpu_parallel.h"
#include "dtype.h"
#include "merge_states.h"

namespace dspec {
namespace {

template <int DT>
void merge_rows(const MergeStatesArgs& a, std::int64_t lo, std::int64_t hi) {
  for (std::int64_t r = lo; r < hi; ++r) {
    const ms::Weights w = ms::weights(a.lse_a[r], a.lse_b[r]);
    const std::int64_t base = r * a.head_dim;
    for (std::int64_t d = 0; d < a.head_dim; ++d) {
      const float v = (w.wa * dt::load<DT>(a.o_a, base + d) + w.wb * dt::load<DT>(a.o_b, base + d)) * w.inv_total;
      dt::store<DT>(a.out, base + d, v);
    }
    a.lse_out[r] = w.lse;
  }
}

}  // namespace

void merge_states_cpu(const MergeStatesArgs& args) {
  auto body = [&](std::int64_t lo, std::int64_t hi) {
    switch (args.dtype) {
      case kFloat16: merge_rows<kFloat16>(args, lo, hi); break;
      case kBFloat16: merge_rows<kBFloat16>(args, lo, hi); break;
      default: merge_rows<kFloat32>(args, lo, hi); break;
    }
  };
  cpu::parallel_rows(args.rows, std::max<std::int64_t>(args.head_dim, 1), args.num_threads, body);
}

}  // namespace dspec
