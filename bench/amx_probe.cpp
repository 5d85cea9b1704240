// What the AMX tile unit of this CPU does, one core, no dspec code: the clock (a dependent
// integer-add chain, one add per cycle: under KVM it read 2.2-3.25 GHz within one hour, so the
// nanoseconds are the numbers to compare), the rate of 16 x 32 x 16 tdpbf16ps with four
// independent accumulators and as one dependent chain, and what a 1 KiB B tile load costs
// from working sets of growing size (L1, L2, memory).  docs/performance.md quotes its
// output.
//
//   g++ -O2 -mamx-tile -mamx-bf16 -mavx512f bench/amx_probe.cpp -o /tmp/amx_probe && /tmp/amx_probe
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

namespace {

struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double clock_ghz() {
  constexpr long kAdds = 500000000;
  const auto t0 = std::chrono::steady_clock::now();
  long x = 0;
  for (long i = 0; i < kAdds; ++i) asm volatile("add $1, %0" : "+r"(x));
  return kAdds / seconds_since(t0) / 1e9;
}

}  // namespace

int main() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::puts("the kernel does not grant AMX tile data to this process");
    return 1;
  }
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const double ghz = clock_ghz();
  std::printf("clock ~%.2f GHz (dependent adds)\n", ghz);

  alignas(64) static std::uint16_t a[16 * 32];
  for (auto& e : a) e = 0x3f80;  // bf16 1.0
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, a, 64);
  _tile_loadd(7, a, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr long kOps = 2000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kOps; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  double s = seconds_since(t0);
  std::printf("tdpbf16ps, 4 accumulators: %.2f ns (%.1f cycles) each\n", s * 1e9 / (4 * kOps), s * ghz * 1e9 / (4 * kOps));
  t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kOps; ++i) _tile_dpbf16ps(0, 4, 5);
  s = seconds_since(t0);
  std::printf("tdpbf16ps, one dependent chain: %.2f ns (%.1f cycles) each\n", s * 1e9 / kOps, s * ghz * 1e9 / kOps);

  for (long kib : {32L, 640L, 1700L, 16384L}) {
    const long tiles = kib;  // 1 KiB each
    auto* b = static_cast<std::uint16_t*>(std::aligned_alloc(64, tiles * 1024));
    for (long i = 0; i < tiles * 512; ++i) b[i] = 0x3f80;
    const long reps = 200000000 / (tiles * 16) + 1;
    long loads = 0;
    t0 = std::chrono::steady_clock::now();
    for (long r = 0; r < reps; ++r) {
      for (long t = 0; t + 4 <= tiles; t += 4) {
        _tile_loadd(5, b + t * 512, 64);
        _tile_loadd(6, b + (t + 1) * 512, 64);
        _tile_loadd(7, b + (t + 2) * 512, 64);
        _tile_loadd(5, b + (t + 3) * 512, 64);
        loads += 4;
      }
    }
    s = seconds_since(t0);
    std::printf("1 KiB tile loads from a %5ld KiB set: %.2f ns (%.1f cycles) each\n", kib, s * 1e9 / loads,
                s * ghz * 1e9 / loads);
    std::free(b);
  }
  _tile_release();
  return 0;
}
