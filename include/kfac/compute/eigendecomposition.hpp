// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file eigendecomposition.hpp
/// Compute method: eigendecompositions of the factors (golden/README.md §6.2–6.4).
///
/// **ComputeMethod policy.** A compute method is a tag type; its behaviour is
/// `detail::compute_impl<Method, Backend>`, which provides:
/// ```
///   struct factor_data;                 // second-order data of one factor
///   struct layer_data { factor_data a, g; ... };   // plus per-layer extras
///   struct workspace;                   // scratch reused between steps
///   // Second-order data of one factor from the running factor F; false keeps the old one.
///   static bool compute_factor(const matrix& F, double damping, factor_data& out);
///   // Per-layer extras once both factors are current (e.g. the eigenvalue outer product).
///   static void finalize_layer(layer_data&, double damping, const options&);
///   // P = preconditioned Γ (G_dim × A_dim) with the damping of this step.
///   static void precondition(const layer_data&, const matrix& gamma, double damping,
///                            const options&, workspace&, matrix& P);
/// ```

#include <utility>

#include "kfac/detail/compute_impl.hpp"
#include "kfac/options.hpp"

namespace kfac {
namespace compute {

/// Eigendecomposition method: F = Q diag(λ) Qᵀ with λ clamped at 0; damping is added to the
/// product λ_G λ_A (not to each factor).
struct eigendecomposition {};

}  // namespace compute

namespace detail {

template <class Backend>
struct compute_impl<compute::eigendecomposition, Backend> {
    using matrix = typename Backend::matrix;
    using vector = typename Backend::vector;
    using scalar = typename Backend::scalar_type;

    struct factor_data {
        matrix q;
        vector lambda;
    };
    struct layer_data {
        factor_data a, g;
        matrix inverse_eigen_product;  ///< D = 1/(λ_G λ_Aᵀ + γ), when precomputed
        bool has_product = false;
    };
    struct workspace {
        matrix t1, t2;
    };

    static bool compute_factor(const matrix& F, double /*damping*/, factor_data& out) {
        factor_data next;
        if (!Backend::symmetric_eigen(F, next.q, next.lambda)) return false;
        next.lambda = next.lambda.cwiseMax(scalar(0));
        out = std::move(next);
        return true;
    }

    static void finalize_layer(layer_data& l, double damping, const options& o) {
        l.has_product = o.compute_eigenvalue_outer_product;
        if (!l.has_product) {
            l.inverse_eigen_product.resize(0, 0);
            return;
        }
        l.inverse_eigen_product =
            ((l.g.lambda * l.a.lambda.transpose()).array() + static_cast<scalar>(damping)).inverse().matrix();
    }

    static void precondition(const layer_data& l, const matrix& gamma, double damping,
                             const options&, workspace& w, matrix& P) {
        Backend::multiply(l.g.q, true, gamma, false, w.t1);  // Q_Gᵀ Γ
        Backend::multiply(w.t1, false, l.a.q, false, w.t2);  // (Q_Gᵀ Γ) Q_A
        if (l.has_product)
            w.t2.array() *= l.inverse_eigen_product.array();
        else
            w.t2.array() /= ((l.g.lambda * l.a.lambda.transpose()).array() + static_cast<scalar>(damping));
        Backend::multiply(l.g.q, false, w.t2, false, w.t1);  // Q_G V'
        Backend::multiply(w.t1, false, l.a.q, true, P);      // (Q_G V') Q_Aᵀ
    }
};

}  // namespace detail
}  // namespace kfac
