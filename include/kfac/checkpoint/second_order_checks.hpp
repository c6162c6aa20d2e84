// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file second_order_checks.hpp
/// The second-order data a checkpoint holds (eigendecompositions, damped inverses), checked on
/// load against what every save() of it satisfies, before anything is set. Finite values are
/// not enough: an edited file whose eigenvalue-product inverse is negated reverses the next
/// step's gradient, and eigenvectors scaled by 10⁶ multiply it by 10¹².
///
/// Each compute method says what its tensors are (loaded_fault() in kfac/compute/*.hpp); the
/// checks here are the properties, each one that save() writes by construction, with the
/// rounding every legitimate file carries allowed for and nothing more:
///   eigenvalues            >= 0, exactly: decompositions clamp them at 0
///   eigenvectors           orthonormal columns, in the two necessary conditions an O(n²) pass
///                          can check (below)
///   eigenvalue products    D(i, j) = 1/(λ_A,i λ_G,j + p), p the product term of the damping
///                          (kfac/detail/damping_terms.hpp): positive, and that formula within
///                          rounding
///   damped inverses        positive diagonal (a positive definite matrix's diagonal is positive)
///   unit-wise blocks       positive diagonal; a scale-only block's 1/(F + γ) as for D
/// The unit roundoff u allowed for is the coarsest precision the data went through (the saving
/// preconditioner's type, the tensor's dtype, the loading preconditioner's type).
///
/// What is not checked, and why: a damped inverse's positive definiteness and symmetry beyond its
/// diagonal. An inverse computed in float from a factor of condition κ carries errors of order
/// κ·u, which for the κ of 10⁴ to 10⁶ K-FAC's damped factors reach can make its smallest
/// eigenvalues slightly negative, and its two triangles differ where the backend solves against
/// the identity (Eigen's LLT, an LU fallback): a file save() wrote would be refused.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kfac/checkpoint/safetensors.hpp"
#include "kfac/checkpoint/value_checks.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/precision.hpp"

namespace kfac::checkpoint {

/// One layer's second-order data as a checkpoint holds it, and what the checks need besides.
struct loaded_second_order {
    /// The method's tensor of that name (for_each_tensor's, without the layer: "A.eigenvectors"),
    /// or nullptr when the file holds none (an empty one, or one the options leave out).
    std::function<const tensor*(const char* name)> tensor_named;
    ///@{
    /// How the layer's A and G factors are stored (its block's layout).
    factor_structure a_structure = factor_structure::dense;
    factor_structure g_structure = factor_structure::dense;
    ///@}
    double damping = 0.0;           ///< γ the data was computed with (second_order_damping)
    bool relative_damping = false;  ///< the file's options.relative_damping: γ scaled per layer
    bool factored_damping = false;  ///< the file's options.damping_mode: factored
    double unit_roundoff = 0.0;     ///< of the coarser of the saving and loading types

    /// The layer's damping γ_l (a·g + p of its terms, one number for both forms), when the file
    /// determines it: γ itself unless relative damping scaled it by the layer's mean eigenvalues.
    [[nodiscard]] std::optional<double> layer_damping() const {
        return relative_damping ? std::nullopt : std::optional<double>(damping);
    }
};

/// A tensor found wrong: its name (the method's) and what is wrong with it.
struct second_order_fault {
    std::string tensor;  ///< the tensor's name, the method's ("A.eigenvectors")
    std::string what;    ///< what is wrong with it; empty when nothing is
    /// Whether a fault was found.
    [[nodiscard]] explicit operator bool() const noexcept { return !what.empty(); }
};

namespace second_order_detail {

/// The unit roundoff allowed for `t`: the context's, or the tensor's dtype's when coarser.
[[nodiscard]] inline double roundoff(const tensor& t, double u) {
    return std::max(u, kfac::unit_roundoff(precision_of_dtype(t.type)));
}

/// Rounding allowed in an elementwise formula: four roundings in the backend's type (γ cast to
/// it, the product, the sum, the reciprocal) and three more when the file crosses precisions
/// (each of D, λ_A and λ_G rounded once more on load): 7u, taken as 16u.
[[nodiscard]] inline double elementwise_tolerance(double u) { return 16.0 * u; }

[[nodiscard]] inline std::string text(double v) { return value_detail::number(v); }

}  // namespace second_order_detail

/// Eigenvalues: every entry >= 0 (decompose() clamps them at 0, and a diagonal factor's are
/// its diagonal, a sum of squares).
[[nodiscard]] inline std::string negative_eigenvalue_fault(const tensor& t) {
    const std::vector<double> v = t.values<double>();
    for (std::size_t i = 0; i < v.size(); ++i)
        if (v[i] < 0.0)
            return "holds " + second_order_detail::text(v[i]) + " at [" + std::to_string(i) +
                   "]; eigenvalues are >= 0 (decompositions clamp them at 0)";
    return {};
}

/// Eigenvectors (an n × n tensor whose columns are the vectors): orthonormal. A backward-stable
/// symmetric eigensolver returns ‖QᵀQ − I‖ within a modest multiple of n·u; LAPACK's own tests
/// accept its orthogonality residual ‖I − QᵀQ‖₁ below 30·n·ulp = 60·n·u (their THRESH), and
/// measured here (Eigen's solver and syevd, n = 2 to 1024, float and double) the largest entry
/// was 2.2·n·u. With ε = 60·n·u bounding ‖QᵀQ − I‖₂, two conditions follow that one O(n²) pass
/// checks, where forming QᵀQ would cost a decomposition's n³ flops at every load:
///   every column's squared norm is within ε of 1 (a diagonal entry of QᵀQ − I), and
///   ‖Qᵀ(Q x) − x‖₂ <= ε ‖x‖₂ for the fixed sign vector x_i = ±1 (any vector's bound).
/// A scaled, zeroed or foreign column fails the first; columns that overlap fail the second for
/// any x outside their difference's orthogonal complement, which a fixed ±1 pattern is.
[[nodiscard]] inline std::string orthonormality_fault(const tensor& t, double u) {
    if (t.shape.size() != 2 || t.shape[0] != t.shape[1]) return "is not square";
    const auto n = static_cast<std::size_t>(t.shape[0]);
    const std::vector<double> q = t.values<double>();  // C order: q[i·n + j] = Q(i, j)
    const double epsilon = 60.0 * static_cast<double>(n) * second_order_detail::roundoff(t, u);
    std::vector<double> norms(n, 0.0), x(n), qx(n, 0.0);
    for (std::size_t i = 0; i < n; ++i) x[i] = ((i * 2654435761u) >> 7) & 1u ? 1.0 : -1.0;
    for (std::size_t i = 0; i < n; ++i)
        for (std::size_t j = 0; j < n; ++j) {
            norms[j] += q[i * n + j] * q[i * n + j];
            qx[i] += q[i * n + j] * x[j];
        }
    for (std::size_t j = 0; j < n; ++j)
        if (!(std::abs(norms[j] - 1.0) <= epsilon))
            return "column " + std::to_string(j) + " has squared norm " + second_order_detail::text(norms[j]) +
                   "; eigenvectors are orthonormal (to within 60·n·u = " + second_order_detail::text(epsilon) + ")";
    double residual = 0.0;
    for (std::size_t j = 0; j < n; ++j) {
        double back = 0.0;  // (Qᵀ (Q x))_j
        for (std::size_t i = 0; i < n; ++i) back += q[i * n + j] * qx[i];
        residual += (back - x[j]) * (back - x[j]);
    }
    if (!(std::sqrt(residual) <= epsilon * std::sqrt(static_cast<double>(n))))
        return "has columns that are not orthogonal (‖Qᵀ Q x − x‖ = " + second_order_detail::text(std::sqrt(residual)) +
               " for a ±1 vector x of norm " + second_order_detail::text(std::sqrt(static_cast<double>(n))) +
               ", beyond 60·n·u of it)";
    return {};
}

/// Dᵀ = 1/(λ_A λ_Gᵀ + p) of a layer of dense or diagonal A (an A_dim × G_dim tensor), λ as
/// the file holds them: a decomposition adds the side's damping term to its eigenvalues, so
/// under factored damping λ = λ_F + a (or + g) and p = 0, and under the reference form p = γ_l.
/// Every entry is positive and equals that formula within rounding (elementwise_tolerance):
/// with p known (γ_l = γ, or 0), or under relative damping with p estimated from the entry of
/// the smallest λ_A λ_G, where the formula determines it best (its error there, about
/// 4u(λλ* + p), moves any other entry's product by at most 4u more: twice the tolerance).
/// Under factored damping with γ known, every entry is at most 1/γ too (λ_A λ_G >= a·g = γ),
/// which eigenvalues edited with their products would otherwise pass.
[[nodiscard]] inline std::string eigen_product_inverse_fault(const tensor& d, const tensor& lambda_a,
                                                             const tensor& lambda_g, const loaded_second_order& in) {
    using second_order_detail::text;
    const std::vector<double> la = lambda_a.values<double>(), lg = lambda_g.values<double>();
    if (d.shape.size() != 2 || static_cast<std::size_t>(d.shape[0]) != la.size() ||
        static_cast<std::size_t>(d.shape[1]) != lg.size())
        return "does not match the eigenvalues' lengths";
    const std::vector<double> v = d.values<double>();
    const double u = std::max({second_order_detail::roundoff(d, in.unit_roundoff),
                               second_order_detail::roundoff(lambda_a, in.unit_roundoff),
                               second_order_detail::roundoff(lambda_g, in.unit_roundoff)});
    const std::size_t rows = la.size(), cols = lg.size();
    auto at = [&](std::size_t i, std::size_t j) { return "(" + std::to_string(i) + ", " + std::to_string(j) + ")"; };
    for (std::size_t k = 0; k < v.size(); ++k)
        if (!(v[k] > 0.0))
            return "holds " + text(v[k]) + " at " + at(k / cols, k % cols) +
                   "; an inverse of damped eigenvalue products is positive";
    const std::optional<double> gamma = in.layer_damping();
    double product = 0.0, tau = second_order_detail::elementwise_tolerance(u);
    const char* source = "factored damping adds it to the eigenvalues";
    if (!in.factored_damping && gamma) {
        product = *gamma;
        source = "the damping it was computed with";
    } else if (!in.factored_damping && rows > 0 && cols > 0) {
        const auto i = static_cast<std::size_t>(std::min_element(la.begin(), la.end()) - la.begin());
        const auto j = static_cast<std::size_t>(std::min_element(lg.begin(), lg.end()) - lg.begin());
        product = 1.0 / v[i * cols + j] - la[i] * lg[j];
        tau *= 2.0;
        source = "from its entry of smallest λ_A λ_G, the damping being relative";
    }
    for (std::size_t i = 0; i < rows; ++i)
        for (std::size_t j = 0; j < cols; ++j) {
            const double x = v[i * cols + j];
            const double expected = 1.0 / (la[i] * lg[j] + product);
            if (!(std::abs(x / expected - 1.0) <= tau))
                return "holds " + text(x) + " at " + at(i, j) + " where 1/(λ_A λ_G + p) = " + text(expected) + " (p = " +
                       text(product) + ", " + source + "; rounding allows a relative difference of " + text(tau) + ")";
            if (in.factored_damping && gamma && x * *gamma > 1.0 + tau)
                return "holds " + text(x) + " at " + at(i, j) + ", above 1/γ = " + text(1.0 / *gamma) + " (γ = " +
                       text(*gamma) + ", the damping it was computed with)";
        }
    return {};
}

/// Damped inverses of unit-wise blocks (C rows of (B_γγ, B_γβ, B_ββ), or of B_γγ alone):
/// each block is positive definite, so its diagonal is positive; a scale-only block
/// 1/(F + γ_l), given its F (the eigen method keeps the blocks), is that within rounding, and
/// at most 1/γ_l when γ_l is known (F >= 0).
[[nodiscard]] inline std::string unit_block_inverse_fault(const tensor& t, const tensor* blocks,
                                                          const loaded_second_order& in) {
    using second_order_detail::text;
    if (t.shape.size() != 2 || (t.shape[1] != 1 && t.shape[1] != 3)) return "is not C x 1 or C x 3 blocks";
    const auto cols = static_cast<std::size_t>(t.shape[1]);
    const std::vector<double> v = t.values<double>();
    for (std::size_t k = 0; k < v.size(); ++k)
        if (k % cols != 1 && !(v[k] > 0.0))
            return "holds " + text(v[k]) + " at (" + std::to_string(k / cols) + ", " + std::to_string(k % cols) +
                   "), a diagonal entry of a damped block's inverse, which is positive";
    const std::optional<double> gamma = in.layer_damping();
    if (cols != 1 || !gamma) return {};
    const double tau = second_order_detail::elementwise_tolerance(std::max(
        second_order_detail::roundoff(t, in.unit_roundoff), blocks ? second_order_detail::roundoff(*blocks, in.unit_roundoff) : 0.0));
    const std::vector<double> f = blocks ? blocks->values<double>() : std::vector<double>{};
    for (std::size_t c = 0; c < v.size(); ++c) {
        const bool known = f.size() == v.size();
        const double bound = 1.0 / ((known ? f[c] : 0.0) + *gamma);
        if (known ? !(std::abs(v[c] / bound - 1.0) <= tau) : v[c] > bound * (1.0 + tau))
            return "holds " + text(v[c]) + " at (" + std::to_string(c) + ", 0) where 1/(F + γ) " + (known ? "= " : "<= ") +
                   text(bound) + " (γ = " + text(*gamma) + ")";
    }
    return {};
}

/// A diagonal factor's damped inverse, the vector 1/(F_ii + a): positive, and at most 1/γ
/// under the reference damping (a = γ_l; factored damping leaves a unknown).
[[nodiscard]] inline std::string diagonal_inverse_fault(const tensor& t, const loaded_second_order& in) {
    using second_order_detail::text;
    const std::vector<double> v = t.values<double>();
    const std::optional<double> gamma = in.factored_damping ? std::nullopt : in.layer_damping();
    const double tau = second_order_detail::elementwise_tolerance(second_order_detail::roundoff(t, in.unit_roundoff));
    for (std::size_t i = 0; i < v.size(); ++i) {
        if (!(v[i] > 0.0)) return "holds " + text(v[i]) + " at [" + std::to_string(i) + "]; 1/(F + γ) is positive";
        if (gamma && v[i] * *gamma > 1.0 + tau)
            return "holds " + text(v[i]) + " at [" + std::to_string(i) + "], above 1/γ = " + text(1.0 / *gamma);
    }
    return {};
}

/// A dense damped inverse (F + aI)⁻¹ (n × n): its diagonal is positive (see the file comment
/// for what is not checked).
[[nodiscard]] inline std::string dense_inverse_fault(const tensor& t) {
    if (t.shape.size() != 2 || t.shape[0] != t.shape[1]) return "is not square";
    const auto n = static_cast<std::size_t>(t.shape[0]);
    for (std::size_t i = 0; i < n; ++i) {
        const double x = t.element(i * n + i);
        if (!(x > 0.0))
            return "holds " + second_order_detail::text(x) + " at (" + std::to_string(i) + ", " + std::to_string(i) +
                   "); the diagonal of a damped factor's inverse, a positive definite matrix, is positive";
    }
    return {};
}

/// A unit-wise block's G, which is the identity and no estimated factor: its data is the 1 × 1
/// identity's (eigenvectors [1], eigenvalue [1], inverse [1]).
[[nodiscard]] inline std::string identity_data_fault(const tensor& t) {
    return factor_fault(t, factor_structure::identity, 1);
}

}  // namespace kfac::checkpoint
