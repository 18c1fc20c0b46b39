// What the kernels that multiply on AMX tiles share: whether this build has the tiles (POLYKV_TILES), and Linux's
// permission to use them. Included by int8_linear.cpp and grouped_attention.cpp.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define POLYKV_TILES 1  // built for a CPU with AMX: bfloat16 products may use its tiles
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define POLYKV_TILES 0
#endif

namespace polykv {

#if POLYKV_TILES
// Linux hands out AMX's tile state only on request, once per process.
inline bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}
#else
inline bool tiles_permitted() { return false; }
#endif

}  // namespace polykv
