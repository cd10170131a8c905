// IEEE 754 binary16 ("half", safetensors F16) and bfloat16 (BF16) conversions.
//
// Float to 16-bit rounds to nearest, ties to even, as hardware converters do:
// values past the largest finite half become infinity, tiny values become
// subnormals or a signed zero. NaN stays NaN (quieted, sign and the top
// payload bits kept). 16-bit to float is exact. The results do not depend on
// the FPU's rounding mode or flush-to-zero settings (integer arithmetic only).
#pragma once

#include <bit>
#include <cstdint>

namespace hearth {

constexpr uint16_t FloatToHalf(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) {
    return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));
  }
  // 65520 is halfway between the largest half (65504) and 2^16; the tie rounds
  // to the even side, which is infinity.
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (abs >= 0x38800000u) {
    // Normal half: round the 23-bit mantissa at bit 13, then rebias the
    // exponent from 127 to 15. A carry out of the mantissa bumps the exponent.
    const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  }
  // Subnormal half: a multiple of 2^-24. Below 2^-25 everything rounds to
  // zero; 2^-25 itself is a tie that rounds to the even zero.
  const uint32_t exponent = abs >> 23;
  if (exponent < 102) return sign;
  const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14..24
  uint32_t q = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

constexpr float HalfToFloat(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1Fu;
  uint32_t mantissa = half & 0x3FFu;
  if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) {
    return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return std::bit_cast<float>(sign);
  // Subnormal half: normalize so that the leading one lands on bit 10.
  const int shift = std::countl_zero(mantissa) - 21;
  mantissa = (mantissa << shift) & 0x3FFu;
  return std::bit_cast<float>(sign | (static_cast<uint32_t>(113 - shift) << 23) | (mantissa << 13));
}

constexpr uint16_t FloatToBFloat16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

constexpr float BFloat16ToFloat(uint16_t bfloat16) {
  return std::bit_cast<float>(static_cast<uint32_t>(bfloat16) << 16);
}

}  // namespace hearth
