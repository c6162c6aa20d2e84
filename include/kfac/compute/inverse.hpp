// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file inverse.hpp
/// Compute method: damped inverses of the factors (golden/README.md §6.2, §6.3).
/// The ComputeMethod policy contract is documented in kfac/compute/eigendecomposition.hpp.

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kfac/backend/diagonal_factors.hpp"
#include "kfac/backend/unit_wise_factors.hpp"
#include "kfac/detail/compute_impl.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/options.hpp"

namespace kfac {
namespace compute {

/// Inverse method: P = (G + γI)⁻¹ Γ (A + γI)⁻¹, the full γ added to each factor. A diagonal
/// factor's inverse is its n reciprocals 1/(a_i + γ), kept as a column. A normalisation
/// layer's unit-wise blocks are inverted per channel, (F_c + γI)⁻¹ in closed form, and its G,
/// the identity that is not a factor of the layer, is not damped: P_c = (F_c + γI)⁻¹ Γ_c.
struct inverse {
    static constexpr const char* name = "inverse";
};

}  // namespace compute

namespace detail {

template <class Backend>
struct compute_impl<compute::inverse, Backend> {
    using matrix = typename Backend::matrix;
    using scalar = typename Backend::scalar_type;

    struct factor_data {
        matrix inverse;  ///< n × n, n × 1 (the diagonal) for a diagonal factor, or unit-wise blocks
        bool diagonal = false;
        bool unit_wise = false;
    };
    struct layer_data {
        factor_data a, g;
    };
    struct workspace {
        matrix t1;
    };

    /// Inverses hold no eigenvectors: nothing to count.
    static basis_use basis_use_of(const factor_data&) { return basis_use::none; }

    static bool compute_factor(const matrix& F, factor_structure structure, double damping, const options&,
                               const factor_data& /*previous*/, factor_data& out) {
        matrix next;
        const bool diagonal = structure == factor_structure::diagonal;
        const bool unit_wise = structure == factor_structure::unit_wise;
        if (unit_wise) {
            if constexpr (backend_with_unit_wise_factors<Backend>) {
                if (!Backend::unit_wise_damped_inverse(F, static_cast<scalar>(damping), next)) return false;
            } else {
                return false;  // not reached: registration refuses the layer on such a backend
            }
        } else if (structure == factor_structure::identity) {
            next = F;  // not estimated, not damped: its inverse is itself
        } else if (diagonal) {
            if constexpr (backend_with_diagonal_factors<Backend>) {
                if (!Backend::damped_reciprocal(F, static_cast<scalar>(damping), next)) return false;
            } else {
                return false;  // not reached: registration refuses the layer on such a backend
            }
        } else if (!Backend::damped_inverse(F, static_cast<scalar>(damping), next)) {
            return false;
        }
        out.inverse = std::move(next);
        out.diagonal = diagonal;
        out.unit_wise = unit_wise;
        return true;
    }

    static void finalize_layer(layer_data&, double, const options&) {}

    template <class F>
    static void for_each_payload(layer_data& l, char side, F&& f) {
        auto& m = side == 'A' ? l.a.inverse : l.g.inverse;
        f(m.data(), static_cast<std::size_t>(m.size()));
    }

    static void prepare_receive(layer_data& l, const layer_description& d, const options&) {
        l.a.diagonal = d.a_structure() == factor_structure::diagonal;
        l.a.unit_wise = d.a_structure() == factor_structure::unit_wise;
        l.a.inverse.resize(d.a_storage_rows(), d.a_storage_cols());
        l.g.inverse.resize(d.g_factor_dim(), d.g_factor_dim());
    }

    /// A diagonal factor's inverse is a vector in a checkpoint, as its eigenvalues are.
    template <class LayerData, class F>
    static void for_each_tensor(LayerData& l, F&& f) {
        f("A.inverse", l.a.inverse, l.a.diagonal ? 1 : 2);
        f("G.inverse", l.g.inverse, 2);
    }

    static void prepare_full(layer_data& l, const layer_description& d, const options& o) {
        prepare_receive(l, d, o);
    }

    static void identity_data(layer_data& l, const layer_description& d, double damping, const options&) {
        // (I + γI)⁻¹ = I / (1 + γ): one division, as Identity / (1 + γ) does per element.
        const scalar diagonal = scalar(1) / static_cast<scalar>(1.0 + damping);
        l.a.diagonal = d.a_structure() == factor_structure::diagonal;
        l.a.unit_wise = d.a_structure() == factor_structure::unit_wise;
        if (l.a.unit_wise) {
            if constexpr (backend_with_unit_wise_factors<Backend>)
                Backend::unit_wise_damped_inverse(Backend::unit_wise_identity(d.g_dim(), d.a_dim()),
                                                  static_cast<scalar>(damping), l.a.inverse);
        } else if (!l.a.diagonal) {
            l.a.inverse = Backend::scaled_identity(d.a_dim(), diagonal);
        } else if constexpr (backend_with_diagonal_factors<Backend>) {
            const matrix ones = Backend::ones(d.a_dim());
            Backend::damped_reciprocal(ones, static_cast<scalar>(damping), l.a.inverse);
        }
        l.g.inverse = d.g_structure() == factor_structure::identity ? Backend::identity(d.g_factor_dim())
                                                                     : Backend::scaled_identity(d.g_dim(), diagonal);
    }

    /// On transposes: Pᵀ = A⁻ Γᵀ G⁻ (both inverses are symmetric; a diagonal A⁻ scales rows).
    static void precondition(const layer_data& l, const matrix& gamma_t, double, const options&,
                             workspace& w, matrix& p_t) {
        if (l.a.unit_wise) {
            if constexpr (backend_with_unit_wise_factors<Backend>) Backend::unit_wise_multiply(l.a.inverse, gamma_t, p_t);
            return;
        }
        if (l.a.diagonal) {
            if constexpr (backend_with_diagonal_factors<Backend>) {
                w.t1 = gamma_t;
                Backend::scale_rows(w.t1, l.a.inverse);  // A⁻ Γᵀ
            }
        } else {
            Backend::multiply(l.a.inverse, false, gamma_t, false, w.t1);  // A⁻ Γᵀ
        }
        Backend::multiply(w.t1, false, l.g.inverse, false, p_t);  // (A⁻ Γᵀ) G⁻
    }
};

}  // namespace detail
}  // namespace kfac
