//===- Element.cpp - Storage types and bf16 conversion --------------------===//

#include "runtime/cpu/Element.h"

namespace moec::cpu {

// The loops below are branch-free per element (floatToBf16 selects rather
// than branches), so the compiler vectorizes them.

void floatToBf16(const float *src, uint16_t *dst, size_t count) {
  for (size_t i = 0; i < count; ++i)
    dst[i] = floatToBf16(src[i]);
}

void bf16ToFloat(const uint16_t *src, float *dst, size_t count) {
  for (size_t i = 0; i < count; ++i)
    dst[i] = bf16ToFloat(src[i]);
}

void loadFloats(const void *src, Elt elt, float *dst, size_t count) {
  if (elt == Elt::BF16)
    bf16ToFloat(static_cast<const uint16_t *>(src), dst, count);
  else if (count != 0)
    std::memcpy(dst, src, count * sizeof(float));
}

void storeFloats(const float *src, void *dst, Elt elt, size_t count) {
  if (elt == Elt::BF16)
    floatToBf16(src, static_cast<uint16_t *>(dst), count);
  else if (count != 0)
    std::memcpy(dst, src, count * sizeof(float));
}

} // namespace moec::cpu
