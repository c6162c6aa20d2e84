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
///   // Second-order data of one factor from the running factor F (stored as `structure`
///   // says, kfac/layers/layer_description.hpp); false keeps the old one. `previous` is
///   // this rank's data of the factor so far (empty before its first computation).
///   static bool compute_factor(const matrix& F, factor_structure, double damping, const options&,
///                              const factor_data& previous, factor_data& out);
///   // Per-layer extras once both factors are current (e.g. the eigenvalue outer product).
///   static void finalize_layer(layer_data&, double damping, const options&);
///   // Pᵀ from Γᵀ (both A_dim × G_dim: the backend keeps gradients transposed) with the
///   // damping of this step.
///   static void precondition(const layer_data&, const matrix& gamma_t, double damping,
///                            const options&, workspace&, matrix& p_t);
///   // Distribution: the buffers that carry one side ('A' or 'G') of a layer's data from the
///   // rank that computed it to the others, in a fixed order; f(scalar* data, size_t count).
///   template <class F> static void for_each_payload(layer_data&, char side, F&& f);
///   // Sizes a receiver's layer_data so the payload buffers can be received in place.
///   static void prepare_receive(layer_data&, const layer_description&, const options&);
///   // Checkpoints: every tensor of a layer's data, f(const char* name, matrix-or-vector&,
///   // int tensor_rank), in a fixed order (empty ones included), and the sizes of a layer's
///   // full data as the rank that computed it holds it, ready to be read into.
///   template <class LayerData, class F> static void for_each_tensor(LayerData&, F&& f);
///   static void prepare_full(layer_data&, const layer_description&, const options&);
///   // Data of the identity factor, for a rank whose first decomposition failed.
///   static void identity_data(layer_data&, const layer_description&, double damping, const options&);
///   // Whether a dense factor's data holds eigenvectors decomposed now, kept from before, or
///   // none (eigenbasis_counts()).
///   static basis_use basis_use_of(const factor_data&);
/// ```

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kfac/backend/diagonal_factors.hpp"
#include "kfac/backend/eigenbasis_reuse.hpp"
#include "kfac/backend/unit_wise_factors.hpp"
#include "kfac/detail/compute_impl.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/options.hpp"

namespace kfac {
namespace compute {

/// Eigendecomposition method: F = Q diag(λ) Qᵀ with λ clamped at 0; damping is added to the
/// product λ_G λ_A (not to each factor). A diagonal factor is its own decomposition: Q = I
/// (never formed), λ its diagonal. A normalisation layer's unit-wise blocks are their own
/// decomposition too, and its G the identity (λ_G = 1): each channel's gradient is multiplied
/// by (F_c + γI)⁻¹, formed in closed form with the step's damping (or, with the eigenvalue
/// outer product precomputed, the inverse update's), which is what Q_c diag(1/(λ_c + γ)) Q_cᵀ
/// equals.
struct eigendecomposition {
    static constexpr const char* name = "eigendecomposition";
};

}  // namespace compute

namespace detail {

template <class Backend>
struct compute_impl<compute::eigendecomposition, Backend> {
    using matrix = typename Backend::matrix;
    using vector = typename Backend::vector;
    using scalar = typename Backend::scalar_type;

    struct factor_data {
        matrix q;  ///< empty for a diagonal factor, whose eigenvectors are the identity
        vector lambda;
        matrix blocks;  ///< unit-wise blocks (C × k(k+1)/2), their own decomposition
        bool diagonal = false;
        bool unit_wise = false;
        /// q is the previous decomposition's, kept under options.eigenbasis_reuse_tolerance
        bool reused_basis = false;
    };
    struct layer_data {
        factor_data a, g;
        /// Dᵀ = 1/(λ_A λ_Gᵀ + γ) (A_dim × G_dim), when precomputed; for unit-wise blocks their
        /// damped inverses (F_c + γI)⁻¹, in the blocks' layout.
        matrix inverse_eigen_product;
        bool has_product = false;
    };
    struct workspace {
        matrix t1, t2;
    };

    static basis_use basis_use_of(const factor_data& f) {
        return f.reused_basis ? basis_use::reused : basis_use::decomposed;
    }

    static bool compute_factor(const matrix& F, factor_structure structure, double /*damping*/, const options& o,
                               const factor_data& previous, factor_data& out) {
        factor_data next;
        next.diagonal = structure == factor_structure::diagonal;
        next.unit_wise = structure == factor_structure::unit_wise;
        if (next.unit_wise) {
            if (!Backend::all_finite(F)) return false;
            next.blocks = F;
            out = std::move(next);
            return true;
        }
        if (structure == factor_structure::identity) {  // not estimated: Q = I, λ = 1
            next.q = Backend::identity(F.rows());
            next.lambda = Backend::ones(F.rows());
            out = std::move(next);
            return true;
        }
        if (next.diagonal) {
            if constexpr (backend_with_diagonal_factors<Backend>) Backend::diagonal_values(F, next.lambda);
            else return false;  // not reached: registration refuses the layer on such a backend
        } else if (!reuse_basis(F, o.eigenbasis_reuse_tolerance, previous, next) &&
                   !Backend::symmetric_eigen(F, next.q, next.lambda)) {
            return false;
        }
        Backend::clamp_nonnegative(next.lambda);
        out = std::move(next);
        return true;
    }

    /// options.eigenbasis_reuse_tolerance: the previous eigenvectors with F's Rayleigh
    /// quotients, when they diagonalise F to within the tolerance (false: decompose F).
    static bool reuse_basis(const matrix& F, double tolerance, const factor_data& previous, factor_data& next) {
        if constexpr (backend_with_eigenbasis_reuse<Backend>) {
            if (tolerance <= 0.0 || previous.diagonal || previous.unit_wise || previous.q.rows() != F.rows() ||
                previous.q.cols() != F.rows())
                return false;
            vector lambda;
            if (!(Backend::rayleigh_quotients(F, previous.q, lambda) <= tolerance)) return false;  // NaN: decompose
            next.q = previous.q;
            next.lambda = std::move(lambda);
            next.reused_basis = true;
            return true;
        } else {
            (void)F, (void)tolerance, (void)previous, (void)next;
            return false;  // not reached with a tolerance: the preconditioner refuses it on such a backend
        }
    }

    static void finalize_layer(layer_data& l, double damping, const options& o) {
        l.has_product = o.compute_eigenvalue_outer_product;
        if (!l.has_product) {
            l.inverse_eigen_product.resize(0, 0);
            return;
        }
        if (l.a.unit_wise) {  // a non-finite inverse zeroes the layer's gradient at precondition
            if constexpr (backend_with_unit_wise_factors<Backend>)
                Backend::unit_wise_damped_inverse(l.a.blocks, static_cast<scalar>(damping), l.inverse_eigen_product);
            return;
        }
        Backend::inverse_eigen_product(l.a.lambda, l.g.lambda, static_cast<scalar>(damping), l.inverse_eigen_product);
    }

    /// A side: Q_A (none when A is diagonal or unit-wise), then λ_A or the unit-wise blocks
    /// unless D is precomputed. G side: Q_G, then D or λ_G.
    template <class F>
    static void for_each_payload(layer_data& l, char side, F&& f) {
        auto send = [&](auto& m) {
            if (m.size() != 0) f(m.data(), static_cast<std::size_t>(m.size()));
        };
        if (side == 'A') {
            send(l.a.q);
            if (!l.has_product) send(l.a.lambda);
            if (!l.has_product) send(l.a.blocks);
        } else {
            send(l.g.q);
            if (l.has_product) send(l.inverse_eigen_product);
            else send(l.g.lambda);
        }
    }

    static void prepare_receive(layer_data& l, const layer_description& d, const options& o) {
        const auto a_dim = d.a_dim(), g_dim = d.g_factor_dim();
        l.has_product = o.compute_eigenvalue_outer_product;
        l.a.diagonal = d.a_structure() == factor_structure::diagonal;
        l.a.unit_wise = d.a_structure() == factor_structure::unit_wise;
        const bool dense = !l.a.diagonal && !l.a.unit_wise;
        l.a.q.resize(dense ? a_dim : 0, dense ? a_dim : 0);
        l.g.q.resize(g_dim, g_dim);
        l.a.lambda.resize(l.has_product || l.a.unit_wise ? 0 : a_dim);
        l.a.blocks.resize(l.a.unit_wise && !l.has_product ? d.a_storage_rows() : 0,
                          l.a.unit_wise && !l.has_product ? d.a_storage_cols() : 0);
        l.g.lambda.resize(l.has_product ? 0 : g_dim);
        // D is A_dim × G_dim, or for unit-wise blocks shaped as they are.
        const auto d_rows = l.a.unit_wise ? d.a_storage_rows() : a_dim;
        const auto d_cols = l.a.unit_wise ? d.a_storage_cols() : d.g_dim();
        l.inverse_eigen_product.resize(l.has_product ? d_rows : 0, l.has_product ? d_cols : 0);
    }

    template <class LayerData, class F>
    static void for_each_tensor(LayerData& l, F&& f) {
        f("A.eigenvectors", l.a.q, 2);
        f("A.eigenvalues", l.a.lambda, 1);
        f("A.blocks", l.a.blocks, 2);
        f("G.eigenvectors", l.g.q, 2);
        f("G.eigenvalues", l.g.lambda, 1);
        f("eigenvalue_product_inverse", l.inverse_eigen_product, 2);
    }

    /// The rank that computes both factors holds the eigenvalues too, with or without D.
    static void prepare_full(layer_data& l, const layer_description& d, const options& o) {
        prepare_receive(l, d, o);
        if (l.a.unit_wise) l.a.blocks.resize(d.a_storage_rows(), d.a_storage_cols());
        else l.a.lambda.resize(d.a_dim());
        l.g.lambda.resize(d.g_factor_dim());
    }

    static void identity_data(layer_data& l, const layer_description& d, double damping, const options& o) {
        l.a.diagonal = d.a_structure() == factor_structure::diagonal;
        l.a.unit_wise = d.a_structure() == factor_structure::unit_wise;
        l.a.q = l.a.diagonal || l.a.unit_wise ? matrix{} : Backend::identity(d.a_dim());
        l.a.lambda = l.a.unit_wise ? vector{} : Backend::ones(d.a_dim());
        if constexpr (backend_with_unit_wise_factors<Backend>)
            if (l.a.unit_wise) l.a.blocks = Backend::unit_wise_identity(d.g_dim(), d.a_dim());
        l.g.q = Backend::identity(d.g_factor_dim());
        l.g.lambda = Backend::ones(d.g_factor_dim());
        finalize_layer(l, damping, o);
    }

    /// On transposes (gamma_t = Γᵀ, P_t = Pᵀ), so the host's row-major Γ needs no copy-transpose:
    /// Vᵀ = Q_Aᵀ Γᵀ Q_G, V'ᵀ = Vᵀ ⊘ (λ_A λ_Gᵀ + γ), Pᵀ = Q_A V'ᵀ Q_Gᵀ (Q_A = I when A is
    /// diagonal: its two products are skipped).
    static void precondition(const layer_data& l, const matrix& gamma_t, double damping,
                             const options&, workspace& w, matrix& p_t) {
        if (l.a.unit_wise) {
            if constexpr (backend_with_unit_wise_factors<Backend>) {
                const matrix* inverse = &l.inverse_eigen_product;
                if (!l.has_product) {  // a non-finite inverse makes P non-finite: the layer is zeroed
                    Backend::unit_wise_damped_inverse(l.a.blocks, static_cast<scalar>(damping), w.t1);
                    inverse = &w.t1;
                }
                Backend::unit_wise_multiply(*inverse, gamma_t, p_t);
            }
            return;
        }
        const matrix* v = &w.t2;
        if (l.a.diagonal) {
            Backend::multiply(gamma_t, false, l.g.q, false, w.t2);  // Γᵀ Q_G
        } else {
            Backend::multiply(l.a.q, true, gamma_t, false, w.t1);  // Q_Aᵀ Γᵀ
            Backend::multiply(w.t1, false, l.g.q, false, w.t2);    // (Q_Aᵀ Γᵀ) Q_G
        }
        if (l.has_product)
            Backend::multiply_elementwise(w.t2, l.inverse_eigen_product);
        else
            Backend::divide_by_eigen_product(w.t2, l.a.lambda, l.g.lambda, static_cast<scalar>(damping));
        if (!l.a.diagonal) {
            Backend::multiply(l.a.q, false, w.t2, false, w.t1);  // Q_A V'ᵀ
            v = &w.t1;
        }
        Backend::multiply(*v, false, l.g.q, true, p_t);  // (Q_A V'ᵀ) Q_Gᵀ
    }
};

}  // namespace detail
}  // namespace kfac
