// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file curvature_report.hpp
/// How much of each layer's preconditioner is curvature (preconditioner::curvature()): per
/// layer, the weight the identity start still has in the running factors, each factor's
/// eigenvalues, the damping, and the curvature share of the preconditioner.
///
/// In every eigendirection (i, j) of A ⊗ G the preconditioner multiplies the gradient by
/// 1/d_ij, d_ij = (λ_A,i + t_A)(λ_G,j + t_G) + t_P, where the damping terms t (kfac/detail/
/// damping_terms.hpp) are {0, 0, γ} for the reference eigen method, {γ, γ, 0} for the inverse
/// method, {π√γ, √γ/π, 0} for factored damping. The curvature share is the mean over the
/// directions of λ_A,i λ_G,j / d_ij: 1 when the factors dominate the damping everywhere (the
/// preconditioner is the inverse curvature), 0 when the damping does (the preconditioner is
/// the identity over the damping: K-FAC steps as SGD with a rescaled learning rate). Under
/// compute::ekfac, which divides by its scaling S + γ instead, scaling_share is the same mean
/// over S's entries.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace kfac {

/// The eigenvalues of one running factor, summarised. A unit-wise A counts each channel's
/// k × k block's k eigenvalues; a G that is not estimated (a normalisation layer's) is the
/// 1 × 1 identity.
struct factor_spectrum {
    std::int64_t dim = 0;  ///< the factor's dimension: how many eigenvalues
    ///@{
    /// Mean, smallest and largest eigenvalue, each clamped at 0; NaN when the decomposition failed.
    double mean = 0.0, min = 0.0, max = 0.0;
    ///@}
};

/// One registered layer on this rank.
struct layer_curvature {
    /// The layer's (or group block's) registered name.
    std::string name;
    /// Whether this rank keeps the layer's running factors (under DP-KFAC only its owner
    /// does); when false the rest is NaN.
    bool held = false;
    /// The weight the identity start keeps in the running factors: 1 − W under the reference
    /// averaging (Π ξ over the updates so far), 0 under bias-corrected averaging once a
    /// statistic is in (1 before). NaN: unknown (loaded from a checkpoint that predates it).
    double identity_weight = std::numeric_limits<double>::quiet_NaN();
    ///@{
    /// Eigenvalues of the running A and G factors.
    factor_spectrum a, g;
    ///@}
    /// m_A · m_G: the mean eigenvalue of A ⊗ G.
    double mean_product = std::numeric_limits<double>::quiet_NaN();
    /// γ at the current step and where an inverse update now would put it (t_A, t_G, t_P).
    double damping = std::numeric_limits<double>::quiet_NaN();
    ///@{
    /// The damping terms t_A, t_G and t_P an inverse update now would use.
    double damping_a = 0.0, damping_g = 0.0, damping_product = 0.0;
    ///@}
    /// Mean over the eigendirections of λ_A λ_G / ((λ_A + t_A)(λ_G + t_G) + t_P), in [0, 1].
    double curvature_share = std::numeric_limits<double>::quiet_NaN();
    /// Under compute::ekfac, the scaling S the gradient is divided by (as S + γ, in the
    /// eigenbasis): its A_dim·G_dim entries summarised, where this rank keeps it (the ranks that
    /// hold the layer's second-order data) once an inverse update has made it; dim 0 otherwise
    /// and under the other methods.
    factor_spectrum scaling;
    /// Under compute::ekfac, the mean over S's entries of S / (S + γ), in [0, 1]: the curvature
    /// share of the preconditioner EKFAC applies (curvature_share above is K-FAC's, from the
    /// same factors' eigenvalues). NaN where `scaling` is empty.
    double scaling_share = std::numeric_limits<double>::quiet_NaN();
};

namespace detail {

/// The summary of a factor's eigenvalues (each clamped at 0, as the preconditioner clamps them).
inline factor_spectrum summarise(const std::vector<double>& lambda) {
    factor_spectrum s;
    s.dim = static_cast<std::int64_t>(lambda.size());
    if (lambda.empty()) return s;
    if (!std::all_of(lambda.begin(), lambda.end(), [](double v) { return std::isfinite(v); })) {
        s.mean = s.min = s.max = std::numeric_limits<double>::quiet_NaN();
        return s;
    }
    double sum = 0.0;
    s.min = std::numeric_limits<double>::infinity();
    s.max = -s.min;
    for (double v : lambda) {
        const double c = std::max(v, 0.0);
        sum += c;
        s.min = std::min(s.min, c);
        s.max = std::max(s.max, c);
    }
    s.mean = sum / static_cast<double>(lambda.size());
    return s;
}

/// The curvature share of eigenvalues λ_A, λ_G (clamped at 0) under damping terms t_A, t_G, t_P.
inline double curvature_share(const std::vector<double>& lambda_a, const std::vector<double>& lambda_g, double t_a,
                              double t_g, double t_p) {
    if (lambda_a.empty() || lambda_g.empty()) return std::numeric_limits<double>::quiet_NaN();
    double sum = 0.0;
    for (double a : lambda_a)
        for (double g : lambda_g) {
            const double ca = std::max(a, 0.0), cg = std::max(g, 0.0);
            const double d = (ca + t_a) * (cg + t_g) + t_p;
            sum += d > 0.0 ? ca * cg / d : 0.0;
        }
    return sum / (static_cast<double>(lambda_a.size()) * static_cast<double>(lambda_g.size()));
}

/// EKFAC's curvature share: the mean over the scaling's entries (clamped at 0) of S / (S + γ).
inline double scaling_share(const std::vector<double>& scaling, double gamma) {
    if (scaling.empty()) return std::numeric_limits<double>::quiet_NaN();
    double sum = 0.0;
    for (double v : scaling) {
        const double c = std::max(v, 0.0), d = c + gamma;
        sum += d > 0.0 ? c / d : 0.0;
    }
    return sum / static_cast<double>(scaling.size());
}

}  // namespace detail
}  // namespace kfac
