// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file unit_wise.hpp
/// A normalisation layer's block (LayerNorm, BatchNorm): its curvature is not a Kronecker
/// product but one exact k × k block per channel c (k = 2 for scale and shift, 1 for scale
/// alone), F_c = mean over rows of t tᵀ, t = (Σ x̂ ⊙ dy, Σ dy) over the row's positions of the
/// channel (kfac-jax's ScaleAndShift blocks; the "unit-wise" Fisher of Osawa et al., ASDL).
/// A stores the C blocks as C × k(k+1)/2 (columns F_γγ, F_γβ, F_ββ), one statistic of x̂ and dy
/// together; G is the 1 × 1 identity, never estimated, so that both methods precondition each
/// channel's gradient by (F_c + γI)⁻¹: the eigen method keeps the blocks as their own
/// decomposition and inverts them with the step's damping (or, with the eigenvalue outer
/// product precomputed, the update's), the inverse method inverts them at the update.
/// The blocks are no triangle of a symmetric matrix, whatever their shape (C × 3 is square
/// for C = 3): they are checked, scaled and averaged entry by entry. The backend members this
/// block needs are kfac/backend/unit_wise_factors.hpp's.

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kfac/backend/unit_wise_factors.hpp"
#include "kfac/blocks/block.hpp"
#include "kfac/blocks/method_of.hpp"

namespace kfac::blocks {

/// A normalisation layer's block: one k × k block per channel in A, G the identity (above).
struct unit_wise {
    /// Whether a layer of description `d` is of this kind.
    static bool holds(const layer_description& d) { return is_normalization(d.kind); }
    /// The storage of a layer of this kind, from its description alone.
    static block_layout layout(const layer_description& d) {
        block_layout b;
        b.name = "unit-wise blocks";
        b.a_structure = factor_structure::unit_wise;
        b.g_structure = factor_structure::identity;
        b.a_rows = d.g_dim();                        // one row per channel
        b.a_cols = d.a_dim() * (d.a_dim() + 1) / 2;  // a k × k block's k(k+1)/2 entries
        b.g_dim = 1;
        b.placement = {static_cast<std::int64_t>(std::ceil(std::sqrt(static_cast<double>(b.a_rows * b.a_cols)))), 1};
        return b;
    }
    /// The kind's operations: a kfac::blocks::block on Backend under Method.
    template <class Backend, class Method>
    class ops;
};

template <class Backend, class Method>
class unit_wise::ops final : public block<Backend, Method> {
public:
    using base = block<Backend, Method>;  ///< the interface it implements
    ///@{
    /// The base's types (kfac::blocks::block).
    using typename base::factor_data;
    using typename base::layer_data;
    using typename base::matrix;
    using typename base::record;
    using typename base::scalar;
    using typename base::state;
    using typename base::statistics;
    using typename base::workspace;
    ///@}
    /// Whether Method computes eigendecompositions (else inverses).
    static constexpr bool eigen = under_eigendecomposition<Method>;
    /// Whether Backend has unit-wise factors (kfac/backend/unit_wise_factors.hpp); check_backend()
    /// refuses the layer without them.
    static constexpr bool supported = detail::backend_with_unit_wise_factors<Backend>;

    block_layout layout(const layer_description& d) const override { return unit_wise::layout(d); }

    void check_backend(const detail::named_layer& who, const layer_description& d) const override {
        if (!supported)
            throw detail::layer_error(who, std::string("this backend has no unit-wise factors "
                                                       "(kfac/backend/unit_wise_factors.hpp), which a ") +
                                               kind_name(d.kind) +
                                               "'s scale and shift need; use kfac::backend::cpu_eigen, or exclude the "
                                               "layer with options.skip_layers");
    }

    void start(state& s, const layer_description& d) const override {
        if constexpr (supported) s.a_factor = Backend::unit_wise_identity(d.g_dim(), d.a_dim());
        s.g_factor = Backend::identity(1);
    }
    void clear_statistic(statistics& s, const layer_description& d) const override {
        const block_layout b = unit_wise::layout(d);
        s.a_sum = Backend::zeros(b.a_rows, b.a_cols);
        s.g_sum = Backend::zeros(b.g_dim, b.g_dim);
    }

    /// One statistic of x̂ and dy together; G, the identity, has none.
    std::vector<detail::task> statistic_tasks(record& l, statistic_pass<scalar> pass) const override {
        std::vector<detail::task> tasks;
        if constexpr (supported)
            tasks.push_back(
                {pass.activation_elements * 3.0,
                 [&l, a = std::move(pass.activations), g = std::move(pass.output_gradients),
                  folded = pass.folded_before, scales = std::move(pass.scales)] {
                     for (std::size_t i = 0; i < a.size(); ++i)
                         fold_scaled(
                             scales.empty() ? 1.0 : scales[i].a, statistic_beta<scalar>(folded, i),
                             [&](scalar beta) {
                                 Backend::accumulate_unit_wise_statistic(l.statistics.a_sum, l.host.description, a[i],
                                                                         g[i], beta, l.scratch.a_ws);
                             },
                             [&](scalar f) { Backend::scale_blocks(l.statistics.a_sum, f); });
                 }});
        return tasks;
    }
    bool statistic_finite(const statistics& s) const override {
        return Backend::all_finite(s.a_sum) && Backend::lower_all_finite(s.g_sum);
    }
    void scale_statistic(statistics& s, scalar factor) const override {
        if constexpr (supported) Backend::scale_blocks(s.a_sum, factor);
        Backend::scale_symmetric(s.g_sum, factor);
    }
    bool a_statistic_is_triangle() const override { return false; }
    /// The blocks only: the identity G stays.
    void average(state& s, statistics& step, scalar decay, scalar weight) const override {
        if constexpr (supported) Backend::average_blocks(s.a_factor, step.a_sum, decay, weight);
    }

    double second_order_cost(const layer_description& d, factor_side side) const override {
        const block_layout b = unit_wise::layout(d);
        return side == factor_side::a ? static_cast<double>(b.a_rows * b.a_cols) : 1.0;
    }
    /// The blocks' mean eigenvalue: Σ_c tr F_c / (C·k), from the columns F_γγ (and F_ββ); G's is 1.
    std::pair<double, double> mean_eigenvalues(const state& s) const override {
        const auto& h = Backend::to_host(s.a_factor);
        const std::int64_t channels = h.rows(), k = h.cols() == 1 ? 1 : 2;
        if (channels == 0) return {0.0, 1.0};
        double trace = 0.0;
        for (std::int64_t c = 0; c < channels; ++c)
            trace += static_cast<double>(h(c, 0)) + (k == 2 ? static_cast<double>(h(c, 2)) : 0.0);
        return {trace / static_cast<double>(channels * k), 1.0};
    }
    bool estimates_g() const override { return false; }
    /// Each channel's k eigenvalues (a 2 × 2 block's in closed form); G's single 1.
    std::pair<std::vector<double>, std::vector<double>> spectra(const state& s) const override {
        const auto& h = Backend::to_host(s.a_factor);
        std::vector<double> a;
        for (std::int64_t c = 0; c < h.rows(); ++c) {
            const double p = static_cast<double>(h(c, 0));
            if (h.cols() == 1) {
                a.push_back(p);
                continue;
            }
            const double q = static_cast<double>(h(c, 1)), r = static_cast<double>(h(c, 2));
            const double centre = 0.5 * (p + r), radius = std::hypot(0.5 * (p - r), q);
            a.push_back(centre - radius);
            a.push_back(centre + radius);
        }
        return {std::move(a), std::vector<double>{1.0}};
    }

    bool compute(factor_side side, const matrix& F, double damping, const options&, const factor_data&,
                 factor_data& out) const override {
        if constexpr (eigen) {
            if (side == factor_side::g) {  // not estimated: Q = I, λ = 1
                out = Method::identity(F.rows());
                return true;
            }
            if (!Backend::all_finite(F)) return false;
            factor_data next;  // the blocks are their own decomposition
            next.lambda.resize(0);  // as prepare_receive shapes it: a default vector is 0 x 0 on backend::cuda
            next.blocks = F;
            out = std::move(next);
            return true;
        } else {
            matrix next;
            if (side == factor_side::g) {
                next = F;  // not estimated, not damped: its inverse is itself
            } else if constexpr (supported) {
                if (!Backend::unit_wise_damped_inverse(F, static_cast<scalar>(damping), next)) return false;
            } else {
                return false;  // not reached: check_backend refuses the layer on such a backend
            }
            out.inverse = std::move(next);
            out.diagonal = false;
            return true;
        }
    }
    bool counts_basis(factor_side) const override { return false; }
    /// Under the eigen method with the outer product precomputed: the blocks' damped inverses.
    /// A non-finite inverse zeroes the layer's gradient at precondition.
    void finalize(layer_data& l, double damping, const options& o) const override {
        if constexpr (eigen) {
            l.has_product = Method::keeps_product(o);
            if (!l.has_product) {
                l.inverse_eigen_product.resize(0, 0);
                return;
            }
            if constexpr (supported)
                Backend::unit_wise_damped_inverse(l.a.blocks, static_cast<scalar>(damping), l.inverse_eigen_product);
        }
    }
    void identity_data(layer_data& l, const layer_description& d, const detail::damping_terms& t,
                       const options& o) const override {
        const double damping = eigen ? t.product : t.a;
        if constexpr (eigen) {
            l.a.q = matrix{};
            l.a.lambda.resize(0);  // 0 x 1, as prepare_receive shapes it, on every backend
            if constexpr (supported) l.a.blocks = Backend::unit_wise_identity(d.g_dim(), d.a_dim());
            l.g.q = Backend::identity(1);
            l.g.lambda = Backend::ones(1);
            finalize(l, damping, o);
        } else {
            l.a.diagonal = false;
            if constexpr (supported)
                Backend::unit_wise_damped_inverse(Backend::unit_wise_identity(d.g_dim(), d.a_dim()),
                                                  static_cast<scalar>(damping), l.a.inverse);
            l.g.inverse = Backend::identity(1);
        }
    }
    void prepare_receive(layer_data& l, const layer_description& d, const options& o) const override {
        const block_layout b = unit_wise::layout(d);
        if constexpr (eigen) {
            l.has_product = Method::keeps_product(o);
            l.a.q.resize(0, 0);
            l.g.q.resize(1, 1);
            l.a.lambda.resize(0);
            l.a.blocks.resize(l.has_product ? 0 : b.a_rows, l.has_product ? 0 : b.a_cols);
            l.g.lambda.resize(l.has_product ? 0 : 1);
            // D shaped as the blocks are.
            l.inverse_eigen_product.resize(l.has_product ? b.a_rows : 0, l.has_product ? b.a_cols : 0);
        } else {
            l.a.diagonal = false;
            l.a.inverse.resize(b.a_rows, b.a_cols);
            l.g.inverse.resize(1, 1);
        }
    }
    void prepare_full(layer_data& l, const layer_description& d, const options& o) const override {
        prepare_receive(l, d, o);
        if constexpr (eigen) {
            const block_layout b = unit_wise::layout(d);
            l.a.blocks.resize(b.a_rows, b.a_cols);
            l.g.lambda.resize(1);
        }
    }

    /// An a_dim × a_dim product per channel, no G side.
    double precondition_cost(const layer_description& d) const override {
        const double n_a = static_cast<double>(d.a_dim()), n_g = static_cast<double>(d.g_dim());
        return n_a * n_a * n_g;
    }
    void load_gradient(record& l) const override {
        Backend::load_gradient(l.scratch.gamma, as_const(l.scratch.weight_gradient), as_const(l.scratch.bias_gradient));
    }
    void store_gradient(record& l, scalar scale) const override {
        Backend::store_gradient(l.scratch.preconditioned, scale, l.scratch.weight_gradient, l.scratch.bias_gradient);
    }
    /// P_t(:, c) = (F_c + γI)⁻¹ Γᵀ(:, c); a non-finite inverse makes P non-finite, and the layer is zeroed.
    void precondition(const layer_data& l, const matrix& gamma_t, double damping, const options&, workspace& w,
                      matrix& p_t) const override {
        if constexpr (!supported) {
            (void)l, (void)gamma_t, (void)damping, (void)w, (void)p_t;
        } else if constexpr (eigen) {
            const matrix* inverse = &l.inverse_eigen_product;
            if (!l.has_product) {
                Backend::unit_wise_damped_inverse(l.a.blocks, static_cast<scalar>(damping), w.t1);
                inverse = &w.t1;
            }
            Backend::unit_wise_multiply(*inverse, gamma_t, p_t);
        } else {
            Backend::unit_wise_multiply(l.a.inverse, gamma_t, p_t);
        }
    }
};

}  // namespace kfac::blocks
