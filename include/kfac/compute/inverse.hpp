// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file inverse.hpp
/// Compute method: damped inverses of the factors (golden/README.md §6.2, §6.3).
/// The ComputeMethod policy contract is documented in kfac/compute/eigendecomposition.hpp.

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kfac/detail/compute_impl.hpp"
#include "kfac/options.hpp"

namespace kfac {
namespace compute {

/// Inverse method: P = (G + γI)⁻¹ Γ (A + γI)⁻¹, the full γ added to each factor.
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
        matrix inverse;
    };
    struct layer_data {
        factor_data a, g;
    };
    struct workspace {
        matrix t1;
    };

    static bool compute_factor(const matrix& F, double damping, factor_data& out) {
        matrix next;
        if (!Backend::damped_inverse(F, static_cast<scalar>(damping), next)) return false;
        out.inverse = std::move(next);
        return true;
    }

    static void finalize_layer(layer_data&, double, const options&) {}

    template <class F>
    static void for_each_payload(layer_data& l, char side, F&& f) {
        auto& m = side == 'A' ? l.a.inverse : l.g.inverse;
        f(m.data(), static_cast<std::size_t>(m.size()));
    }

    static void prepare_receive(layer_data& l, std::int64_t a_dim, std::int64_t g_dim, const options&) {
        l.a.inverse.resize(a_dim, a_dim);
        l.g.inverse.resize(g_dim, g_dim);
    }

    template <class LayerData, class F>
    static void for_each_tensor(LayerData& l, F&& f) {
        f("A.inverse", l.a.inverse, 2);
        f("G.inverse", l.g.inverse, 2);
    }

    static void prepare_full(layer_data& l, std::int64_t a_dim, std::int64_t g_dim, const options& o) {
        prepare_receive(l, a_dim, g_dim, o);
    }

    static void identity_data(layer_data& l, std::int64_t a_dim, std::int64_t g_dim, double damping, const options&) {
        // (I + γI)⁻¹ = I / (1 + γ): one division, as Identity / (1 + γ) does per element.
        const scalar diagonal = scalar(1) / static_cast<scalar>(1.0 + damping);
        l.a.inverse = Backend::scaled_identity(a_dim, diagonal);
        l.g.inverse = Backend::scaled_identity(g_dim, diagonal);
    }

    /// On transposes: Pᵀ = A⁻ Γᵀ G⁻ (both inverses are symmetric).
    static void precondition(const layer_data& l, const matrix& gamma_t, double, const options&,
                             workspace& w, matrix& p_t) {
        Backend::multiply(l.a.inverse, false, gamma_t, false, w.t1);  // A⁻ Γᵀ
        Backend::multiply(w.t1, false, l.g.inverse, false, p_t);      // (A⁻ Γᵀ) G⁻
    }
};

}  // namespace detail
}  // namespace kfac
