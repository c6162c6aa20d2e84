// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file inverse.hpp
/// Compute method: damped inverses of the factors (golden/README.md §6.2, §6.3).
/// The ComputeMethod policy contract is documented in kfac/compute/eigendecomposition.hpp.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "kfac/backend/fp64_decompositions.hpp"
#include "kfac/checkpoint/second_order_checks.hpp"
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
    /// The method's name, as checkpoints record it (compute_method) and the ranks agree on.
    static constexpr const char* name = "inverse";
};

}  // namespace compute

namespace detail {

template <class Backend>
struct compute_impl<compute::inverse, Backend> {
    using tag = compute::inverse;
    using matrix = typename Backend::matrix;
    using scalar = typename Backend::scalar_type;

    struct factor_data {
        matrix inverse;  ///< n × n, n × 1 (the diagonal) for a diagonal factor, or unit-wise blocks
        bool diagonal = false;  ///< the inverse of a diagonal factor: a vector in a checkpoint
        /// The inverse failed in the backend's type and was retried in double
        /// (options.fp64_retry); set whatever the retry's outcome.
        bool fp64_retry = false;
    };
    struct layer_data {
        factor_data a, g;
    };
    struct workspace {
        matrix t1;
    };

    /// Inverses hold no eigenvectors: nothing to count.
    static basis_use basis_use_of(const factor_data&) { return basis_use::none; }

    /// (F + γI)⁻¹ of a dense factor; false when it is not finite.
    static bool invert(const matrix& F, double damping, const options& o, factor_data& out) {
        matrix next;
        if (!detail::damped_inverse_as_asked<Backend>(F, damping, next, o, out.fp64_retry)) return false;
        out.inverse = std::move(next);
        out.diagonal = false;
        return true;
    }

    /// (I + γI)⁻¹ = I / (1 + γ): one division, as Identity / (1 + γ) does per element.
    static scalar damped_identity_value(double damping) { return scalar(1) / static_cast<scalar>(1.0 + damping); }

    template <class F>
    static void for_each_payload(layer_data& l, factor_side side, F&& f) {
        auto& m = side == factor_side::a ? l.a.inverse : l.g.inverse;
        f(m.data(), static_cast<std::size_t>(m.size()));
    }

    /// A diagonal factor's inverse is a vector in a checkpoint, as its eigenvalues are.
    template <class LayerData, class F>
    static void for_each_tensor(LayerData& l, F&& f) {
        f("A.inverse", l.a.inverse, l.a.diagonal ? 1 : 2);
        f("G.inverse", l.g.inverse, 2);
    }

    /// What is wrong with a checkpoint's damped inverses (kfac/checkpoint/second_order_checks.hpp):
    /// a dense one's diagonal positive, a diagonal factor's 1/(F + γ) positive and at most 1/γ,
    /// unit-wise blocks' inverses with positive diagonals, a unit-wise block's G the identity.
    static checkpoint::second_order_fault loaded_fault(const checkpoint::loaded_second_order& in) {
        using namespace checkpoint;
        if (const tensor* a = in.tensor_named("A.inverse")) {
            const std::string fault = in.a_structure == factor_structure::diagonal  ? diagonal_inverse_fault(*a, in)
                                      : in.a_structure == factor_structure::unit_wise ? unit_block_inverse_fault(*a, nullptr, in)
                                                                                       : dense_inverse_fault(*a);
            if (!fault.empty()) return {"A.inverse", fault};
        }
        if (const tensor* g = in.tensor_named("G.inverse"))
            return {"G.inverse", in.g_structure == factor_structure::identity ? identity_data_fault(*g) : dense_inverse_fault(*g)};
        return {};
    }
};

}  // namespace detail
}  // namespace kfac
