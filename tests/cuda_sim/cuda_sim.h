// A host simulator of the CUDA features the dspec kernels use, to run them without a GPU
// (tests only).
//
// Every simulated CUDA thread of a block is a fiber on the calling OS thread (started with
// makecontext, then switched with _setjmp / _longjmp: no system call per switch; build
// without _FORTIFY_SOURCE, whose longjmp check rejects jumps between stacks);
// blocks run one after another, so `__shared__` variables can be function statics and
// threadIdx / blockIdx plain globals set before each fiber runs.  __syncthreads and
// __syncwarp are barriers; warp shuffles and ballots exchange values through a per-warp
// buffer between two warp barriers, so every lane of a warp must reach them together (a
// divergent shuffle or __syncthreads is reported as a deadlock and aborts).  A thread that
// returns leaves the block's barrier (as on Volta and later); a full-mask warp operation
// after a lane of the warp returned aborts.  Only full-warp masks are simulated.
//
// Not simulated: memory coalescing, timing, races that the barriers do not expose, and the
// device math library (expf etc. are glibc's here, CUDA's on a GPU: last-ulp differences).
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint4 {
  unsigned x, y, z, w;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

enum cudaError_t { cudaSuccess = 0 };
using cudaStream_t = struct CUstream_sim*;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "no error"; }

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace dspec_sim {

[[noreturn]] inline void die(const char* msg) {
  std::fprintf(stderr, "cuda_sim: %s (block %u, thread %u)\n", msg, blockIdx.x, threadIdx.x);
  std::fflush(stderr);
  std::abort();
}

struct Barrier {
  int expected = 0;
  int arrived = 0;
  unsigned gen = 0;
};

struct Fiber {
  ucontext_t ctx;
  jmp_buf jb;
  std::unique_ptr<char[]> stack;  // not zero-filled
  bool started = false;
  bool done = false;
};

struct Warp {
  Barrier bar;
  std::uint64_t slot[32];
  int exited = 0;
};

struct Sched {
  ucontext_t main;
  jmp_buf main_jb;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier block_bar;
  int cur = 0;
  long events = 0;  // arrivals, releases and exits: progress
  std::function<void()> body;
};

inline Sched* g_sched = nullptr;

inline void yield() {
  Fiber& f = g_sched->fibers[static_cast<std::size_t>(g_sched->cur)];
  if (_setjmp(f.jb) == 0) _longjmp(g_sched->main_jb, 1);
}

inline void release(Barrier& b) {
  b.arrived = 0;
  ++b.gen;
  ++g_sched->events;
}

inline void wait(Barrier& b) {
  const unsigned gen = b.gen;
  ++g_sched->events;
  if (++b.arrived >= b.expected) {
    release(b);
    return;
  }
  while (b.gen == gen) yield();
}

inline void drop(Barrier& b) {
  --b.expected;
  if (b.arrived > 0 && b.arrived >= b.expected) release(b);
}

inline Warp& warp() { return g_sched->warps[threadIdx.x / 32]; }

inline void entry() {
  g_sched->body();
  Warp& w = warp();
  if (w.bar.arrived > 0) die("a lane returned while others of its warp wait in a full-mask warp operation");
  ++w.exited;
  drop(w.bar);
  drop(g_sched->block_bar);
  ++g_sched->events;
  g_sched->fibers[static_cast<std::size_t>(g_sched->cur)].done = true;
  _longjmp(g_sched->main_jb, 1);
}

// Runs kernel(args...) over `grid` blocks (one at a time) of `block` threads each.
template <class Kernel, class... Args>
void launch(unsigned grid, unsigned block, Kernel kernel, Args... args) {
  if (block == 0 || block % 32 != 0 || block > 1024) die("block size must be a multiple of 32 in [32, 1024]");
  constexpr std::size_t kStack = 256 * 1024;
  Sched s;
  g_sched = &s;
  s.fibers.resize(block);
  for (auto& f : s.fibers) f.stack.reset(new char[kStack]);
  s.body = [&] { kernel(args...); };
  for (unsigned bx = 0; bx < grid; ++bx) {
    s.warps.assign(block / 32, Warp{});
    for (auto& w : s.warps) w.bar.expected = 32;
    s.block_bar = Barrier{};
    s.block_bar.expected = static_cast<int>(block);
    for (auto& f : s.fibers) {
      f.done = false;
      f.started = false;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = &s.main;
      makecontext(&f.ctx, entry, 0);
    }
    blockIdx.x = bx;
    blockDim.x = block;
    gridDim.x = grid;
    unsigned remaining = block;
    while (remaining > 0) {
      const long before = s.events;
      remaining = 0;
      for (unsigned t = 0; t < block; ++t) {
        if (s.fibers[t].done) continue;
        s.cur = static_cast<int>(t);
        threadIdx.x = t;
        Fiber& f = s.fibers[t];
        if (_setjmp(s.main_jb) == 0) {
          if (f.started) {
            _longjmp(f.jb, 1);
          } else {
            f.started = true;
            swapcontext(&s.main, &f.ctx);  // first run; it comes back by _longjmp(main_jb)
          }
        }
        if (!f.done) ++remaining;
      }
      if (remaining > 0 && s.events == before) die("deadlock: threads wait at barriers that others never reach");
    }
  }
  g_sched = nullptr;
}

}  // namespace dspec_sim

inline void dspec_sim_check_mask(unsigned mask) {
  if (mask != 0xffffffffu) dspec_sim::die("only full-warp masks are simulated");
}

// A full-mask warp operation needs all 32 lanes: an error if a lane has returned before it
// (checked on entry; a lane returning while others wait is caught in entry()).
inline void dspec_sim_check_warp(const dspec_sim::Warp& w) {
  if (w.exited != 0) dspec_sim::die("full-mask warp operation after lanes of the warp returned");
}

inline void __syncthreads() { dspec_sim::wait(dspec_sim::g_sched->block_bar); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  dspec_sim_check_mask(mask);
  dspec_sim::Warp& w = dspec_sim::warp();
  dspec_sim_check_warp(w);
  dspec_sim::wait(w.bar);
}

template <class T>
T dspec_sim_exchange(T v, int src) {
  static_assert(sizeof(T) <= 8, "at most 8-byte shuffles");
  dspec_sim::Warp& w = dspec_sim::warp();
  const int lane = static_cast<int>(threadIdx.x % 32);
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  dspec_sim_check_warp(w);
  w.slot[lane] = bits;
  dspec_sim::wait(w.bar);
  const std::uint64_t got = w.slot[src];
  dspec_sim::wait(w.bar);
  T r;
  std::memcpy(&r, &got, sizeof(T));
  return r;
}

template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane) {
  dspec_sim_check_mask(mask);
  return dspec_sim_exchange(v, src_lane & 31);
}

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  dspec_sim_check_mask(mask);
  return dspec_sim_exchange(v, static_cast<int>(threadIdx.x % 32) ^ (lane_mask & 31));
}

template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
  dspec_sim_check_mask(mask);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int src = lane - static_cast<int>(delta);
  return dspec_sim_exchange(v, src < 0 ? lane : src);  // lanes below delta keep their value
}

inline unsigned __ballot_sync(unsigned mask, bool pred) {
  dspec_sim_check_mask(mask);
  dspec_sim::Warp& w = dspec_sim::warp();
  const int lane = static_cast<int>(threadIdx.x % 32);
  dspec_sim_check_warp(w);
  w.slot[lane] = pred ? 1u : 0u;
  dspec_sim::wait(w.bar);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= (w.slot[l] ? 1u : 0u) << l;
  dspec_sim::wait(w.bar);
  return r;
}

inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint4 __ldg(const uint4* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) dspec_sim::die("misaligned 16-byte load");
  return *p;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
