// Threading of the C++ CPU code (no OpenMP): a persistent pool.
//
// A decode step calls ~200 kernels of 10-100 us each; starting a std::thread per call costs
// ~10-20 us, so the workers persist.  Between calls a worker spins briefly (yielding its
// core to any other runnable thread: torch's own OpenMP workers share these cores), then
// sleeps on a condition variable; woken onto the caller's core, it moves off it.  One call
// at a time: a call that finds the pool busy (a second Python thread with the GIL released)
// runs on fresh threads instead.
//
// fork: a child has none of the parent's workers, and the pool's mutexes and condition
// variable hold the state of threads that do not exist there (a worker asleep in
// wait() leaves the condition variable's waiter count raised, so the child's first
// notify_all() blocks forever).  A pthread_atfork child handler therefore drops the
// parent's pool (leaked on purpose: destroying those objects is undefined) and the
// child's first call builds a fresh one.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

namespace dspec {
namespace cpu {

// At most $DSPEC_CPU_THREADS (when set to a number >= 1, capped at 1024) or
// hardware_concurrency() threads.  The latter is read once: glibc answers it by reading
// /sys/devices/system/cpu/online, a path walk that cost ~5 % of a decode step's main thread
// when asked in every kernel call (perf, SmolLM2-135M, November 2026).
inline unsigned max_threads() {
  if (const char* env = std::getenv("DSPEC_CPU_THREADS")) {
    const long n = std::strtol(env, nullptr, 10);
    if (n >= 1) return static_cast<unsigned>(std::min<long>(n, 1024));
  }
  static const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  return hw;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The pool: chunks of a call are handed out through an atomic counter, and the calling
// thread takes chunks too, so a call never waits for a worker that has not woken up (a
// sleeping worker, or one whose core is busy with another thread, simply gets no chunk);
// it waits only for chunks already started.
class ThreadPool {
 public:
  // The process's pool, built on first use (and again in a forked child); never destroyed:
  // workers outlive static teardown.
  static ThreadPool& instance() {
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, &forget_in_child);
      return true;
    }();
    (void)registered;
    std::atomic<ThreadPool*>& slot = current();
    ThreadPool* pool = slot.load(std::memory_order_acquire);
    if (pool != nullptr) return *pool;
    ThreadPool* fresh = new ThreadPool();
    if (slot.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread installed one first (no worker started on ours yet)
    return *pool;
  }

  // Runs fn(c) once for every chunk c in [0, chunks) on the calling thread and up to
  // threads - 1 workers; false (nothing run) when another call holds the pool or a worker
  // cannot be started.
  bool try_run(int chunks, int threads, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> run(run_mutex_, std::try_to_lock);
    if (!run.owns_lock()) return false;
    if (!ensure_workers(threads - 1)) return false;
    task_ = &fn;
    chunks_ = chunks;
    helpers_ = threads - 1;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    users_.fetch_and(~kClosed, std::memory_order_release);  // open: workers may join
    caller_cpu_.store(current_cpu(), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(wake_mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_cv_.notify_all();
    work();
    while (done_.load(std::memory_order_acquire) != chunks) cpu_relax();
    // close, then wait out the workers that joined (they find no chunk left)
    users_.fetch_or(kClosed, std::memory_order_acq_rel);
    while ((users_.load(std::memory_order_acquire) & ~kClosed) != 0) cpu_relax();
    task_ = nullptr;
    return true;
  }

 private:
  static constexpr std::uint32_t kClosed = 1u << 31;

  ThreadPool() = default;

  static std::atomic<ThreadPool*>& current() {
    static std::atomic<ThreadPool*> pool{nullptr};
    return pool;
  }

  static int current_cpu() {
#if defined(__linux__)
    return sched_getcpu();
#else
    return -1;
#endif
  }

  // A worker woken from its sleep can be placed on the core of the calling thread, which
  // spins there on the call's chunks: both then share one core until the scheduler moves
  // one (measured on a 2-core VM: a 2-thread projection after a 20 ms pause ran at one
  // core's speed for burst after burst, with the worker and the caller on one core).  Such
  // a worker moves itself: it excludes its core from its affinity, which migrates it at
  // once, and restores its mask, which leaves it where it went.  Changes no result.
  void leave_caller_cpu() {
#if defined(__linux__)
    const int mine = current_cpu();
    if (mine < 0 || mine != caller_cpu_.load(std::memory_order_relaxed)) return;
    cpu_set_t all;
    if (sched_getaffinity(0, sizeof(all), &all) != 0) return;
    cpu_set_t others = all;
    CPU_CLR(mine, &others);
    if (CPU_COUNT(&others) == 0) return;
    if (sched_setaffinity(0, sizeof(others), &others) == 0) sched_setaffinity(0, sizeof(all), &all);
#endif
  }

  // Runs in the child right after fork(), on its only thread: the inherited pool's
  // threads do not exist here and its synchronisation objects may be mid-use by them.
  static void forget_in_child() { current().store(nullptr, std::memory_order_release); }

  void work() {
    for (int c = next_.fetch_add(1, std::memory_order_acq_rel); c < chunks_;
         c = next_.fetch_add(1, std::memory_order_acq_rel)) {
      (*task_)(c);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  bool ensure_workers(int count) {
    const std::uint64_t current = generation_.load(std::memory_order_acquire);
    while (static_cast<int>(workers_.size()) < count) {
      const int id = static_cast<int>(workers_.size()) + 1;
      try {
        workers_.emplace_back([this, id, current] { loop(id, current); });
        workers_.back().detach();
      } catch (const std::system_error&) {
        return false;
      }
    }
    return true;
  }

  void loop(int id, std::uint64_t seen) {
    for (;;) {
      std::uint64_t g = generation_.load(std::memory_order_acquire);
      if (g == seen) {
        // spin ~1 ms (a decode step's next kernel is microseconds away), then sleep
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
        int spins = 0;
        while ((g = generation_.load(std::memory_order_acquire)) == seen) {
          cpu_relax();
          if (++spins % 1024 == 0) {
            sched_yield();
            if (std::chrono::steady_clock::now() > until) {
              {
                std::unique_lock<std::mutex> lk(wake_mutex_);
                wake_cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
              }
              leave_caller_cpu();
            }
          }
        }
      }
      seen = g;
      const std::uint32_t before = users_.fetch_add(1, std::memory_order_acq_rel);
      if (!(before & kClosed) && id <= helpers_) work();
      users_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex run_mutex_;
  std::mutex wake_mutex_;
  std::condition_variable wake_cv_;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<std::uint32_t> users_{kClosed};  // workers inside a call, | kClosed between calls
  std::atomic<int> next_{0};
  std::atomic<int> done_{0};
  std::atomic<int> caller_cpu_{-1};  // the core the latest call started on (-1: unknown)
  // written while closed, read by workers only after joining an open call
  const std::function<void(int)>* task_ = nullptr;
  int chunks_ = 0;
  int helpers_ = 0;
  std::vector<std::thread> workers_;
};

// Runs fn(c) once for each chunk c in [0, chunks) on up to `threads` threads (the calling
// one included; any thread may run any chunk): on the persistent pool, or (pool busy) on
// threads - 1 new threads.  If a thread cannot be started, its chunks run on the others.
template <class Fn>
void parallel_chunks(int chunks, int threads, Fn fn) {
  threads = std::max(1, std::min(threads, chunks));
  if (threads <= 1) {
    for (int c = 0; c < chunks; ++c) fn(c);
    return;
  }
  const std::function<void(int)> task = [&fn](int c) { fn(c); };
  if (ThreadPool::instance().try_run(chunks, threads, task)) return;
  std::atomic<int> next{0};
  auto drain = [&] {
    for (int c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) fn(c);
  };
  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(threads));
  for (int t = 1; t < threads; ++t) {
    try {
      workers.emplace_back(drain);
    } catch (const std::system_error&) {
      break;
    }
  }
  drain();
  for (auto& w : workers) w.join();
}

// Runs fn(t) for t in [0, n), up to n at a time.
template <class Fn>
void parallel_for(int n, Fn fn) {
  parallel_chunks(n, n, fn);
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
