// What the AMX code (bf16_amx.cpp, int4_amx_x86.cpp, amx_module.cpp) shares: the tile configuration record
// (palette 1) and the one-time request for the tile-data permission Linux requires.
#pragma once

#include <cstdint>
#include <sys/syscall.h>
#include <unistd.h>

namespace speculant_amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// True once the kernel has granted this process AMX tile data (asked once per process).
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
  }();
  return ok;
}

}  // namespace speculant_amx
