// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file damping_terms.hpp
/// Where a layer's damping goes: added to each factor's eigenvalues (or diagonal, before an
/// inverse) and to the product of the eigenvalues, per options.damping_mode and
/// options.relative_damping (docs/curvature-modes.md). One formula serves both compute
/// methods: the preconditioner inverts, in each eigendirection (i, j) of A ⊗ G,
///   (λ_A,i + a)(λ_G,j + g) + product.
/// The reference damping is {0, 0, γ} under the eigen method (1/(λ_A λ_G + γ), kfac-pytorch's)
/// and {γ, γ, 0} under the inverse method ((A + γI)⁻¹ ⊗ (G + γI)⁻¹); factored damping is
/// {π√γ, √γ/π, 0} under both (Martens & Grosse 2015, §6.3). A unit-wise block's G is the
/// identity, neither estimated nor damped: its terms are {0, 0, γ} or {γ, 0, 0}.

#include <cmath>

#include "kfac/detail/compute_impl.hpp"
#include "kfac/options.hpp"

namespace kfac::detail {

struct damping_terms {
    double a = 0.0;        ///< added to A's eigenvalues (eigen method) or diagonal (inverse method)
    double g = 0.0;        ///< likewise for G
    double product = 0.0;  ///< added to the product λ_A λ_G (eigen method)
    [[nodiscard]] double of(factor_side side) const noexcept { return side == factor_side::a ? a : g; }
};

/// Whether the damping depends on the factors (their mean eigenvalues must then be read).
[[nodiscard]] inline bool damping_reads_factors(const options& o) noexcept {
    return o.relative_damping || o.damping_mode == damping_form::factored;
}

/// The terms for the damping γ of this step, from the running factors' mean eigenvalues
/// m_A = tr(A)/dim A and m_G = tr(G)/dim G (read only when damping_reads_factors(o)).
/// `estimated_g`: false for a unit-wise block. Relative damping uses γ·m_A·m_G, or γ itself
/// when that product is not a positive number (a layer whose inputs or gradients were all 0);
/// π falls back to 1 likewise.
[[nodiscard]] inline damping_terms damping_terms_of(const options& o, bool eigen, bool estimated_g, double gamma,
                                                    double mean_a, double mean_g) {
    if (!estimated_g) mean_g = 1.0;
    const double scale = mean_a * mean_g;
    const double damping = o.relative_damping && std::isfinite(scale) && scale > 0.0 ? gamma * scale : gamma;
    if (o.damping_mode == damping_form::factored && estimated_g) {
        const double ratio = mean_a / mean_g;
        const double pi = std::isfinite(ratio) && ratio > 0.0 ? std::sqrt(ratio) : 1.0;
        const double root = std::sqrt(damping);
        return {pi * root, root / pi, 0.0};
    }
    if (eigen) return {0.0, 0.0, damping};
    return {damping, estimated_g ? damping : 0.0, 0.0};
}

}  // namespace kfac::detail
