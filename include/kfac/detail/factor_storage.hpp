// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file factor_storage.hpp
/// options.factor_storage: the running factors kept between steps in bf16 or fp16 (half the
/// bytes of float), widened to the backend's type for each use.
///
/// A packed factor is rounded once to nearest when the update that makes it is stored; every
/// later use (the decomposition, the next update, a checkpoint, a_factor()) reads exactly
/// those values, as kfac-pytorch does with factors of factor_dtype bfloat16. fp16's range is
/// narrow (6·10⁻⁸ to 65504), so an fp16 factor holds F·2^-k with the power of two k chosen
/// from its largest magnitude M, k = ⌈log₂ M⌉ − 15: the largest entry lands in [2^14, 2^15],
/// scaling is exact, entries below M·2^-29 are subnormal (fewer digits) and below M·2^-40
/// flush to zero. That is harmless for an off-diagonal entry, which a covariance bounds by the
/// geometric mean of its two variances, but a variance (a diagonal entry) lost that way turns
/// a direction the factor knew into one it does not: (F + γI)⁻¹ there is 1/γ instead of
/// 1/(F_ii + γ). So a factor whose nonzero variances do not all land among fp16's normal
/// numbers (they span more than about 2^29) is stored in bf16 for that update instead, which
/// keeps float's range at 8 significant bits; the update counts it (health().storage_fallbacks)
/// and reports it (non_finite_source::factor_storage). bf16 has float's range: k = 0.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kfac/config.hpp"
#include "kfac/detail/number_conversion.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/precision.hpp"

namespace kfac::detail {

/// A factor in a 16-bit format, in the element order of the backend's matrix.
struct packed_factor {
    std::vector<std::uint16_t> bits;
    std::int64_t rows = 0, cols = 0;
    int exponent = 0;  ///< the stored values are F·2^-exponent (fp16; 0 for bf16)
    /// The bits' format: options.factor_storage's, or bf16 where fp16 would lose a variance.
    precision format = precision::bf16;
    [[nodiscard]] std::size_t bytes() const noexcept { return bits.size() * sizeof(std::uint16_t); }
};

/// The power of two an fp16 factor is stored at (see the file comment); 0 for bf16, for an
/// all-zero factor and for one with a non-finite entry (which packs as such).
[[nodiscard]] inline int storage_exponent(const double* values, std::size_t n, precision format) {
    if (format != precision::fp16) return 0;
    double largest = 0.0;
    for (std::size_t i = 0; i < n; ++i) largest = std::max(largest, std::abs(values[i]));
    if (largest == 0.0 || !std::isfinite(largest)) return 0;
    return static_cast<int>(std::ceil(std::log2(largest))) - 15;
}

/// Whether some nonzero variance of a factor (its diagonal entries as `structure` stores them,
/// column-major `rows` × `cols`) is below fp16's smallest normal 2^-14 once scaled by
/// 2^-exponent: fp16 would flush it or keep it with fewer digits (see the file comment).
[[nodiscard]] inline bool loses_a_variance(const double* values, std::int64_t rows, std::int64_t cols,
                                           factor_structure structure, int exponent) {
    const auto below_normal = [&](std::int64_t k) {
        const double v = std::abs(values[k]);
        return v != 0.0 && std::ldexp(v, -exponent) < 0x1p-14;
    };
    if (structure == factor_structure::dense) {
        for (std::int64_t k = 0; k < std::min(rows, cols); ++k)
            if (below_normal(k + k * rows)) return true;
        return false;
    }
    for (std::int64_t k = 0; k < rows * cols; ++k) {
        const bool variance = structure != factor_structure::unit_wise || cols != 3 || k / rows != 1;  // (γγ, γβ, ββ)
        if (variance && below_normal(k)) return true;
    }
    return false;
}

/// `values` packed in `format` at its storage exponent.
[[nodiscard]] inline packed_factor pack_values(std::vector<double> values, std::int64_t rows, std::int64_t cols,
                                               precision format) {
    packed_factor p;
    p.rows = rows;
    p.cols = cols;
    p.format = format;
    const auto n = values.size();
    p.exponent = storage_exponent(values.data(), n, format);
    if (p.exponent != 0)
        for (double& v : values) v = std::ldexp(v, -p.exponent);  // exact: a power of two
    p.bits.resize(n);
    narrow(values.data(), static_cast<std::int64_t>(n), format, p.bits.data());
    return p;
}

/// The packed values widened into doubles (exact).
[[nodiscard]] inline std::vector<double> packed_values(const packed_factor& p) {
    std::vector<double> v(p.bits.size());
    widen(p.bits.data(), static_cast<std::int64_t>(p.bits.size()), p.format, v.data());
    if (p.exponent != 0)
        for (double& x : v) x = std::ldexp(x, p.exponent);
    return v;
}

template <class HostMatrix>
[[nodiscard]] std::vector<double> values_of(const HostMatrix& F) {
    std::vector<double> values(static_cast<std::size_t>(F.size()));
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>(F.data()[i]);
    return values;
}

/// F (a host matrix of float or double) packed in `format`, rounded once; in bf16 where fp16
/// would lose one of its variances (`fell_back` then says so).
template <class HostMatrix>
[[nodiscard]] packed_factor pack_factor(const HostMatrix& F, precision format, factor_structure structure,
                                        bool* fell_back = nullptr) {
    std::vector<double> values = values_of(F);
    if (fell_back) *fell_back = false;
    if (format == precision::fp16 &&
        loses_a_variance(values.data(), F.rows(), F.cols(), structure,
                         storage_exponent(values.data(), values.size(), precision::fp16))) {
        format = precision::bf16;
        if (fell_back) *fell_back = true;
    }
    return pack_values(std::move(values), F.rows(), F.cols(), format);
}

/// F packed without rounding where a 16-bit format holds it exactly: in `format`, else in bf16,
/// else as pack_factor() packs it. A loaded checkpoint's factors, recorded in their dtype, come
/// back as they were stored (kfac/checkpoint/format.hpp, to_packed_tensor()).
template <class HostMatrix>
[[nodiscard]] packed_factor pack_factor_exactly(const HostMatrix& F, precision format, factor_structure structure) {
    const std::vector<double> values = values_of(F);
    for (const precision f : {format, precision::bf16}) {
        packed_factor p = pack_values(values, F.rows(), F.cols(), f);
        if (packed_values(p) == values) return p;
    }
    return pack_factor(F, format, structure);
}

/// The packed factor widened (exactly) into a host matrix.
template <class HostMatrix>
[[nodiscard]] HostMatrix unpack_factor(const packed_factor& p) {
    using scalar = typename HostMatrix::Scalar;
    HostMatrix F(p.rows, p.cols);  // widened in place: no temporary the size of the factor
    widen(p.bits.data(), static_cast<std::int64_t>(p.bits.size()), p.format, F.data());
    if (p.exponent != 0)
        for (std::int64_t i = 0; i < F.size(); ++i) F.data()[i] = static_cast<scalar>(std::ldexp(F.data()[i], p.exponent));
    return F;
}

/// options.factor_storage must be a 16-bit format: anything else names the fix.
inline void check_factor_storage(precision p, precision compute) {
    if (p == precision::bf16 || p == precision::fp16 || p == compute) return;
    throw error(std::string("options.factor_storage = ") + precision_name(p) +
                " is not a storage kfac keeps factors in on a backend that computes in " + precision_name(compute) +
                ": use precision::bf16 or precision::fp16 (half of float's bytes), or leave it unset to keep the "
                "backend's type");
}

}  // namespace kfac::detail

namespace kfac::detail {

/// The running factors of one layer's state in options.factor_storage (std::nullopt: the
/// backend's matrices themselves, and every call here does nothing).
template <class Backend>
struct factor_storage {
    std::optional<precision> format;

    [[nodiscard]] bool packs() const noexcept { return format.has_value(); }

    /// Rounds the factors in the state's matrices into storage and releases the matrices. The
    /// structures say which entries are variances (pack_factor). Returns how many of the two
    /// fp16 kept in bf16 instead.
    template <class State>
    int store(State& s, factor_structure a, factor_structure g) const {
        if (!packs()) return 0;
        bool a_fell_back = false, g_fell_back = false;
        s.packed_a = pack_factor(Backend::to_host(s.a_factor), *format, a, &a_fell_back);
        s.packed_g = pack_factor(Backend::to_host(s.g_factor), *format, g, &g_fell_back);
        s.a_factor = typename Backend::matrix{};
        s.g_factor = typename Backend::matrix{};
        return (a_fell_back ? 1 : 0) + (g_fell_back ? 1 : 0);
    }
    /// store() of factors loaded from a checkpoint: exactly as the file records them where a
    /// 16-bit format holds them (pack_factor_exactly), so a resume continues bit for bit.
    template <class State>
    void store_loaded(State& s, factor_structure a, factor_structure g) const {
        if (!packs()) return;
        s.packed_a = pack_factor_exactly(Backend::to_host(s.a_factor), *format, a);
        s.packed_g = pack_factor_exactly(Backend::to_host(s.g_factor), *format, g);
        s.a_factor = typename Backend::matrix{};
        s.g_factor = typename Backend::matrix{};
    }
    /// The stored factors widened into the state's matrices, for a use that reads them.
    template <class State>
    void widen(State& s) const {
        if (!packs()) return;
        using host = typename Backend::host_matrix;
        s.a_factor = Backend::from_host(unpack_factor<host>(s.packed_a));
        s.g_factor = Backend::from_host(unpack_factor<host>(s.packed_g));
    }
    /// Releases the matrices widen() made (the stored factors are unchanged).
    template <class State>
    void release(State& s) const {
        if (!packs()) return;
        s.a_factor = typename Backend::matrix{};
        s.g_factor = typename Backend::matrix{};
    }
    /// One factor (a: true) as the backend's matrix, whichever way it is stored.
    template <class State>
    [[nodiscard]] typename Backend::matrix value(const State& s, bool a) const {
        if (!packs()) return a ? s.a_factor : s.g_factor;
        using host = typename Backend::host_matrix;
        return Backend::from_host(unpack_factor<host>(a ? s.packed_a : s.packed_g));
    }
    /// Bytes the state's factors take at rest.
    template <class State>
    [[nodiscard]] std::size_t bytes(const State& s) const {
        if (packs()) return s.packed_a.bytes() + s.packed_g.bytes();
        return static_cast<std::size_t>(s.a_factor.size() + s.g_factor.size()) * sizeof(typename Backend::scalar_type);
    }
};

}  // namespace kfac::detail
