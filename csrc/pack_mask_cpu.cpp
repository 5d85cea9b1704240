// pack_mask / unpack_mask on the CPU (layout: masks.h).  Single-threaded: masks are
// N x N with N in the hundreds; one pass over the bytes, 32 at a time.
#include <cstdint>

#include "masks.h"

namespace dspec {

void pack_mask_cpu(const PackMaskArgs& a) {
  const std::int64_t num_words = mask_words(a.num_keys);
  const std::int64_t full = a.num_keys / 32;  // words with 32 keys
  for (std::int64_t r = 0; r < a.rows; ++r) {
    const std::uint8_t* m = a.mask + r * a.row_stride;
    std::int32_t* out = a.words + r * num_words;
    for (std::int64_t w = 0; w < full; ++w) {
      const std::uint8_t* src = m + w * 32;
      std::uint32_t word = 0;
      for (int j = 0; j < 32; ++j) word |= static_cast<std::uint32_t>(src[j] != 0) << j;
      out[w] = static_cast<std::int32_t>(word);
    }
    if (full < num_words) {  // a partial last word: bits past num_keys stay 0
      const std::uint8_t* src = m + full * 32;
      const int tail = static_cast<int>(a.num_keys - full * 32);
      std::uint32_t word = 0;
      for (int j = 0; j < tail; ++j) word |= static_cast<std::uint32_t>(src[j] != 0) << j;
      out[full] = static_cast<std::int32_t>(word);
    }
  }
}

void unpack_mask_cpu(const UnpackMaskArgs& a) {
  for (std::int64_t r = 0; r < a.rows; ++r) {
    const std::int32_t* words = a.words + r * a.row_stride;
    std::uint8_t* out = a.out + r * a.num_keys;
    for (std::int64_t k = 0; k < a.num_keys; ++k) {
      const std::uint32_t word = static_cast<std::uint32_t>(words[k >> 5]);
      out[k] = static_cast<std::uint8_t>((word >> (k & 31)) & 1u);
    }
  }
}

}  // namespace dspec
