// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file diagonal.hpp
/// An Embedding's block: a Kronecker pair whose A is diagonal by construction (one-hot inputs
/// have no cross terms), stored as the n × 1 column of its diagonal, beside a dense G. Its
/// statistics and running averages are the Kronecker pair's (the backend reads the token ids);
/// what differs is that no n × n matrix is ever formed: A's eigenvectors are the identity (Q_A
/// never formed, λ_A its diagonal), its damped inverse is n reciprocals 1/(a_i + γ), and
/// preconditioning scales rows. Its weight gradient is [in, out] ([V, E]), the transpose of a
/// Linear layer's. The backend members it needs are kfac/backend/diagonal_factors.hpp's.

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "kfac/backend/diagonal_factors.hpp"
#include "kfac/blocks/kronecker.hpp"

namespace kfac::blocks {

/// An Embedding's block: a diagonal A, stored as its a_dim × 1 diagonal, beside a dense G (above).
struct diagonal {
    /// Whether a layer of description `d` is of this kind.
    static bool holds(const layer_description& d) { return d.kind == layer_kind::embedding; }
    /// The storage of a layer of this kind, from its description alone.
    static block_layout layout(const layer_description& d) {
        block_layout b;
        b.name = "diagonal A beside a dense G";
        b.a_structure = factor_structure::diagonal;
        b.a_rows = d.a_dim();
        b.a_cols = 1;
        b.g_dim = d.g_dim();
        b.a_tensor_rank = 1;
        // n stored entries weigh as the dense ⌈√n⌉ × ⌈√n⌉ that holds as many (its O(n) work is smaller still).
        b.placement = {static_cast<std::int64_t>(std::ceil(std::sqrt(static_cast<double>(d.a_dim())))), d.g_dim()};
        return b;
    }
    /// The kind's operations: a kfac::blocks::block on Backend under Method.
    template <class Backend, class Method>
    class ops;
};

template <class Backend, class Method>
class diagonal::ops final : public kronecker::ops<Backend, Method> {
public:
    using base = kronecker::ops<Backend, Method>;  ///< the dense kind it specialises
    ///@{
    /// The base's types (kfac::blocks::block).
    using typename base::factor_data;
    using typename base::layer_data;
    using typename base::matrix;
    using typename base::record;
    using typename base::scalar;
    using typename base::state;
    using typename base::workspace;
    ///@}
    /// Whether Method computes eigendecompositions (else inverses).
    static constexpr bool eigen = base::eigen;
    /// Whether Backend has diagonal factors (kfac/backend/diagonal_factors.hpp); check_backend()
    /// refuses the layer without them.
    static constexpr bool supported = detail::backend_with_diagonal_factors<Backend>;

    block_layout layout(const layer_description& d) const override { return diagonal::layout(d); }

    void check_backend(const detail::named_layer& who, const layer_description& d) const override {
        if (!supported)
            throw detail::layer_error(who,
                                      "this backend has no diagonal factors (kfac/backend/diagonal_factors.hpp), which "
                                      "an Embedding needs; use kfac::backend::cpu_eigen, or exclude the layer with "
                                      "options.skip_layers");
        // Token ids travel as scalars: past 2^digits a float or double no longer holds every integer.
        constexpr std::int64_t exact_ids = std::int64_t{1} << std::numeric_limits<scalar>::digits;
        if (d.in > exact_ids)
            throw detail::layer_error(who, std::to_string(d.in) +
                                               " token ids do not all fit exactly in the scalar type "
                                               "(its integers are exact up to " +
                                               std::to_string(exact_ids) + "); use a double backend");
    }

    void start(state& s, const layer_description& d) const override {
        s.a_factor = Backend::ones(d.a_dim());
        s.g_factor = Backend::identity(d.g_dim());
    }

    /// A's eigenvalues are its diagonal.
    std::pair<std::vector<double>, std::vector<double>> spectra(const state& s) const override {
        const auto& h = Backend::to_host(s.a_factor);
        std::vector<double> a(static_cast<std::size_t>(h.rows()));
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<double>(h(static_cast<std::int64_t>(i), 0));
        return {std::move(a), host_eigenvalues<Backend>(s.g_factor)};
    }

    double second_order_cost(const layer_description& d, factor_side side) const override {
        return side == factor_side::a ? static_cast<double>(d.a_dim()) : base::second_order_cost(d, side);
    }
    bool compute(factor_side side, const matrix& F, double damping, const options& o, const factor_data& previous,
                 factor_data& out) const override {
        if (side == factor_side::g) return base::compute(side, F, damping, o, previous, out);
        if constexpr (!supported) {
            return false;  // not reached: check_backend refuses the layer on such a backend
        } else if constexpr (eigen) {
            factor_data next;  // Q = I, never formed; λ the diagonal
            Backend::diagonal_values(F, next.lambda);
            Backend::clamp_nonnegative(next.lambda);
            if (damping != 0.0) Backend::add_constant(next.lambda, static_cast<scalar>(damping));
            out = std::move(next);
            return true;
        } else {
            matrix next;
            if (!Backend::damped_reciprocal(F, static_cast<scalar>(damping), next)) return false;
            out.inverse = std::move(next);
            out.diagonal = true;
            return true;
        }
    }
    bool counts_basis(factor_side side) const override { return side == factor_side::g; }
    void identity_data(layer_data& l, const layer_description& d, const detail::damping_terms& t,
                       const options& o) const override {
        if constexpr (eigen) {
            l.a.q = matrix{};
            l.a.lambda = Backend::ones(d.a_dim());
            l.g.q = Backend::identity(d.g_dim());
            l.g.lambda = Backend::ones(d.g_dim());
            if (t.a != 0.0) Backend::add_constant(l.a.lambda, static_cast<scalar>(t.a));
            if (t.g != 0.0) Backend::add_constant(l.g.lambda, static_cast<scalar>(t.g));
            this->finalize(l, t.product, o);
        } else {
            l.a.diagonal = true;
            if constexpr (supported) {
                const matrix ones = Backend::ones(d.a_dim());
                Backend::damped_reciprocal(ones, static_cast<scalar>(t.a), l.a.inverse);
            }
            l.g.inverse = Backend::scaled_identity(d.g_dim(), Method::damped_identity_value(t.g));
        }
    }
    void prepare_receive(layer_data& l, const layer_description& d, const options& o) const override {
        const auto a_dim = d.a_dim(), g_dim = d.g_dim();
        if constexpr (eigen) {
            l.has_product = Method::keeps_product(o);
            l.a.q.resize(0, 0);
            l.g.q.resize(g_dim, g_dim);
            l.a.lambda.resize(l.has_product ? 0 : a_dim);
            l.a.blocks.resize(0, 0);
            l.g.lambda.resize(l.has_product ? 0 : g_dim);
            l.inverse_eigen_product.resize(l.has_product ? a_dim : 0, l.has_product ? g_dim : 0);
        } else {
            l.a.diagonal = true;
            l.a.inverse.resize(a_dim, 1);
            l.g.inverse.resize(g_dim, g_dim);
        }
    }
    void prepare_full(layer_data& l, const layer_description& d, const options& o) const override {
        prepare_receive(l, d, o);
        if constexpr (eigen) {
            l.a.lambda.resize(d.a_dim());
            l.g.lambda.resize(d.g_dim());
        }
    }

    /// A row scaling on the A side.
    double precondition_cost(const layer_description& d) const override {
        const double n_a = static_cast<double>(d.a_dim()), n_g = static_cast<double>(d.g_dim());
        return n_a * n_g * (1.0 + n_g);
    }
    void load_gradient(record& l) const override {
        if constexpr (supported)
            Backend::load_gradient_transposed(l.scratch.gamma, as_const(l.scratch.weight_gradient));
    }
    void store_gradient(record& l, scalar scale) const override {
        if constexpr (supported)
            Backend::store_gradient_transposed(l.scratch.preconditioned, scale, l.scratch.weight_gradient);
    }
    /// Q_A = I: the eigen method's two products with it are skipped; the inverse method's A⁻
    /// scales rows.
    void precondition(const layer_data& l, const matrix& gamma_t, double damping, const options&, workspace& w,
                      matrix& p_t) const override {
        if constexpr (eigen) {
            Backend::multiply(gamma_t, false, l.g.q, false, w.t2);  // Vᵀ = Γᵀ Q_G
            Method::divide_by_damped_eigenvalues(l, damping, w.t2);
            Backend::multiply(w.t2, false, l.g.q, true, p_t);  // V'ᵀ Q_Gᵀ
        } else {
            if constexpr (supported) {
                w.t1 = gamma_t;
                Backend::scale_rows(w.t1, l.a.inverse);  // A⁻ Γᵀ
            }
            Backend::multiply(w.t1, false, l.g.inverse, false, p_t);  // (A⁻ Γᵀ) G⁻
        }
    }
};

}  // namespace kfac::blocks
