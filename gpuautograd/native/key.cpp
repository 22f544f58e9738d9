// The cache key's digest (key.h holds the rest of the key).

#include "key.h"

#include <algorithm>
#include <cstring>

namespace gpuautograd C10_HIDDEN {  // hidden: key.h says why

// A key's digest for the plan cache's lookup: four multiply-xor lanes over its 8-byte words. Not
// a guard (a digest match is compared in full), so it needs speed and spread, not strength.
uint64_t digest_bytes(const char* data, size_t size) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t lanes[4] = {size, size ^ 0xC2B2AE3D27D4EB4Full, size ^ 0x165667B19E3779F9ull, size ^ 0x27D4EB2F165667C5ull};
  size_t i = 0;
  for (; i + 32 <= size; i += 32) {
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, data + i + 8 * l, 8);
      lanes[l] = (lanes[l] ^ w) * kMul;
      lanes[l] ^= lanes[l] >> 29;
    }
  }
  uint64_t tail = 0;
  std::memcpy(&tail, data + i, std::min<size_t>(size - i, 8));
  uint64_t h = (lanes[0] ^ tail) * kMul;
  for (size_t j = i + 8; j < size; j += 8) {  // at most three more words
    uint64_t w = 0;
    std::memcpy(&w, data + j, std::min<size_t>(size - j, 8));
    h = ((h ^ w) * kMul) ^ (h >> 31);
  }
  for (int l = 1; l < 4; ++l) {
    h = ((h ^ lanes[l]) * kMul) ^ (h >> 31);
  }
  return h ^ (h >> 33);
}

}  // namespace gpuautograd
