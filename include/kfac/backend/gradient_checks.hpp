// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file gradient_checks.hpp
/// The optional backend member that checks every layer's gradient at once: a device backend
/// whose checks make the host wait (backend::cuda) answers them all with one synchronisation
/// instead of three per layer. The preconditioner then preconditions a non-finite Γ like any
/// other (its P is caught here with it, and the layer is zeroed on every rank as before) and
/// takes kl_clip's Σ⟨P, Γ⟩ from the dots returned. A backend without it checks layer by layer
/// (all_finite, frobenius_dot).
///
/// ```
///   // For each i: non_finite[i] = the non-finite entries of gammas[i] and ps[i] together;
///   // dots[i] = ⟨ps[i], gammas[i]⟩ accumulated in double (meaningful when non_finite[i] = 0).
///   static void gradient_checks(const std::vector<const matrix*>& gammas,
///                               const std::vector<const matrix*>& ps,
///                               std::vector<std::int64_t>& non_finite, std::vector<double>& dots);
/// ```

#include <concepts>
#include <cstdint>
#include <vector>

namespace kfac::detail {

template <class B>
concept backend_with_gradient_checks =
    requires(const std::vector<const typename B::matrix*>& m, std::vector<std::int64_t>& n, std::vector<double>& d) {
        B::gradient_checks(m, m, n, d);
    };

}  // namespace kfac::detail
