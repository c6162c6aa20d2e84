// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file value_checks.hpp
/// The values a checkpoint's tensors may hold, checked on load before anything is set. The
/// checksum finds damage done after save(); these checks refuse a file whose checksum is
/// valid but whose content no save() wrote (edited and resealed, written by another tool, or
/// saved by a build with a bug), which would otherwise load and stay NaN or wrong.
///
/// A running factor is a covariance: finite, symmetric, with a nonnegative diagonal. How it is
/// stored depends on its factor_structure (kfac/layers/layer_description.hpp):
///   dense      n × n, the whole symmetric matrix;
///   diagonal   [n], the diagonal alone (an Embedding's A): every entry a diagonal entry;
///   unit_wise  C × 3, one row (F_γγ, F_γβ, F_ββ) per channel's 2 × 2 block, or C × 1 (F_γγ)
///              without a shift: columns 0 and 2 are diagonal entries, column 1 an
///              off-diagonal one (any sign); symmetric by construction;
///   identity   1 × 1, the identity itself (a normalisation layer's G): exactly 1.
/// Second-order data (eigenvectors, eigenvalues, damped inverses) must be finite.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kfac/checkpoint/safetensors.hpp"
#include "kfac/layers/layer_description.hpp"

namespace kfac::checkpoint {

namespace value_detail {

/// Element i of a floating-point tensor, widened to double (exact).
[[nodiscard]] inline double element(const tensor& t, std::size_t i) {
    if (t.type == dtype::bf16 || t.type == dtype::f16) return std::ldexp(t.element(i), t.exponent);
    if (t.type == dtype::f32) {
        float v;
        std::memcpy(&v, t.bytes.data() + i * sizeof v, sizeof v);
        return static_cast<double>(v);
    }
    double v;
    std::memcpy(&v, t.bytes.data() + i * sizeof v, sizeof v);
    return v;
}

/// The shortest text that reads back as `v` (so two values one unit in the last place apart
/// print differently): "0.003", "nan", "-inf".
[[nodiscard]] inline std::string number(double v) {
    char buffer[32];
    const auto end = std::to_chars(buffer, buffer + sizeof buffer, v).ptr;
    return std::string(buffer, end);
}

/// "(i, j)" of a C-order tensor with `cols` columns, "[i]" of a vector.
[[nodiscard]] inline std::string position(const tensor& t, std::size_t index, std::int64_t cols) {
    if (t.shape.size() < 2) return "[" + std::to_string(index) + "]";
    const auto c = static_cast<std::size_t>(cols);
    return "(" + std::to_string(index / c) + ", " + std::to_string(index % c) + ")";
}

/// Unit roundoff of the precision the tensor was saved in.
[[nodiscard]] inline double unit_roundoff(const tensor& t) {
    return kfac::unit_roundoff(precision_of_dtype(t.type));
}

/// The first (i, j), i < j, of an n × n tensor whose (j, i) has other bits, or (0, 0). `Bits`:
/// an unsigned integer of the element's size. Tiled, so that the column walk of the lower
/// triangle stays in cache: factor_fault() reads a 4096 × 4096 double factor (128 MiB) in
/// about 40 ms, less than half of what parse() takes to copy it out of the file's bytes.
template <class Bits>
[[nodiscard]] std::pair<std::size_t, std::size_t> first_asymmetry(const tensor& t, std::size_t n) {
    const std::byte* data = t.bytes.data();
    auto bits = [&](std::size_t index) {
        Bits b;
        std::memcpy(&b, data + index * sizeof b, sizeof b);
        return b;
    };
    constexpr std::size_t tile = 64;
    for (std::size_t ib = 0; ib < n; ib += tile)
        for (std::size_t jb = ib; jb < n; jb += tile)
            for (std::size_t i = ib; i < std::min(ib + tile, n); ++i)
                for (std::size_t j = std::max(jb, i + 1); j < std::min(jb + tile, n); ++j)
                    if (bits(i * n + j) != bits(j * n + i)) return {i, j};
    return {0, 0};
}

}  // namespace value_detail

/// What is wrong with the values of `t` (F32 or F64, `cols` columns in C order), or "" when
/// every value is finite.
[[nodiscard]] inline std::string non_finite_fault(const tensor& t, std::int64_t cols) {
    const auto n = static_cast<std::size_t>(t.elements());
    auto first = [&](auto zero) {  // one pass in the stored type
        using T = decltype(zero);
        for (std::size_t i = 0; i < n; ++i) {
            T v;
            std::memcpy(&v, t.bytes.data() + i * sizeof v, sizeof v);
            if (!std::isfinite(v)) return i;
        }
        return n;
    };
    std::size_t i = n;
    if (t.type == dtype::bf16 || t.type == dtype::f16) {
        for (i = 0; i < n && std::isfinite(t.element(i)); ++i) {
        }
    } else {
        i = t.type == dtype::f32 ? first(0.0f) : first(0.0);
    }
    if (i == n) return {};
    return "holds " + value_detail::number(value_detail::element(t, i)) + " at " + value_detail::position(t, i, cols) +
           " (not finite)";
}

/// What is wrong with `t` as a running factor of `structure` stored with `cols` columns (see
/// the file comment), or "" when nothing is.
///
/// Symmetry is checked exactly: every update of a dense factor mirrors the statistic's lower
/// triangle and then computes entry (i, j) and entry (j, i) by the same formula
/// (decay·F + weight·S), and the averaging across ranks sums the statistics before the
/// mirror, so save() writes bitwise symmetric factors (measured on Linear and Conv2d layers,
/// im2col and shifted conv statistics, float and double, with and without FMA contraction).
///
/// The diagonal is checked up to rounding. It is a running average of sums of squares, and
/// every statistic sums nonnegative terms (exactly >= 0 in floating point); files written by
/// earlier versions hold factors from a stride-1 conv statistic that subtracted border sums
/// from a whole-image sum (shifted_patch_gram.hpp replaced it): where a tap's window sums to about 0 the result is the rounding
/// error of that difference, of order √K·u·s for K summed products in the probabilistic
/// model of rounding (Higham and Mary, SISC 2019), u the unit roundoff and s the largest
/// diagonal entry, which bounds every |F(i, j)| of a covariance. −√u·s allows K up to 1/u
/// (1.7e7 products in float, e.g. 256 images of 256 × 256 pixels) and refuses anything that
/// is negative beyond rounding: a sign flipped on an entry larger than √u·s, or a value
/// that no sum of squares gives.
[[nodiscard]] inline std::string factor_fault(const tensor& t, factor_structure structure, std::int64_t cols) {
    using value_detail::element;
    using value_detail::number;
    if (auto fault = non_finite_fault(t, cols); !fault.empty()) return fault;
    const auto n = static_cast<std::size_t>(t.elements());
    const auto c = static_cast<std::size_t>(cols);
    if (structure == factor_structure::identity) {
        if (n != 1 || element(t, 0) != 1.0)
            return "holds " + number(n == 0 ? 0.0 : element(t, 0)) + ", not the 1 x 1 identity it stands for";
        return {};
    }
    // The diagonal entries' indices: (k, k) of a dense matrix, every entry of a diagonal one,
    // columns 0 and 2 (F_γγ, F_ββ) of unit-wise blocks, whose column 1 (F_γβ) is off-diagonal.
    std::vector<std::size_t> diagonal;
    if (structure == factor_structure::dense)
        for (std::size_t k = 0; k < c; ++k) diagonal.push_back(k * c + k);
    else
        for (std::size_t k = 0; k < n; ++k)
            if (structure == factor_structure::diagonal || k % c != 1) diagonal.push_back(k);
    double largest = 0.0;
    for (const auto k : diagonal) largest = std::max(largest, element(t, k));
    const double floor = -std::sqrt(value_detail::unit_roundoff(t)) * largest;
    for (const auto k : diagonal)
        if (element(t, k) < floor)
            return "has a negative diagonal entry, " + number(element(t, k)) + " at " + value_detail::position(t, k, cols) +
                   " (a covariance's diagonal is >= 0; rounding allows " + number(floor) + " here)";
    if (structure != factor_structure::dense) return {};
    const auto [i, j] = dtype_size(t.type) == 2 ? value_detail::first_asymmetry<std::uint16_t>(t, c)
                        : t.type == dtype::f32  ? value_detail::first_asymmetry<std::uint32_t>(t, c)
                                                : value_detail::first_asymmetry<std::uint64_t>(t, c);
    if (i == j) return {};
    return "is not symmetric: (" + std::to_string(i) + ", " + std::to_string(j) + ") = " + number(element(t, i * c + j)) +
           " but (" + std::to_string(j) + ", " + std::to_string(i) + ") = " + number(element(t, j * c + i));
}

/// What is wrong with `t` as data of a `Scalar` preconditioner, or "": a finite double beyond
/// the range of float would load as ±Inf.
template <class Scalar>
[[nodiscard]] std::string range_fault(const tensor& t, std::int64_t cols) {
    if (t.type != dtype::f64 || sizeof(Scalar) >= sizeof(double)) return {};
    const auto n = static_cast<std::size_t>(t.elements());
    for (std::size_t i = 0; i < n; ++i) {
        const double v = value_detail::element(t, i);
        if (!std::isfinite(static_cast<Scalar>(v)))
            return "holds " + value_detail::number(v) + " at " + value_detail::position(t, i, cols) +
                   ", beyond the range of float; load it into a double preconditioner";
    }
    return {};
}

}  // namespace kfac::checkpoint
