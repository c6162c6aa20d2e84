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
/// scaling is exact, and entries below M·2^-39 flush to zero (the same relative floor as bf16's
/// precision would give them no digits anyway). bf16 has float's range: k = 0.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kfac/config.hpp"
#include "kfac/detail/number_conversion.hpp"
#include "kfac/precision.hpp"

namespace kfac::detail {

/// A factor in a 16-bit format, in the element order of the backend's matrix.
struct packed_factor {
    std::vector<std::uint16_t> bits;
    std::int64_t rows = 0, cols = 0;
    int exponent = 0;  ///< the stored values are F·2^-exponent (fp16; 0 for bf16)
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

/// F (a host matrix of float or double) packed in `format`.
template <class HostMatrix>
[[nodiscard]] packed_factor pack_factor(const HostMatrix& F, precision format) {
    packed_factor p;
    p.rows = F.rows();
    p.cols = F.cols();
    const auto n = static_cast<std::size_t>(F.size());
    std::vector<double> values(n);
    for (std::size_t i = 0; i < n; ++i) values[i] = static_cast<double>(F.data()[i]);
    p.exponent = storage_exponent(values.data(), n, format);
    if (p.exponent != 0)
        for (double& v : values) v = std::ldexp(v, -p.exponent);  // exact: a power of two
    p.bits.resize(n);
    narrow(values.data(), static_cast<std::int64_t>(n), format, p.bits.data());
    return p;
}

/// The packed factor widened (exactly) into a host matrix.
template <class HostMatrix>
[[nodiscard]] HostMatrix unpack_factor(const packed_factor& p, precision format) {
    using scalar = typename HostMatrix::Scalar;
    HostMatrix F(p.rows, p.cols);
    widen(p.bits.data(), static_cast<std::int64_t>(p.bits.size()), format, F.data());
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

    /// Rounds the factors in the state's matrices into storage and releases the matrices.
    template <class State>
    void store(State& s) const {
        if (!packs()) return;
        s.packed_a = pack_factor(Backend::to_host(s.a_factor), *format);
        s.packed_g = pack_factor(Backend::to_host(s.g_factor), *format);
        s.a_factor = typename Backend::matrix{};
        s.g_factor = typename Backend::matrix{};
    }
    /// The stored factors widened into the state's matrices, for a use that reads them.
    template <class State>
    void widen(State& s) const {
        if (!packs()) return;
        using host = typename Backend::host_matrix;
        s.a_factor = Backend::from_host(unpack_factor<host>(s.packed_a, *format));
        s.g_factor = Backend::from_host(unpack_factor<host>(s.packed_g, *format));
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
        return Backend::from_host(unpack_factor<host>(a ? s.packed_a : s.packed_g, *format));
    }
    /// Bytes the state's factors take at rest.
    template <class State>
    [[nodiscard]] std::size_t bytes(const State& s) const {
        if (packs()) return s.packed_a.bytes() + s.packed_g.bytes();
        return static_cast<std::size_t>(s.a_factor.size() + s.g_factor.size()) * sizeof(typename Backend::scalar_type);
    }
};

}  // namespace kfac::detail
