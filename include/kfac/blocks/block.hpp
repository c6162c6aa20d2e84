// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file block.hpp
/// A curvature block: what the factors of one registered record are (a dense Kronecker pair,
/// an Embedding's diagonal A beside a dense G, a normalisation layer's unit-wise blocks) and
/// everything K-FAC does that depends on it, as kfac-jax's curvature blocks own theirs: the
/// storage of the running factors and their identity start, the statistic of a pass, its
/// finiteness, scaling and running average, the second-order data under each compute method,
/// the preconditioning of the gradient, and the costs the scheduler and the placement weigh.
///
/// The engine (kfac/detail/engine.hpp) holds no branch on a factor's structure: each record
/// points at the block of its kind and every structure-dependent step goes through it. A
/// block is stateless: the matrices it works on are the record's (kfac/detail/layer_record.hpp).
///
/// A block kind is a struct with
/// ```
///   static bool holds(const layer_description&);          // is this layer of the kind?
///   static block_layout layout(const layer_description&); // its storage, from the description alone
///   template <class Backend, class Method> class ops;     // a kfac::blocks::block<Backend, Method>
/// ```
/// listed once in kfac/blocks/kinds.hpp.

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kfac/blocks/method_of.hpp"
#include "kfac/detail/compute_impl.hpp"
#include "kfac/detail/damping_terms.hpp"
#include "kfac/detail/layer_checks.hpp"
#include "kfac/detail/layer_record.hpp"
#include "kfac/detail/statistic_scale.hpp"
#include "kfac/detail/task_parallel.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"

namespace kfac::blocks {

using detail::factor_side;  ///< the A or the G side of a layer's factors

/// What a layer's block is, from its description alone: what placement, checkpoints and the
/// schedule study need, none of which has a backend.
struct block_layout {
    const char* name = "";  ///< the kind's name: "dense Kronecker pair", ...
    ///@{
    /// How each running factor is stored (kfac/layers/layer_description.hpp), which is what a
    /// checkpoint's value checks read.
    factor_structure a_structure = factor_structure::dense;
    factor_structure g_structure = factor_structure::dense;
    ///@}
    ///@{
    /// The running A factor's storage: a_rows × a_cols.
    std::int64_t a_rows = 0, a_cols = 0;
    ///@}
    std::int64_t g_dim = 0;               ///< the running G factor's storage: g_dim × g_dim
    int a_tensor_rank = 2;                ///< in a checkpoint; 1: A is saved as the vector of its diagonal
    /// The (A side, G side) sizes the assignment strategies weigh (kfac/assignment/placement_costs.hpp).
    std::pair<std::int64_t, std::int64_t> placement{0, 0};
};

/// β of an application's statistic: 0 for the step's first (it overwrites the sum the previous
/// step left), 1 after. `folded_before`: applications folded into the sum by earlier passes.
template <class Scalar>
[[nodiscard]] Scalar statistic_beta(std::int64_t folded_before, std::size_t i) noexcept {
    return folded_before == 0 && i == 0 ? Scalar(0) : Scalar(1);
}

/// One pass's applications of a record as its statistic reads them (statistic_view(), the
/// group's channels of a grouped convolution already gathered).
template <class Scalar>
struct statistic_pass {
    ///@{
    /// The applications' activations and output gradients, one view each.
    std::vector<tensor_view<const Scalar>> activations, output_gradients;
    ///@}
    std::int64_t folded_before = 0;  ///< applications folded in by earlier passes of the step
    ///@{
    /// Elements of all the activation views and of all the output-gradient views: the weights
    /// of the statistic tasks.
    double activation_elements = 0.0, gradient_elements = 0.0;
    ///@}
    conv_patch_mode patches = conv_patch_mode::reference;  ///< options.conv_patches
    /// Each application's scales (options.statistics); empty: the reference statistics.
    std::vector<detail::statistic_scales> scales{};
};

/// Folds one application into a statistic `sum` multiplied by c: sum ← sum + c·X, from
/// add(β), which computes sum ← β·sum + X (β = 0 for the step's first application, which
/// overwrites), and scale(f), which computes sum ← f·sum. With c = 1, add(β) alone, as the
/// reference statistics are folded.
template <class Scalar, class Add, class Scale>
void fold_scaled(double c, Scalar beta, Add&& add, Scale&& scale) {
    if (c == 1.0) {
        add(beta);
        return;
    }
    if (beta != Scalar(0)) scale(static_cast<Scalar>(1.0 / c));
    add(beta);
    scale(static_cast<Scalar>(c));
}

/// The eigenvalues of a dense symmetric factor, on the host ({NaN} when the decomposition fails).
template <class Backend>
[[nodiscard]] std::vector<double> host_eigenvalues(const typename Backend::matrix& F) {
    typename Backend::matrix q;
    typename Backend::vector lambda;
    if (!Backend::symmetric_eigen(F, q, lambda)) return {std::numeric_limits<double>::quiet_NaN()};
    const typename Backend::matrix column = lambda;
    const auto& h = Backend::to_host(column);
    std::vector<double> out(static_cast<std::size_t>(h.rows()));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(h(static_cast<std::int64_t>(i), 0));
    return out;
}

/// The operations of a block kind on `Backend` under the compute method `Method`
/// (a detail::compute_impl). One constant instance per kind serves every record of the kind.
template <class Backend, class Method>
class block {
public:
    using matrix = typename Backend::matrix;         ///< the backend's matrix
    using scalar = typename Backend::scalar_type;    ///< the backend's compute type
    using record = detail::layer_record<Backend, Method>;  ///< all a registered record holds
    using state = detail::layer_state<Backend, Method>;    ///< its running factors and second-order data
    using statistics = detail::step_statistics<Backend>;   ///< its statistics of the step in progress
    using factor_data = typename Method::factor_data;  ///< the method's second-order data of one factor
    using layer_data = typename Method::layer_data;    ///< the method's second-order data of a layer
    using workspace = typename Method::workspace;      ///< the method's preconditioning scratch

    block() = default;
    block(const block&) = delete;
    block& operator=(const block&) = delete;
    virtual ~block() = default;

    /// The kind's storage of a layer (its kind's static layout()).
    [[nodiscard]] virtual block_layout layout(const layer_description& d) const = 0;

    // ---- registration ----
    /// Throws detail::layer_error(who, why) when this backend cannot hold the block.
    virtual void check_backend(const detail::named_layer& who, const layer_description& d) const = 0;
    /// Running factors at the identity (never estimated ones stay there).
    virtual void start(state& s, const layer_description& d) const = 0;
    /// Statistics zero (at registration, and on a rank that saw no application: it contributes
    /// nothing to the average).
    virtual void clear_statistic(statistics& s, const layer_description& d) const = 0;

    // ---- statistics and running factors ----
    /// The tasks that fold `pass` into l.statistics.a_sum/g_sum; each reads the record and its views.
    [[nodiscard]] virtual std::vector<detail::task> statistic_tasks(record& l, statistic_pass<scalar> pass) const = 0;
    /// Whether every entry of the step's statistics is finite.
    [[nodiscard]] virtual bool statistic_finite(const statistics& s) const = 0;
    /// Statistics ← factor · statistics (the rows weight of the average over ranks).
    virtual void scale_statistic(statistics& s, scalar factor) const = 0;
    /// Whether the A statistic is the lower triangle of a symmetric matrix when it is square
    /// (an allreduce may then send the triangle only); the G statistic always is.
    [[nodiscard]] virtual bool a_statistic_is_triangle() const = 0;
    /// F ← decay·F + weight·statistic for every estimated factor (a triangle statistic is
    /// mirrored in place first).
    virtual void average(state& s, statistics& step, scalar decay, scalar weight) const = 0;

    // ---- second-order data ----
    /// The mean eigenvalues (trace / dimension) of the running factors (m_A, m_G); m_G = 1
    /// for a G that is not estimated.
    [[nodiscard]] virtual std::pair<double, double> mean_eigenvalues(const state& s) const = 0;
    /// The eigenvalues of the running factors (A's, G's) on the host, for the curvature
    /// report (kfac/curvature_report.hpp); {NaN} for a factor whose decomposition failed.
    [[nodiscard]] virtual std::pair<std::vector<double>, std::vector<double>> spectra(const state& s) const = 0;
    /// Whether G is estimated (and damped): false for a unit-wise block.
    [[nodiscard]] virtual bool estimates_g() const { return true; }
    /// Where the damping γ of an inverse update goes for this layer (kfac/detail/damping_terms.hpp).
    [[nodiscard]] detail::damping_terms damping_of(const state& s, double gamma, const options& o) const {
        std::pair<double, double> means{1.0, 1.0};
        if (detail::damping_reads_factors(o)) means = mean_eigenvalues(s);
        return detail::damping_terms_of(o, under_eigendecomposition<Method>, estimates_g(), gamma, means.first,
                                        means.second);
    }
    /// The relative cost of one side's second-order computation (the task scheduler's weight).
    [[nodiscard]] virtual double second_order_cost(const layer_description& d, factor_side side) const = 0;
    /// One side's second-order data from its running factor F; false keeps the old data.
    /// `damping`: the side's term (damping_terms::of): added to F's eigenvalues, or to its
    /// diagonal before the inverse. `previous`: this rank's data of the factor so far (empty
    /// before its first computation).
    virtual bool compute(factor_side side, const matrix& F, double damping, const options& o,
                         const factor_data& previous, factor_data& out) const = 0;
    /// Whether a side's data counts in eigenbasis_counts() (a dense factor's eigenvectors).
    [[nodiscard]] virtual bool counts_basis(factor_side side) const = 0;
    /// Per-layer extras once both sides are current (the eigenvalue outer product, say), with
    /// the damping added to the product (damping_terms::product).
    virtual void finalize(layer_data& l, double damping, const options& o) const = 0;
    /// The data of identity factors, for a rank whose first computation failed.
    virtual void identity_data(layer_data& l, const layer_description& d, const detail::damping_terms& t,
                               const options& o) const = 0;
    /// Sizes a receiver's data so that the method's payloads can be received in place.
    virtual void prepare_receive(layer_data& l, const layer_description& d, const options& o) const = 0;
    /// Sizes the full data, as the rank that computed both sides holds it (checkpoints).
    virtual void prepare_full(layer_data& l, const layer_description& d, const options& o) const = 0;

    // ---- preconditioning ----
    /// The relative cost of preconditioning the layer's gradient (the task scheduler's weight).
    [[nodiscard]] virtual double precondition_cost(const layer_description& d) const = 0;
    /// l.scratch.gamma ← Γᵀ from the host's gradient views (l.scratch.weight_gradient, bias).
    virtual void load_gradient(record& l) const = 0;
    /// The host's gradient views ← scale · l.scratch.preconditioned, as load_gradient read them.
    virtual void store_gradient(record& l, scalar scale) const = 0;
    /// Pᵀ from Γᵀ (both A_dim × G_dim) with the damping of this step.
    virtual void precondition(const layer_data& l, const matrix& gamma_t, double damping, const options& o,
                              workspace& w, matrix& p_t) const = 0;
};

}  // namespace kfac::blocks
