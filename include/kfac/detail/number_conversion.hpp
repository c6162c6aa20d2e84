// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file number_conversion.hpp
/// Element conversions between the formats of kfac/precision.hpp, on the bits of a 16-bit
/// element (so that no 16-bit type is needed here).
///
/// Widening (bf16/fp16 → float → double) is exact. Narrowing rounds once, to nearest with ties
/// to even, from whatever the source is: a double goes first to float with rounding to odd
/// (truncate, then set the last bit when anything was cut off), which keeps every bit a later
/// rounding to 8 or 11 significant bits needs (24 ≥ 11 + 2: Boldo & Melquiond, "Emulation of
/// FMA and correctly rounded sums: proved algorithms using rounding to odd", 2008), then to
/// the 16-bit format with ties to even.

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kfac/precision.hpp"

namespace kfac::detail {

[[nodiscard]] inline float bf16_bits_to_float(std::uint16_t h) noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

[[nodiscard]] inline float fp16_bits_to_float(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exponent = (h >> 10) & 0x1Fu;
    const std::uint32_t mantissa = h & 0x3FFu;
    if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
    if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;  // subnormal (or zero): exact
    return sign != 0 ? -magnitude : magnitude;
}

/// x rounded to float with rounding to odd (see the file comment); infinities and NaN pass.
[[nodiscard]] inline float round_to_odd_float(double x) noexcept {
    float f = static_cast<float>(x);
    if (std::isnan(x) || static_cast<double>(f) == x) return f;
    if (std::isinf(f)) f = std::copysign(std::numeric_limits<float>::max(), f);  // finite x beyond float
    if (std::abs(static_cast<double>(f)) > std::abs(x)) f = std::nextafter(f, 0.0f);  // truncate
    auto bits = std::bit_cast<std::uint32_t>(f);
    return std::bit_cast<float>(bits | 1u);  // odd: the neighbour of the two whose last bit is set
}

[[nodiscard]] inline std::uint16_t float_to_bf16_bits(float f) noexcept {
    const auto bits = std::bit_cast<std::uint32_t>(f);
    if (std::isnan(f)) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);  // stays a (quiet) NaN
    const std::uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);  // ties to even
    return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

[[nodiscard]] inline std::uint16_t float_to_fp16_bits(float f) noexcept {
    const auto bits = std::bit_cast<std::uint32_t>(f);
    const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
    const std::uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);  // NaN
    if (magnitude >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // ≥ 65520: inf
    if (magnitude < 0x38800000u) {
        // Below fp16's smallest normal 2^-14: a multiple of 2^-24, rounded by the float
        // addition of 0.5 (exact ties to even on the integer part, below 2^23).
        const float scaled = std::abs(f) * 0x1p24f;  // exact: a power-of-two scaling
        const float sum = scaled + 0x1p23f;          // rounds to an integer, ties to even
        const auto units = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(sum) - 0x4B000000u);
        return static_cast<std::uint16_t>(sign | units);
    }
    // Normal: rebias the exponent (127 → 15) and round 23 mantissa bits to 10, ties to even.
    const std::uint32_t rebiased = magnitude - (112u << 23);
    const std::uint32_t rounding = 0xFFFu + ((rebiased >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | ((rebiased + rounding) >> 13));
}

/// Element i of a buffer in `format`, as a double (exact).
[[nodiscard]] inline double element_as_double(const void* data, std::int64_t i, precision format) noexcept {
    switch (format) {
        case precision::fp64: return static_cast<const double*>(data)[i];
        case precision::fp32: return static_cast<double>(static_cast<const float*>(data)[i]);
        case precision::bf16: return static_cast<double>(bf16_bits_to_float(static_cast<const std::uint16_t*>(data)[i]));
        case precision::fp16: return static_cast<double>(fp16_bits_to_float(static_cast<const std::uint16_t*>(data)[i]));
    }
    return 0.0;
}

/// Reads n elements in `format` into `out` (float or double): exact but for fp64 into float,
/// which rounds to nearest.
template <class T>
void widen(const void* data, std::int64_t n, precision format, T* out) noexcept {
    if (format == precision::bf16) {
        const auto* bits = static_cast<const std::uint16_t*>(data);
        for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(bf16_bits_to_float(bits[i]));
    } else if (format == precision::fp16) {
        const auto* bits = static_cast<const std::uint16_t*>(data);
        for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(fp16_bits_to_float(bits[i]));
    } else if (format == precision::fp32) {
        const auto* f = static_cast<const float*>(data);
        for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(f[i]);
    } else {
        const auto* d = static_cast<const double*>(data);
        for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(d[i]);
    }
}

/// x (a float or a double) rounded once to a 16-bit format, as its bits.
template <class T>
[[nodiscard]] std::uint16_t narrow_to_16_bits(T x, precision format) noexcept {
    float f;
    if constexpr (sizeof(T) == sizeof(float)) f = x;
    else f = round_to_odd_float(x);
    return format == precision::bf16 ? float_to_bf16_bits(f) : float_to_fp16_bits(f);
}

/// Writes n values (float or double) into a buffer in `format`, each rounded once to
/// nearest (ties to even).
template <class T>
void narrow(const T* in, std::int64_t n, precision format, void* data) noexcept {
    if (format == precision::bf16 || format == precision::fp16) {
        auto* bits = static_cast<std::uint16_t*>(data);
        for (std::int64_t i = 0; i < n; ++i) bits[i] = narrow_to_16_bits(in[i], format);
    } else if (format == precision::fp32) {
        auto* f = static_cast<float*>(data);
        for (std::int64_t i = 0; i < n; ++i) f[i] = static_cast<float>(in[i]);
    } else {
        auto* d = static_cast<double*>(data);
        for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<double>(in[i]);
    }
}

/// Whether every one of n elements in `format` is finite.
[[nodiscard]] inline bool all_finite(const void* data, std::int64_t n, precision format) noexcept {
    if (format == precision::bf16 || format == precision::fp16) {
        const std::uint16_t exponent = format == precision::bf16 ? 0x7F80u : 0x7C00u;
        const auto* bits = static_cast<const std::uint16_t*>(data);
        bool finite = true;
        for (std::int64_t i = 0; i < n; ++i) finite &= (bits[i] & exponent) != exponent;
        return finite;
    }
    bool finite = true;
    if (format == precision::fp32) {
        const auto* f = static_cast<const float*>(data);
        for (std::int64_t i = 0; i < n; ++i) finite &= std::isfinite(f[i]);
    } else {
        const auto* d = static_cast<const double*>(data);
        for (std::int64_t i = 0; i < n; ++i) finite &= std::isfinite(d[i]);
    }
    return finite;
}

}  // namespace kfac::detail
