// AMX tile helpers shared by the CPU kernels (paged_scores.h, quant_gemm.cpp). KVFLEET_AMX is defined where the
// compiler targets AMX-BF16 (-march=native on such a CPU); amx_permitted() asks Linux once per process for
// the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), and kernels fall back to AVX-512 or portable loops
// where either says no.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVFLEET_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvfleet_amx {

inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All eight tiles 16 rows x 64 bytes (bf16 operands: 16 x 32; float32 sums: 16 x 16). Tile state is per
// thread: call at the start of each parallel chunk, and _tile_release() at its end.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace kvfleet_amx
#endif
