// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file precision.hpp
/// The floating-point formats kfac reads, writes and stores: bf16, fp16, fp32 and fp64, and
/// the customisation point `kfac::number_format<T>` that tells which one an element type is.
///
/// kfac reads a 16-bit element by its bits (IEEE binary16 for fp16; the upper half of an
/// IEEE binary32 for bf16), so any 16-bit type of that layout can be declared: the CPU's
/// Eigen::bfloat16 and Eigen::half are (kfac/layers/eigen_number_formats.hpp), as are
/// LibTorch's c10::BFloat16 and c10::Half (kfac/layers/torch.hpp) and CUDA's __nv_bfloat16
/// and __half (kfac/layers/cuda_number_formats.cuh).

#include <cstddef>
#include <string>

namespace kfac {

/// A floating-point format.
enum class precision {
    bf16,  ///< bfloat16: 8 exponent bits, 8 significand bits
    fp16,  ///< IEEE binary16 (half): 5 exponent bits, 11 significand bits
    fp32,  ///< IEEE binary32 (float)
    fp64,  ///< IEEE binary64 (double)
};

/// The format's name, as checkpoints and messages write it: "bf16", "fp16", "fp32" or "fp64".
[[nodiscard]] constexpr const char* precision_name(precision p) noexcept {
    switch (p) {
        case precision::bf16: return "bf16";
        case precision::fp16: return "fp16";
        case precision::fp32: return "fp32";
        case precision::fp64: return "fp64";
    }
    return "?";
}

/// Bytes of one element.
[[nodiscard]] constexpr std::size_t bytes_of(precision p) noexcept {
    return p == precision::fp64 ? 8 : p == precision::fp32 ? 4 : 2;
}

/// u = 2^-p, p the bits of the significand (the implicit one included): the largest relative
/// error of rounding a real number in range to the nearest value of the format.
[[nodiscard]] constexpr double unit_roundoff(precision p) noexcept {
    switch (p) {
        case precision::bf16: return 1.0 / 256.0;    // 8 bits
        case precision::fp16: return 1.0 / 2048.0;   // 11 bits
        case precision::fp32: return 0x1p-24;        // 24 bits
        case precision::fp64: return 0x1p-53;        // 53 bits
    }
    return 1.0;
}

/// Largest finite value of the format.
[[nodiscard]] constexpr double largest_finite(precision p) noexcept {
    switch (p) {
        case precision::bf16: return 0x1.FEp127;
        case precision::fp16: return 65504.0;
        case precision::fp32: return 0x1.FFFFFEp127;
        case precision::fp64: return 0x1.FFFFFFFFFFFFFp1023;
    }
    return 0.0;
}

/// Specialise for an element type kfac should read: `static constexpr precision format`.
/// A 16-bit type must hold exactly the format's 16 bits (see the file comment).
template <class T>
struct number_format {};

/// float is fp32.
template <>
struct number_format<float> {
    static constexpr precision format = precision::fp32;  ///< float's format
};
/// double is fp64.
template <>
struct number_format<double> {
    static constexpr precision format = precision::fp64;  ///< double's format
};

/// An element type kfac reads and writes: float, double, or a declared 16-bit type.
template <class T>
concept number_type = requires {
    { number_format<T>::format } -> std::convertible_to<precision>;
} && sizeof(T) == bytes_of(number_format<T>::format);

/// The precision of a number_type.
template <number_type T>
inline constexpr precision precision_of = number_format<T>::format;

}  // namespace kfac
