// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cpu_unit_wise.hpp
/// The CPU backend's unit-wise blocks of normalisation layers (the members of
/// kfac/backend/unit_wise_factors.hpp; kfac::backend::cpu_eigen derives from it): their
/// statistic from x̂ and dy, identity, closed-form damped inverse, scaling, averaging and
/// product with the gradient.

#include <cstdint>

#include <Eigen/Core>

#include "kfac/backend/detail/cpu_statistics.hpp"
#include "kfac/detail/statistics_views.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::backend::detail {

template <class Scalar>
struct cpu_unit_wise {
    using index = std::int64_t;
    using matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
    using workspace = cpu_workspace<Scalar>;

    // Unit-wise blocks of normalisation layers (kfac/backend/unit_wise_factors.hpp): C rows,
    // columns F_γγ, F_γβ, F_ββ (F_γγ alone without shift).

    /// sum = beta·sum + (1/R) Σ_rows (t_γ², t_γ t_β, t_β²) per channel, t_γ = Σ x̂ ⊙ dy and
    /// t_β = Σ dy over the row's positions (norm_layout). One example at a time: its C × P
    /// block of x̂ ⊙ dy goes through ws.products.
    static void accumulate_unit_wise_statistic(matrix& sum, const layer_description& d, tensor_view<const Scalar> x,
                                               tensor_view<const Scalar> dy, Scalar beta, workspace& ws) {
        using channel_sums = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
        using block = Eigen::Array<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
        using channels_last = Eigen::Map<const block>;  // C × P, column p the position's channels
        using channels_first = Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
        const auto layout = kfac::detail::norm_layout_of(d, x);
        const index c = layout.channels, p = layout.positions;
        const bool shift = d.bias;
        channel_sums gg = channel_sums::Zero(c), gb = channel_sums::Zero(c), bb = channel_sums::Zero(c);
        ws.products.resize(static_cast<std::size_t>(c * p));
        Eigen::Map<block> u(ws.products.data(), c, p);
        auto fold = [&](const auto& xn, const auto& dyn) {
            u = xn * dyn;  // x̂ ⊙ dy, channels × positions
            if (layout.sum_positions) {
                const channel_sums t_gamma = u.rowwise().sum(), t_beta = dyn.rowwise().sum();
                gg += t_gamma.square();
                if (shift) {
                    gb += t_gamma * t_beta;
                    bb += t_beta.square();
                }
            } else {
                gg += u.square().rowwise().sum();
                if (shift) {
                    gb += (u * dyn).rowwise().sum();
                    bb += dyn.square().rowwise().sum();
                }
            }
        };
        for (index n = 0; n < layout.examples; ++n) {
            const Scalar* xn = x.data + n * c * p;
            const Scalar* dyn = dy.data + n * c * p;
            if (layout.channels_last) fold(channels_last(xn, c, p), channels_last(dyn, c, p));
            else fold(channels_first(xn, c, p), channels_first(dyn, c, p));
        }
        const Scalar alpha = Scalar(1) / static_cast<Scalar>(layout.rows());
        auto add = [&](index column, const channel_sums& s) {  // β = 0 reads nothing of sum
            if (beta == Scalar(0)) sum.col(column) = (alpha * s).matrix();
            else sum.col(column) = beta * sum.col(column) + (alpha * s).matrix();
        };
        add(0, gg);
        if (shift) {
            add(1, gb);
            add(2, bb);
        }
    }

    /// Every block the k × k identity: columns (1, 0, 1) for k = 2, (1) for k = 1.
    static matrix unit_wise_identity(index channels, index k) {
        matrix m = matrix::Zero(channels, k * (k + 1) / 2);
        m.col(0).setOnes();
        if (k == 2) m.col(2).setOnes();
        return m;
    }

    /// (F_c + γI)⁻¹ in closed form: [[F_ββ + γ, −F_γβ], [−F_γβ, F_γγ + γ]] / det, with
    /// det = (F_γγF_ββ − F_γβ²) + γ(F_γγ + F_ββ) + γ². The first term is det F ≥ 0 for the PSD
    /// F_c (a mean of t tᵀ), which rounding may leave slightly negative: clamped at 0, so det
    /// stays ≥ γ(tr F + γ) > 0 and the relative error of each entry is a few roundings.
    static bool unit_wise_damped_inverse(const matrix& blocks, Scalar damping, matrix& out) {
        out.resize(blocks.rows(), blocks.cols());
        if (blocks.cols() == 1) {
            out.col(0) = (blocks.col(0).array() + damping).inverse().matrix();
            return out.allFinite();
        }
        const auto f_gg = blocks.col(0).array(), f_gb = blocks.col(1).array(), f_bb = blocks.col(2).array();
        const auto det = (f_gg * f_bb - f_gb.square()).max(Scalar(0)) + damping * (f_gg + f_bb) + damping * damping;
        out.col(0) = ((f_bb + damping) / det).matrix();
        out.col(1) = (-f_gb / det).matrix();
        out.col(2) = ((f_gg + damping) / det).matrix();
        return out.allFinite();
    }

    static void scale_blocks(matrix& blocks, Scalar s) { blocks *= s; }
    static void average_blocks(matrix& F, const matrix& sum, Scalar decay, Scalar weight) { F = decay * F + weight * sum; }

    /// P_t(:, c) = B_c Γᵀ(:, c): row 0 the scale, row 1 the shift.
    static void unit_wise_multiply(const matrix& blocks, const matrix& gamma_t, matrix& p_t) {
        p_t.resize(gamma_t.rows(), gamma_t.cols());
        const auto b_gg = blocks.col(0).transpose().array();
        if (blocks.cols() == 1) {
            p_t.row(0) = (b_gg * gamma_t.row(0).array()).matrix();
            return;
        }
        const auto b_gb = blocks.col(1).transpose().array(), b_bb = blocks.col(2).transpose().array();
        const auto g_scale = gamma_t.row(0).array(), g_shift = gamma_t.row(1).array();
        p_t.row(0) = (b_gg * g_scale + b_gb * g_shift).matrix();
        p_t.row(1) = (b_gb * g_scale + b_bb * g_shift).matrix();
    }
};

}  // namespace kfac::backend::detail
