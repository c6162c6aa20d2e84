// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file eigendecomposition.hpp
/// Compute method: eigendecompositions of the factors (golden/README.md §6.2–6.4).
///
/// **ComputeMethod policy.** A compute method is a tag type; its behaviour is
/// `detail::compute_impl<Method, Backend>`: the second-order data it keeps, how that data
/// travels, and the math of a dense factor. What a factor's structure makes of it (a diagonal
/// A, unit-wise blocks, an identity G) is each block's (kfac/blocks/block.hpp), which reads
/// `tag` to pick the method's data. A compute_impl provides:
/// ```
///   using tag = Method;
///   struct factor_data;                 // second-order data of one factor
///   struct layer_data { factor_data a, g; ... };   // plus per-layer extras
///   struct workspace;                   // scratch reused between steps
///   // Distribution: the buffers that carry one side of a layer's data from the rank that
///   // computed it to the others, in a fixed order; f(scalar* data, size_t count).
///   template <class F> static void for_each_payload(layer_data&, factor_side, F&& f);
///   // Checkpoints: every tensor of a layer's data, f(const char* name, matrix-or-vector&,
///   // int tensor_rank), in a fixed order (empty ones included).
///   template <class LayerData, class F> static void for_each_tensor(LayerData&, F&& f);
///   // Whether a factor's data holds eigenvectors decomposed now, kept from before, or
///   // none (eigenbasis_counts()).
///   static basis_use basis_use_of(const factor_data&);
/// ```
/// A method that preconditions in the eigenbases (the blocks' under_eigendecomposition) also
/// provides keeps_product(options) (whether D = 1/(λ_A λ_Gᵀ + γ) is precomputed) and
/// size_extras(layer_data&, a_dim, g_dim) (data the blocks do not size). Optional members the
/// engine calls where a method has them: unsupported_layer(description) (a reason to refuse a
/// layer at registration), and `estimates_scaling` with keep_rows / estimate_scaling /
/// update_scaling / release_rows (a per-step estimate from the captured rows after the inverse
/// update: compute::ekfac, kfac/compute/ekfac.hpp).

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "kfac/backend/eigenbasis_reuse.hpp"
#include "kfac/backend/fp64_decompositions.hpp"
#include "kfac/checkpoint/second_order_checks.hpp"
#include "kfac/checkpoint/value_checks.hpp"
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
    /// The method's name, as checkpoints record it (compute_method) and the ranks agree on.
    static constexpr const char* name = "eigendecomposition";
};

}  // namespace compute

namespace detail {

template <class Backend>
struct compute_impl<compute::eigendecomposition, Backend> {
    using tag = compute::eigendecomposition;
    using matrix = typename Backend::matrix;
    using vector = typename Backend::vector;
    using scalar = typename Backend::scalar_type;

    struct factor_data {
        matrix q;  ///< empty for a diagonal factor, whose eigenvectors are the identity
        vector lambda;
        matrix blocks;  ///< unit-wise blocks (C × k(k+1)/2), their own decomposition
        /// q is the previous decomposition's, kept under options.eigenbasis_reuse_tolerance
        bool reused_basis = false;
        /// The decomposition failed in the backend's type and was retried in double
        /// (options.fp64_retry); set whatever the retry's outcome.
        bool fp64_retry = false;
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

    /// A dense factor F = Q diag(λ) Qᵀ, λ clamped at 0: the previous eigenvectors when
    /// options.eigenbasis_reuse_tolerance keeps them, else a decomposition. False: F has none.
    static bool decompose(const matrix& F, const options& o, const factor_data& previous, factor_data& out) {
        factor_data next;
        if (!reuse_basis(F, o.eigenbasis_reuse_tolerance, previous, next) &&
            !detail::symmetric_eigen_as_asked<Backend>(F, next.q, next.lambda, o, next.fp64_retry)) {
            out.fp64_retry = next.fp64_retry;
            return false;
        }
        Backend::clamp_nonnegative(next.lambda);
        out = std::move(next);
        return true;
    }

    /// The previous eigenvectors with F's Rayleigh quotients, when they diagonalise F to within
    /// the tolerance (false: decompose F). `previous` is a dense factor's data, or empty.
    static bool reuse_basis(const matrix& F, double tolerance, const factor_data& previous, factor_data& next) {
        if constexpr (backend_with_eigenbasis_reuse<Backend>) {
            if (tolerance <= 0.0 || previous.q.rows() != F.rows() || previous.q.cols() != F.rows()) return false;
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

    /// The data of an n × n identity factor: Q = I, λ = 1.
    static factor_data identity(std::int64_t n) {
        factor_data f;
        f.q = Backend::identity(n);
        f.lambda = Backend::ones(n);
        return f;
    }

    /// Dᵀ = 1/(λ_A λ_Gᵀ + γ) when options.compute_eigenvalue_outer_product asks for it (and
    /// nothing otherwise), for factors whose eigenvalues are λ_A and λ_G.
    static void finalize_eigen_product(layer_data& l, double damping, const options& o) {
        l.has_product = keeps_product(o);
        if (!l.has_product) {
            l.inverse_eigen_product.resize(0, 0);
            return;
        }
        Backend::inverse_eigen_product(l.a.lambda, l.g.lambda, static_cast<scalar>(damping), l.inverse_eigen_product);
    }

    /// Whether the data keeps D = 1/(λ_A λ_Gᵀ + γ), precomputed at the inverse update.
    static bool keeps_product(const options& o) { return o.compute_eigenvalue_outer_product; }
    /// Sizes data beyond what the blocks size (the blocks' prepare_receive()): none here.
    template <class LayerData>
    static void size_extras(LayerData&, std::int64_t, std::int64_t) {}

    /// V'ᵀ ← Vᵀ ⊘ (λ_A λ_Gᵀ + γ), by the precomputed D when there is one.
    static void divide_by_damped_eigenvalues(const layer_data& l, double damping, matrix& v_t) {
        if (l.has_product)
            Backend::multiply_elementwise(v_t, l.inverse_eigen_product);
        else
            Backend::divide_by_eigen_product(v_t, l.a.lambda, l.g.lambda, static_cast<scalar>(damping));
    }

    /// A side: Q_A (none when A is diagonal or unit-wise), then λ_A or the unit-wise blocks
    /// unless D is precomputed. G side: Q_G, then D or λ_G.
    template <class F>
    static void for_each_payload(layer_data& l, factor_side side, F&& f) {
        auto send = [&](auto& m) {
            if (m.size() != 0) f(m.data(), static_cast<std::size_t>(m.size()));
        };
        if (side == factor_side::a) {
            send(l.a.q);
            if (!l.has_product) send(l.a.lambda);
            if (!l.has_product) send(l.a.blocks);
        } else {
            send(l.g.q);
            if (l.has_product) send(l.inverse_eigen_product);
            else send(l.g.lambda);
        }
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

    /// What is wrong with a checkpoint's tensors of this method (for_each_tensor's, as the file
    /// holds them), by kfac/checkpoint/second_order_checks.hpp: orthonormal eigenvectors,
    /// eigenvalues >= 0, unit-wise blocks that are covariances, D = 1/(λ_A λ_Gᵀ + p) (or a
    /// unit-wise block's damped inverses), and a unit-wise block's identity G as the identity.
    static checkpoint::second_order_fault loaded_fault(const checkpoint::loaded_second_order& in) {
        using namespace checkpoint;
        const bool identity_g = in.g_structure == factor_structure::identity;
        for (const char* name : {"A.eigenvectors", "G.eigenvectors", "A.eigenvalues", "G.eigenvalues"})
            if (const tensor* t = in.tensor_named(name)) {
                const bool vectors = std::string_view(name).ends_with("vectors");
                const std::string fault = name[0] == 'G' && identity_g ? identity_data_fault(*t)
                                          : vectors                    ? orthonormality_fault(*t, in.unit_roundoff)
                                                                       : negative_eigenvalue_fault(*t);
                if (!fault.empty()) return {name, fault};
            }
        const tensor* blocks = in.tensor_named("A.blocks");
        if (blocks && blocks->shape.size() == 2)
            if (std::string fault = factor_fault(*blocks, factor_structure::unit_wise, blocks->shape[1]); !fault.empty())
                return {"A.blocks", std::move(fault)};
        const tensor* d = in.tensor_named("eigenvalue_product_inverse");
        if (!d) return {};
        if (in.a_structure == factor_structure::unit_wise) return {"eigenvalue_product_inverse", unit_block_inverse_fault(*d, blocks, in)};
        const tensor *lambda_a = in.tensor_named("A.eigenvalues"), *lambda_g = in.tensor_named("G.eigenvalues");
        if (!lambda_a || !lambda_g) return {};  // not saved without them; nothing to compare with
        return {"eigenvalue_product_inverse", eigen_product_inverse_fault(*d, *lambda_a, *lambda_g, in)};
    }
};

}  // namespace detail
}  // namespace kfac
