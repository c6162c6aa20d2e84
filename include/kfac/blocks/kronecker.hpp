// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kronecker.hpp
/// The dense Kronecker pair F ≈ A ⊗ G of a Linear layer, a convolution or one group of a
/// grouped convolution (golden/README.md §4–6): A = mean of ã ãᵀ over the rows of the
/// activations (with a column of ones for the bias), G = mean of g gᵀ over the output
/// gradients' rows, both stored as dense symmetric matrices whose statistics are lower
/// triangles until they are averaged in.
///
/// Second-order data. Eigendecomposition: Q_A, λ_A, Q_G, λ_G (λ clamped at 0), the eigenvalue
/// outer product D = 1/(λ_A λ_Gᵀ + γ) when precomputed; Pᵀ = Q_A ((Q_Aᵀ Γᵀ Q_G) ⊘ (λ_A λ_Gᵀ + γ))
/// Q_Gᵀ. Inverse: (A + γI)⁻¹ and (G + γI)⁻¹; Pᵀ = A⁻ Γᵀ G⁻.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kfac/blocks/block.hpp"
#include "kfac/blocks/method_of.hpp"

namespace kfac::blocks {

/// The block of every layer but an Embedding and a normalisation layer: dense running factors
/// A and G, whose Kronecker product approximates the layer's curvature.
struct kronecker {
    /// Whether a layer of description `d` is of this kind.
    static bool holds(const layer_description& d) {
        return d.kind != layer_kind::embedding && !is_normalization(d.kind);
    }
    /// The storage of a layer of this kind, from its description alone.
    static block_layout layout(const layer_description& d) {
        block_layout b;
        b.name = "dense Kronecker pair";
        b.a_rows = b.a_cols = d.a_dim();
        b.g_dim = d.g_dim();
        b.placement = {d.a_dim(), d.g_dim()};
        return b;
    }
    /// The kind's operations: a kfac::blocks::block on Backend under Method.
    template <class Backend, class Method>
    class ops;
};

template <class Backend, class Method>
class kronecker::ops : public block<Backend, Method> {
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

    block_layout layout(const layer_description& d) const override { return kronecker::layout(d); }

    void check_backend(const detail::named_layer&, const layer_description&) const override {}

    void start(state& s, const layer_description& d) const override {
        s.a_factor = Backend::identity(d.a_dim());
        s.g_factor = Backend::identity(d.g_dim());
    }

    void clear_statistic(statistics& s, const layer_description& d) const override {
        const block_layout b = this->layout(d);
        s.a_sum = Backend::zeros(b.a_rows, b.a_cols);
        s.g_sum = Backend::zeros(b.g_dim, b.g_dim);
    }

    /// One task per factor. Cost ∝ rows of the product × n²: the input elements stand in for
    /// rows × n (n: the stored statistic's columns).
    std::vector<detail::task> statistic_tasks(record& l, statistic_pass<scalar> pass) const override {
        const layer_description block = l.host.description.group_block();
        const double n_a = static_cast<double>(this->layout(l.host.description).a_cols);
        const double n_g = static_cast<double>(l.host.description.g_dim());
        const std::int64_t folded = pass.folded_before;
        std::vector<detail::task> tasks;
        tasks.push_back({pass.activation_elements * n_a, [&l, a = std::move(pass.activations), block, folded,
                                                          patches = pass.patches, scales = pass.scales] {
                             for (std::size_t i = 0; i < a.size(); ++i)
                                 fold_scaled(
                                     scales.empty() ? 1.0 : scales[i].a, statistic_beta<scalar>(folded, i),
                                     [&](scalar beta) {
                                         Backend::accumulate_a_statistic(l.statistics.a_sum, block, a[i], patches, beta,
                                                                         l.scratch.a_ws);
                                     },
                                     [&](scalar f) { Backend::scale_symmetric(l.statistics.a_sum, f); });
                         }});
        tasks.push_back({pass.gradient_elements * n_g,
                         [&l, g = std::move(pass.output_gradients), block, folded, scales = std::move(pass.scales)] {
                             for (std::size_t i = 0; i < g.size(); ++i)
                                 fold_scaled(
                                     scales.empty() ? 1.0 : scales[i].g, statistic_beta<scalar>(folded, i),
                                     [&](scalar beta) {
                                         Backend::accumulate_g_statistic(l.statistics.g_sum, block, g[i], beta,
                                                                         l.scratch.g_ws);
                                     },
                                     [&](scalar f) { Backend::scale_symmetric(l.statistics.g_sum, f); });
                         }});
        return tasks;
    }

    bool statistic_finite(const statistics& s) const override {
        return Backend::lower_all_finite(s.a_sum) && Backend::lower_all_finite(s.g_sum);
    }
    void scale_statistic(statistics& s, scalar factor) const override {
        Backend::scale_symmetric(s.a_sum, factor);
        Backend::scale_symmetric(s.g_sum, factor);
    }
    bool a_statistic_is_triangle() const override { return true; }
    void average(state& s, statistics& step, scalar decay, scalar weight) const override {
        Backend::running_average(s.a_factor, step.a_sum, decay, weight);
        Backend::running_average(s.g_factor, step.g_sum, decay, weight);
    }

    /// The mean of a stored factor's diagonal (of its entries, for a diagonal factor's column),
    /// summed in double on the host.
    static double mean_diagonal(const matrix& F) {
        const auto& h = Backend::to_host(F);
        const auto n = h.cols() == 1 ? h.rows() : std::min(h.rows(), h.cols());
        if (n == 0) return 0.0;
        double sum = 0.0;
        for (std::int64_t i = 0; i < n; ++i) sum += static_cast<double>(h.cols() == 1 ? h(i, 0) : h(i, i));
        return sum / static_cast<double>(n);
    }
    std::pair<double, double> mean_eigenvalues(const state& s) const override {
        return {mean_diagonal(s.a_factor), mean_diagonal(s.g_factor)};
    }
    std::pair<std::vector<double>, std::vector<double>> spectra(const state& s) const override {
        return {host_eigenvalues<Backend>(s.a_factor), host_eigenvalues<Backend>(s.g_factor)};
    }

    double second_order_cost(const layer_description& d, factor_side side) const override {
        const auto n = static_cast<double>(side == factor_side::a ? d.a_dim() : d.g_dim());
        return n * n * n;
    }
    /// Eigen method: the side's damping term added to the clamped eigenvalues (0 but for
    /// factored damping); inverse method: (F + damping·I)⁻¹.
    bool compute(factor_side, const matrix& F, double damping, const options& o, const factor_data& previous,
                 factor_data& out) const override {
        if constexpr (eigen) {
            if (!Method::decompose(F, o, previous, out)) return false;
            if (damping != 0.0) Backend::add_constant(out.lambda, static_cast<scalar>(damping));
            return true;
        } else {
            return Method::invert(F, damping, o, out);
        }
    }
    bool counts_basis(factor_side) const override { return true; }
    void finalize(layer_data& l, double damping, const options& o) const override {
        if constexpr (eigen) Method::finalize_eigen_product(l, damping, o);
    }
    void identity_data(layer_data& l, const layer_description& d, const detail::damping_terms& t,
                       const options& o) const override {
        if constexpr (eigen) {
            l.a.q = Backend::identity(d.a_dim());
            l.a.lambda = Backend::ones(d.a_dim());
            l.g.q = Backend::identity(d.g_dim());
            l.g.lambda = Backend::ones(d.g_dim());
            if (t.a != 0.0) Backend::add_constant(l.a.lambda, static_cast<scalar>(t.a));
            if (t.g != 0.0) Backend::add_constant(l.g.lambda, static_cast<scalar>(t.g));
            finalize(l, t.product, o);
        } else {
            l.a.diagonal = false;
            l.a.inverse = Backend::scaled_identity(d.a_dim(), Method::damped_identity_value(t.a));
            l.g.inverse = Backend::scaled_identity(d.g_dim(), Method::damped_identity_value(t.g));
        }
    }
    void prepare_receive(layer_data& l, const layer_description& d, const options& o) const override {
        const auto a_dim = d.a_dim(), g_dim = d.g_dim();
        if constexpr (eigen) {
            l.has_product = Method::keeps_product(o);
            l.a.q.resize(a_dim, a_dim);
            l.g.q.resize(g_dim, g_dim);
            l.a.lambda.resize(l.has_product ? 0 : a_dim);
            l.a.blocks.resize(0, 0);
            l.g.lambda.resize(l.has_product ? 0 : g_dim);
            l.inverse_eigen_product.resize(l.has_product ? a_dim : 0, l.has_product ? g_dim : 0);
            Method::size_extras(l, a_dim, g_dim);
        } else {
            l.a.diagonal = false;
            l.a.inverse.resize(a_dim, a_dim);
            l.g.inverse.resize(g_dim, g_dim);
        }
    }
    /// The rank that computes both factors holds the eigenvalues too, with or without D.
    void prepare_full(layer_data& l, const layer_description& d, const options& o) const override {
        prepare_receive(l, d, o);
        if constexpr (eigen) {
            l.a.lambda.resize(d.a_dim());
            l.g.lambda.resize(d.g_dim());
        }
    }

    double precondition_cost(const layer_description& d) const override {
        const double n_a = static_cast<double>(d.a_dim()), n_g = static_cast<double>(d.g_dim());
        return n_a * n_g * (n_a + n_g);
    }
    void load_gradient(record& l) const override {
        Backend::load_gradient(l.scratch.gamma, as_const(l.scratch.weight_gradient), as_const(l.scratch.bias_gradient));
    }
    void store_gradient(record& l, scalar scale) const override {
        Backend::store_gradient(l.scratch.preconditioned, scale, l.scratch.weight_gradient, l.scratch.bias_gradient);
    }
    /// On transposes (gamma_t = Γᵀ, P_t = Pᵀ), so the host's row-major Γ needs no copy-transpose.
    void precondition(const layer_data& l, const matrix& gamma_t, double damping, const options&, workspace& w,
                      matrix& p_t) const override {
        if constexpr (eigen) {
            Backend::multiply(l.a.q, true, gamma_t, false, w.t1);  // Q_Aᵀ Γᵀ
            Backend::multiply(w.t1, false, l.g.q, false, w.t2);    // Vᵀ = (Q_Aᵀ Γᵀ) Q_G
            Method::divide_by_damped_eigenvalues(l, damping, w.t2);
            Backend::multiply(l.a.q, false, w.t2, false, w.t1);  // Q_A V'ᵀ
            Backend::multiply(w.t1, false, l.g.q, true, p_t);    // (Q_A V'ᵀ) Q_Gᵀ
        } else {
            Backend::multiply(l.a.inverse, false, gamma_t, false, w.t1);  // A⁻ Γᵀ
            Backend::multiply(w.t1, false, l.g.inverse, false, p_t);      // (A⁻ Γᵀ) G⁻
        }
    }
};

}  // namespace kfac::blocks
