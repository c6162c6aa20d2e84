// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file ekfac.hpp
/// Compute method: eigenvalue-corrected K-FAC (EKFAC; George, Laurent, Bouthillier, Ballas,
/// Vincent, "Fast Approximate Natural Gradient Descent in a Kronecker-factored Eigenbasis",
/// NeurIPS 2018). The ComputeMethod policy contract is documented in
/// kfac/compute/eigendecomposition.hpp.
///
/// The eigenbases Q_A and Q_G are the eigen method's (computed at inverse updates, from the
/// same running factors). The Kronecker product of their eigenvalues is replaced by a scaling
/// S, one entry per weight (Sᵀ is A_dim × G_dim, the layout of Γᵀ): the running average of the
/// second moment of the per-example gradients in the eigenbasis,
///
///     Ŝᵀ = (1/N) Σ_n (Q_Aᵀ Γ_nᵀ Q_G)∘²        (kfac/backend/detail/cpu_ekfac_scaling.hpp)
///
/// estimated at every factor update from the step's activations and output gradients in the
/// bases in force after that step's inverse update: S ← Ŝ at a step that computed new bases
/// (the paper re-estimates the scaling in each new eigenbasis), S ← ξS + (1 − ξ)Ŝ at the other
/// factor updates (ξ = options.factor_decay, as the factors'). Until a factor update estimates
/// it, S = λ_A λ_Gᵀ (K-FAC's own scaling: an inverse update on a step without a factor update,
/// identity factors). The gradient is preconditioned as
///
///     Pᵀ = Q_A ((Q_Aᵀ Γᵀ Q_G) ⊘ (Sᵀ + γ)) Q_Gᵀ,
///
/// dividing by the step's damping γ at every step (no product is precomputed: S changes at every
/// factor update), then kl_clip as under the other methods. With S = λ_A λ_Gᵀ this is, bit for
/// bit, the eigen method with compute_eigenvalue_outer_product = false.
///
/// What it supports so far (each other case is refused by name when the preconditioner is
/// built or a layer registered): the backends with ekfac_operations (kfac/backend/
/// ekfac_operations.hpp: the CPU backend, and the CUDA backend, whose estimate runs by
/// strided-batched GEMMs in chunks of examples, kfac/backend/detail/device_ekfac_scaling.cuh);
/// one process, or several under every KAISA
/// strategy and DP-KFAC (kfac/detail/engine_second_order.hpp, update_scaling(): under KAISA
/// every rank projects its own examples into the layer's bases, which a layer's column
/// broadcasts to the other ranks under HYBRID_OPT and MEM_OPT, and one allreduce per factor
/// update averages the estimates by examples; under DP-KFAC the owner estimates S from its own
/// examples, as its factors); layers whose factors are a dense Kronecker pair of one group
/// (Linear, Conv1d, Conv2d, and each group of a grouped convolution, from its own channels),
/// with weight sharing expand or reduce; a layer applied several times in a pass (an example's
/// gradient sums its applications' before the square); several passes per step (accumulate():
/// every pass's rows are kept to the step, and S is the mean over all their examples); either
/// statistics (under per_example, S is N²·Ŝ: the per-example Fisher's diagonal, as
/// A and G are its factors; kfac/detail/statistic_scale.hpp), either averaging of the factors,
/// and the reference damping.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kfac/backend/cpu_eigen.hpp"
#include "kfac/backend/detail/cpu_ekfac_scaling.hpp"
#include "kfac/backend/ekfac_operations.hpp"
#include "kfac/checkpoint/second_order_checks.hpp"
#include "kfac/compute/eigendecomposition.hpp"
#include "kfac/detail/compute_impl.hpp"
#include "kfac/detail/statistic_scale.hpp"
#include "kfac/detail/statistics_views.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"

namespace kfac {
namespace compute {

/// Eigenvalue-corrected K-FAC: the eigen method's bases with a scaling S re-estimated from the
/// per-example gradients at every factor update (this file's comment says how, and what it
/// supports).
struct ekfac {
    /// The method's name, as checkpoints record it (compute_method) and the ranks agree on.
    static constexpr const char* name = "ekfac";
};

}  // namespace compute

namespace backend {

/// The CPU backend's EKFAC operations, for it and every backend derived from it (the replay's
/// staged backend).
template <class Backend>
    requires std::derived_from<Backend, cpu_eigen<typename Backend::scalar_type>>
struct ekfac_operations<Backend> : detail::cpu_ekfac_operations<typename Backend::scalar_type> {};

}  // namespace backend

namespace detail {

/// EKFAC on a backend with ekfac_operations (kfac/backend/ekfac_operations.hpp): the CPU
/// backend and the CUDA backend.
template <class Backend>
struct compute_impl<compute::ekfac, Backend> : compute_impl<compute::eigendecomposition, Backend> {
    static_assert(backend::ekfac_operations<Backend>::supported,
                  "kfac: compute::ekfac needs the backend's EKFAC operations (kfac/backend/ekfac_operations.hpp): "
                  "backend::cpu_eigen and backend::cuda have them; use compute::eigendecomposition on this backend");
    using eigen = compute_impl<compute::eigendecomposition, Backend>;
    using ops = backend::ekfac_operations<Backend>;
    using tag = compute::ekfac;
    using typename eigen::factor_data;
    using typename eigen::matrix;
    using typename eigen::scalar;
    using typename eigen::vector;

    /// Whether a method re-estimates a scaling at factor updates (the engine's update_scaling()).
    static constexpr bool estimates_scaling = true;

    struct layer_data {
        factor_data a, g;
        matrix scaling;  ///< Sᵀ (A_dim × G_dim)
        /// Named by the blocks under the eigen method; always empty here (nothing precomputed).
        matrix inverse_eigen_product;
        bool has_product = false;
    };
    /// One pass's activations and output gradients as the statistics read them, copied at the
    /// capture and kept to the step's estimate (after its inverse update): one pair per
    /// application of the layer in the pass, and the loss scale the pass was taken under.
    struct kept_pass {
        std::vector<typename ops::rows_copy> activation_copies, gradient_copies;
        std::vector<tensor_view<const scalar>> activations, output_gradients;  ///< views of the copies
        double loss_scale = 1.0;
    };
    /// Preconditioning scratch, the step's kept passes, and the estimate's scratch.
    struct workspace {
        matrix t1, t2;
        std::vector<kept_pass> kept;  ///< this step's passes (several with accumulate())
        typename ops::scratch scaling_ws;
        matrix estimate;       ///< Ŝᵀ of the step
        matrix pass_estimate;  ///< one pass's, when the step has several
    };

    /// No product is precomputed: S starts as λ_A λ_Gᵀ, K-FAC's scaling, until estimated.
    static void finalize_eigen_product(layer_data& l, double, const options&) {
        l.has_product = false;
        l.inverse_eigen_product.resize(0, 0);
        ops::outer_product(l.a.lambda, l.g.lambda, l.scaling);
    }
    /// Whether the data's D = 1/(λ_A λ_Gᵀ + γ) is precomputed: never.
    static bool keeps_product(const options&) { return false; }
    /// Sizes the data beyond the eigen method's (the blocks' prepare_receive()).
    static void size_extras(layer_data& l, std::int64_t a_dim, std::int64_t g_dim) { l.scaling.resize(a_dim, g_dim); }

    /// V'ᵀ ← Vᵀ ⊘ (Sᵀ + γ).
    static void divide_by_damped_eigenvalues(const layer_data& l, double damping, matrix& v_t) {
        ops::divide_by_damped(v_t, l.scaling, static_cast<scalar>(damping));
    }

    /// The eigen method's payloads, and S (K-FAC's λ_A λ_Gᵀ at an inverse update, which a
    /// receiver uses until the next factor update re-estimates it on every rank).
    template <class F>
    static void for_each_payload(layer_data& l, factor_side side, F&& f) {
        auto send = [&](auto& m) {
            if (m.size() != 0) f(m.data(), static_cast<std::size_t>(m.size()));
        };
        if (side == factor_side::a) {
            send(l.a.q);
            send(l.a.lambda);
        } else {
            send(l.g.q);
            send(l.g.lambda);
            send(l.scaling);
        }
    }

    template <class LayerData, class F>
    static void for_each_tensor(LayerData& l, F&& f) {
        eigen::for_each_tensor(l, f);
        f("scaling", l.scaling, 2);
    }

    /// The eigen method's checks, and a scaling of second moments (no negative entry).
    static checkpoint::second_order_fault loaded_fault(const checkpoint::loaded_second_order& in) {
        if (checkpoint::second_order_fault fault = eigen::loaded_fault(in)) return fault;
        if (const checkpoint::tensor* s = in.tensor_named("scaling")) {
            const std::vector<double> v = s->values<double>();
            for (std::size_t i = 0; i < v.size(); ++i)
                if (!(v[i] >= 0.0))
                    return {"scaling", "holds " + checkpoint::second_order_detail::text(v[i]) + " at [" +
                                           std::to_string(i) + "]; a scaling is a mean of squares, >= 0"};
        }
        return {};
    }

    /// Why a layer of description `d` cannot be preconditioned by EKFAC (empty: it can).
    static std::string unsupported_layer(const layer_description& d) {
        if (d.kind != layer_kind::linear && !is_convolution(d.kind))
            return std::string("compute::ekfac preconditions layers whose factors are a dense Kronecker pair "
                               "(Linear, Conv1d, Conv2d); this layer's kind, ") +
                   kind_name(d.kind) + ", has none: skip it (options.skip_layers) or use compute::eigendecomposition";
        return {};
    }

    /// Keeps copies of one pass's views, every application's (as the statistics read them), and
    /// its loss scale; the step's first pass drops what an earlier, unfinished step left.
    static void keep_rows(workspace& w, const std::vector<tensor_view<const scalar>>& a,
                          const std::vector<tensor_view<const scalar>>& g, double loss_scale, bool first_pass) {
        if (first_pass) w.kept.clear();
        kept_pass& pass = w.kept.emplace_back();
        pass.loss_scale = loss_scale;
        pass.activation_copies.resize(a.size());
        pass.gradient_copies.resize(g.size());
        for (std::size_t k = 0; k < a.size(); ++k) {
            pass.activations.push_back(ops::keep(a[k], pass.activation_copies[k]));
            pass.output_gradients.push_back(ops::keep(g[k], pass.gradient_copies[k]));
        }
    }
    [[nodiscard]] static bool has_kept_rows(const workspace& w) { return !w.kept.empty(); }
    [[nodiscard]] static std::size_t kept_passes(const workspace& w) { return w.kept.size(); }
    /// Drops the passes after the first `passes` (a pass whose capture failed).
    static void keep_only(workspace& w, std::size_t passes) {
        if (w.kept.size() > passes) w.kept.resize(passes);
    }
    static void release_rows(workspace& w) { w.kept = std::vector<kept_pass>{}; }  // memory freed too
    /// The examples of the step's kept passes (each pass's examples are its own).
    [[nodiscard]] static std::int64_t kept_examples(const layer_description& d, const workspace& w) {
        std::int64_t n = 0;
        for (const auto& pass : w.kept) n += examples_in(d, pass.activations.front());
        return n;
    }

    /// w.estimate ← Ŝᵀ from the kept passes in l's bases: each pass's estimate (an example's
    /// gradient summing its applications), the pass's loss scale s removed (Ŝ is quadratic in the
    /// output gradients: 1/s²) and, under the per-example statistics, times N_p² (N_p the pass's
    /// examples: per_example_scaling_scale()); several passes (accumulate()) are averaged weighted
    /// by their examples, the mean over every example of the step. False: it is not finite.
    static bool estimate_scaling(const layer_data& l, const layer_description& d, bool per_example, workspace& w) {
        auto factor_of = [&](const kept_pass& pass) {
            const double scale = per_example ? detail::per_example_scaling_scale(d, pass.activations.front()) : 1.0;
            return scale / (pass.loss_scale * pass.loss_scale);  // 1/s² as ever for scale 1
        };
        if (w.kept.size() == 1) {
            const kept_pass& pass = w.kept.front();
            ops::accumulate(w.estimate, d, pass.activations, pass.output_gradients, l.a.q, l.g.q, scalar(0), w.scaling_ws);
            const double factor = factor_of(pass);
            if (factor != 1.0) ops::scale(w.estimate, static_cast<scalar>(factor));
            return Backend::all_finite(w.estimate);
        }
        w.estimate = Backend::zeros(d.a_dim(), d.g_dim());
        double examples = 0.0;
        for (const kept_pass& pass : w.kept) {
            ops::accumulate(w.pass_estimate, d, pass.activations, pass.output_gradients, l.a.q, l.g.q, scalar(0),
                            w.scaling_ws);
            const auto n = static_cast<double>(examples_in(d, pass.activations.front()));
            ops::add_scaled(w.estimate, static_cast<scalar>(n * factor_of(pass)), w.pass_estimate);
            examples += n;
        }
        w.pass_estimate = matrix{};
        if (examples > 0.0) ops::divide(w.estimate, static_cast<scalar>(examples));
        return Backend::all_finite(w.estimate);
    }
    /// The estimate times `examples` (its weight in a sum over the ranks).
    static void weight_estimate(workspace& w, scalar examples) { ops::scale(w.estimate, examples); }
    /// The sum over the ranks divided by their `examples`; false: it is not finite.
    static bool unweight_estimate(workspace& w, scalar examples) {
        ops::divide(w.estimate, examples);
        return Backend::all_finite(w.estimate);
    }
    /// S ← Ŝ (`restart`: the bases are new) or S ← ξS + (1 − ξ)Ŝ.
    static void update_scaling(layer_data& l, const workspace& w, double decay, bool restart) {
        if (restart) {
            l.scaling = w.estimate;
            return;
        }
        ops::blend(l.scaling, w.estimate, static_cast<scalar>(decay));
    }
};

}  // namespace detail
}  // namespace kfac
