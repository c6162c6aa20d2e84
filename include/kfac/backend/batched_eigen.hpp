// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file batched_eigen.hpp
/// The optional backend members that decompose many small factors at once. A depthwise
/// convolution of C channels is C blocks of a few rows each; decomposing them one call at a
/// time costs a solver launch and a host synchronisation apiece. Before an inverse update of the
/// eigen method the preconditioner hands such a backend every dense factor it is about to
/// decompose; the backend may decompose any of them (same sizes together, say) and keep the
/// results, which its symmetric_eigen() then returns for that factor instead of solving it
/// again. The preconditioner clears what is left after the update, whatever happened in it.
///
/// ```
///   // May decompose any of the factors now; symmetric_eigen(*factors[i], ...) then returns
///   // the kept result. Same results as symmetric_eigen up to the solver's rounding.
///   static void prefetch_symmetric_eigen(const std::vector<const matrix*>& factors);
///   static void clear_prefetched_eigen() noexcept;   // forget what was not asked for
/// ```
///
/// Only with options.eigenbasis_reuse_tolerance = 0: a kept basis would make a prefetched
/// decomposition wasted work. A backend may keep its results in
/// backend::detail::prefetched_eigen (kfac/backend/detail/prefetched_eigen.hpp), as
/// backend::cuda does.

#include <concepts>
#include <vector>

#include "kfac/backend/detail/prefetched_eigen.hpp"

namespace kfac::detail {

template <class B>
concept backend_with_batched_eigen = requires(const std::vector<const typename B::matrix*>& factors) {
    B::prefetch_symmetric_eigen(factors);
    B::clear_prefetched_eigen();
};

}  // namespace kfac::detail
