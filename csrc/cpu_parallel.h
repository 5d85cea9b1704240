// std::thread helpers of the C++ CPU code (no OpenMP).
#pragma once

#include <algorithm>
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

}  // namespace cpu
}  // namespace dspec
