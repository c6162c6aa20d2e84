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

// The element conversions are constexpr and use only integer operations and casts, so that
// the CUDA backend's kernels call the same code on the device (nvcc's relaxed constexpr).

[[nodiscard]] constexpr float bf16_bits_to_float(std::uint16_t h) noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

[[nodiscard]] constexpr float fp16_bits_to_float(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exponent = (h >> 10) & 0x1Fu;
    const std::uint32_t mantissa = h & 0x3FFu;
    if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
    if (exponent != 0) return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;  // subnormal (or zero): exact
    return sign != 0 ? -magnitude : magnitude;
}

/// x rounded to float with rounding to odd (see the file comment); infinities and NaN pass.
[[nodiscard]] constexpr float round_to_odd_float(double x) noexcept {
    const float f = static_cast<float>(x);
    if (x != x || static_cast<double>(f) == x) return f;  // NaN, or exact
    std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
    const double magnitude = x < 0 ? -x : x;
    const std::uint32_t sign = bits & 0x80000000u;
    std::uint32_t m = bits & 0x7FFFFFFFu;  // |f|'s bits: they increase with |f|
    if (m == 0x7F800000u) m = 0x7F7FFFFFu;  // a finite x beyond float: truncate to the largest
    if (static_cast<double>(std::bit_cast<float>(m)) > magnitude) --m;  // truncate toward zero
    return std::bit_cast<float>(sign | m | 1u);  // odd: the neighbour of the two whose last bit is set
}

[[nodiscard]] constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
    const auto bits = std::bit_cast<std::uint32_t>(f);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);  // a quiet NaN
    const std::uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);  // ties to even
    return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

[[nodiscard]] constexpr std::uint16_t float_to_fp16_bits(float f) noexcept {
    const auto bits = std::bit_cast<std::uint32_t>(f);
    const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
    const std::uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);   // NaN
    if (magnitude >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // ≥ 65520: inf
    if (magnitude < 0x38800000u) {
        // Below fp16's smallest normal 2^-14: a multiple of 2^-24, rounded by the float
        // addition of 2^23 (ties to even on the integer part, which is below 2^11).
        const float scaled = std::bit_cast<float>(magnitude) * 0x1p24f;  // exact: a power-of-two scaling
        const float sum = scaled + 0x1p23f;
        const auto units = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(sum) - 0x4B000000u);
        return static_cast<std::uint16_t>(sign | units);
    }
    // Normal: rebias the exponent (127 → 15) and round 23 mantissa bits to 10, ties to even.
    const std::uint32_t rebiased = magnitude - (112u << 23);
    const std::uint32_t rounding = 0xFFFu + ((rebiased >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | ((rebiased + rounding) >> 13));
}

/// x (a float or a double) rounded once to a 16-bit format, as its bits.
template <class T>
[[nodiscard]] constexpr std::uint16_t narrow_to_16_bits(T x, precision format) noexcept {
    float f = 0.0f;
    if constexpr (sizeof(T) == sizeof(float)) f = x;
    else f = round_to_odd_float(x);
    return format == precision::bf16 ? float_to_bf16_bits(f) : float_to_fp16_bits(f);
}

/// Whether x (a float or a double) rounds to a finite value of `format`, as narrow() and
/// narrow_to_16_bits() round it: a finite value beyond the format's range rounds to ±Inf
/// (fp16 from 65520, float from 2^128 − 2^103). NaN and ±Inf do not.
template <class T>
[[nodiscard]] constexpr bool rounds_to_finite(T x, precision format) noexcept {
    if (x != x || x - x != x - x) return false;  // NaN, or ±Inf (∞ − ∞ is NaN)
    if (format == precision::bf16 || format == precision::fp16) {
        const std::uint16_t exponent = format == precision::bf16 ? 0x7F80u : 0x7C00u;
        return (narrow_to_16_bits(x, format) & exponent) != exponent;
    }
    // A double rounds to float's infinity from the midpoint between the largest float and 2^128
    // (a tie goes to the even one, which is infinity); a float is always a float.
    if (format == precision::fp32) {
        if constexpr (sizeof(T) == sizeof(float)) return true;  // finite, and a float already
        else return (x < 0 ? -x : x) < 0x1.ffffffp127;
    }
    return true;
}

/// A 16-bit element's value (exact).
[[nodiscard]] constexpr float widen_16_bits(std::uint16_t h, precision format) noexcept {
    return format == precision::bf16 ? bf16_bits_to_float(h) : fp16_bits_to_float(h);
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

/// How many of n values (float or double) do not round to a finite value of `format`.
template <class T>
[[nodiscard]] std::int64_t count_beyond_format(const T* in, std::int64_t n, precision format) noexcept {
    std::int64_t beyond = 0;
    for (std::int64_t i = 0; i < n; ++i) beyond += rounds_to_finite(in[i], format) ? 0 : 1;
    return beyond;
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
