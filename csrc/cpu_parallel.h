// std::thread helpers of the C++ CPU code (no OpenMP).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <system_error>
#include <thread>
#include <vector>

namespace dspec {
namespace cpu {

// At most $DSPEC_CPU_THREADS (when set to a number >= 1, capped at 1024) or
// hardware_concurrency() threads.
inline unsigned max_threads() {
  if (const char* env = std::getenv("DSPEC_CPU_THREADS")) {
    const long n = std::strtol(env, nullptr, 10);
    if (n >= 1) return static_cast<unsigned>(std::min<long>(n, 1024));
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1u : hw;
}

// Runs fn(t) for t in [0, n) on n - 1 new threads plus the calling one.  If a thread
// cannot be started, its share runs on the calling thread.
template <class Fn>
void parallel_for(int n, Fn fn) {
  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(n));
  std::vector<int> inline_ids;
  for (int t = 1; t < n; ++t) {
    try {
      workers.emplace_back(fn, t);
    } catch (const std::system_error&) {
      inline_ids.push_back(t);
    }
  }
  fn(0);
  for (int t : inline_ids) fn(t);
  for (auto& w : workers) w.join();
}

// Runs body(lo, hi) over [0, rows) split into contiguous row ranges: one thread per
// elements_per_thread elements of work (rows * width), at most one per row, at most
// num_threads (and max_threads()); small calls stay on the calling thread.
template <class Body>
void parallel_rows(std::int64_t rows, std::int64_t width, int num_threads, Body body,
                   std::int64_t elements_per_thread = std::int64_t(1) << 16) {
  const std::int64_t by_work = rows * width / elements_per_thread + 1;
  const std::int64_t cap = std::min<std::int64_t>(num_threads, static_cast<std::int64_t>(max_threads()));
  const int threads = static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>({by_work, rows, cap})));
  if (threads <= 1) {
    body(std::int64_t(0), rows);
    return;
  }
  parallel_for(threads, [&](int t) { body(rows * t / threads, rows * (t + 1) / threads); });
}

}  // namespace cpu
}  // namespace dspec
