// What every AMX kernel here needs (fmatmul_cpu.cc's bfloat16 matmul, attend_cpu.cc's chunk attention): KIVI_AMX
// when the compiler targets AMX-BF16 on Linux, the permission to use the tile state, and the tile configuration.

#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define KIVI_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// Whether this process may use the tile state (asked of the kernel once; a kernel runs AMX only when it may).
inline bool amx_allowed() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// The tile configuration `_tile_loadconfig` reads (palette 1: eight tiles of up to 16 rows of 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes (16 float32, or 32 bfloat16 a row), loaded on this thread.
inline void load_square_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace
#endif
