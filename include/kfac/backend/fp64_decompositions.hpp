// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file fp64_decompositions.hpp
/// Optional backend capability: a float backend's eigendecomposition and damped inverse done
/// in double (the factor widened exactly, the result rounded once to the backend's type).
/// It serves options.fp64_decompositions (every decomposition in double) and
/// options.fp64_retry (a failed one retried in double, Distributed Shampoo's rule):
///
/// ```
///   static bool symmetric_eigen_fp64(const matrix& M, matrix& Q, vector& lambda);
///   static bool damped_inverse_fp64(const matrix& M, double damping, matrix& inverse);
/// ```
///
/// A double backend decomposes in double already: neither option changes what it does.

#include <concepts>
#include <type_traits>

#include "kfac/options.hpp"

namespace kfac::backend {

/// Whether backend B has the two members above.
template <class B>
concept backend_with_fp64_decompositions =
    requires(const typename B::matrix& m, typename B::matrix& q, typename B::vector& lambda, double damping) {
        { B::symmetric_eigen_fp64(m, q, lambda) } -> std::same_as<bool>;
        { B::damped_inverse_fp64(m, damping, q) } -> std::same_as<bool>;
    };

}  // namespace kfac::backend

namespace kfac::detail {

/// Whether the backend computes below double and can decompose in double.
template <class Backend>
inline constexpr bool decomposes_below_fp64 =
    backend::backend_with_fp64_decompositions<Backend> && !std::is_same_v<typename Backend::scalar_type, double>;

/// F's eigendecomposition as the options ask: in double with fp64_decompositions, else in
/// the backend's type, retried once in double when that fails and fp64_retry is on
/// (`retried` says so, whatever the retry's outcome).
template <class Backend>
bool symmetric_eigen_as_asked(const typename Backend::matrix& F, typename Backend::matrix& q,
                              typename Backend::vector& lambda, const options& o, bool& retried) {
    retried = false;
    if constexpr (decomposes_below_fp64<Backend>) {
        if (o.fp64_decompositions) return Backend::symmetric_eigen_fp64(F, q, lambda);
        if (Backend::symmetric_eigen(F, q, lambda)) return true;
        if (!o.fp64_retry) return false;
        retried = true;
        return Backend::symmetric_eigen_fp64(F, q, lambda);
    } else {
        return Backend::symmetric_eigen(F, q, lambda);
    }
}

/// (F + damping·I)⁻¹ as the options ask (see symmetric_eigen_as_asked).
template <class Backend>
bool damped_inverse_as_asked(const typename Backend::matrix& F, double damping, typename Backend::matrix& inverse,
                             const options& o, bool& retried) {
    using scalar = typename Backend::scalar_type;
    retried = false;
    if constexpr (decomposes_below_fp64<Backend>) {
        if (o.fp64_decompositions) return Backend::damped_inverse_fp64(F, damping, inverse);
        if (Backend::damped_inverse(F, static_cast<scalar>(damping), inverse)) return true;
        if (!o.fp64_retry) return false;
        retried = true;
        return Backend::damped_inverse_fp64(F, damping, inverse);
    } else {
        return Backend::damped_inverse(F, static_cast<scalar>(damping), inverse);
    }
}

}  // namespace kfac::detail
