// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file layer_record.hpp
/// Everything the preconditioner keeps per registered layer, in four named parts:
/// * layer_binding: the host's layer (its name, description and how to reach its views;
///   kfac/detail/layer_binding.hpp);
/// * layer_state: what K-FAC has learned about it (running factors, the second-order data in
///   force), which is what a checkpoint holds;
/// * step_statistics: the statistics of the step in progress, and their rows and applications;
/// * layer_scratch: buffers reused from step to step.
/// Plus this rank's role in the layer's work (kfac/assignment/distribution_plan.hpp), and the
/// block kind that its factors' structure is.

#include <cstdint>
#include <string>
#include <vector>

#include "kfac/assignment/distribution_plan.hpp"
#include "kfac/detail/factor_storage.hpp"
#include "kfac/detail/group_views.hpp"
#include "kfac/detail/layer_binding.hpp"
#include "kfac/detail/view_conversion.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/number_view.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::blocks {
template <class Backend, class Method>
class block;
}

namespace kfac::detail {

/// What K-FAC has learned of one layer, which is what a checkpoint holds of it.
template <class Backend, class Method>
struct layer_state {
    using matrix = typename Backend::matrix;

    matrix a_factor, g_factor;  ///< running averages (the identity before the first update)
    /// With options.factor_storage: the factors as stored between steps (factor_storage.hpp);
    /// a_factor and g_factor then hold them only while a step or a report uses them.
    packed_factor packed_a, packed_g;
    /// Second-order data in force, on the ranks whose role holds it.
    typename Method::layer_data second{};
    bool has_second = false;
    /// W, the weight of the statistics in the running factors: W ← ξW + (1 − ξ) at each
    /// update, from 0, so that 1 − W is the weight the identity start keeps under the
    /// reference averaging, and F = R/W under bias-corrected averaging
    /// (options.averaging). NaN: unknown (loaded from a checkpoint that did not record it).
    double statistics_weight = 0.0;
};

/// The step in progress: the batch statistics of the passes folded in so far (lower
/// triangles of dense factors) and what they count. Scratch until step() commits; never
/// part of a checkpoint.
template <class Backend>
struct step_statistics {
    using matrix = typename Backend::matrix;
    using scalar = typename Backend::scalar_type;

    matrix a_sum, g_sum;
    scalar captured_rows = 0;  ///< rows of the passes accumulate() folded in
    scalar pass_rows = 0;      ///< rows of the pass capture_pass() folded in last
    /// Applications (calls of the layer) folded in by accumulate(), and by the last capture.
    std::int64_t captured_applications = 0;
    std::int64_t pass_applications = 0;
};

/// Buffers reused between steps.
template <class Backend, class Method>
struct layer_scratch {
    using matrix = typename Backend::matrix;
    using scalar = typename Backend::scalar_type;
    typename Backend::workspace a_ws{}, g_ws{};  ///< of the A and G statistics
    typename Method::workspace method_ws{};
    matrix gamma, preconditioned;  ///< Γᵀ and Pᵀ (A_dim × G_dim), see Backend::load_gradient
    /// A grouped convolution's block: its channels of each application's activations and
    /// output gradients (group_views.hpp), gathered for the statistics.
    std::vector<typename detail::channel_buffer_of<Backend, scalar>::type> group_channels;
    bool usable = true;            ///< false: this step's gradient is zeroed
    bool active = true;            ///< false: no gradient this step (the host left it alone)
    /// What the host's adapter said in this call's agreed checks, read once there: the layer's
    /// applications in the pass, each one's activations and output gradients (factor-update
    /// steps), and the record's rows of the gradient buffers (when active). The rest of the
    /// call works from these, so an adapter that throws can only throw where every rank agrees,
    /// before anything changes.
    /// The views as the compute type reads them: the host's own, or copies in `converted`
    /// and weight_copy/bias_copy when the host's format differs (view_conversion.hpp).
    std::int64_t applications = 0;
    std::vector<tensor_view<const scalar>> activations, output_gradients;
    tensor_view<scalar> weight_gradient, bias_gradient;
    /// Compute-type copies of views in another format: [2i] application i's activations,
    /// [2i + 1] its output gradients (held from the checks to the end of the pass).
    std::vector<converted_view<Backend>> converted;
    converted_view<Backend> weight_copy, bias_copy;
    /// The host's gradient views (the record's rows), written back from the copies.
    number_view<void> host_weight_gradient, host_bias_gradient;
    /// a_factor()/g_factor() of a layer whose factors are packed (options.factor_storage).
    mutable matrix widened_a, widened_g;
};

template <class Backend, class Method>
struct layer_record {
    layer_binding host;
    /// The operations of its block kind (kfac/blocks/kinds.hpp): everything that depends on
    /// how its factors are structured.
    const blocks::block<Backend, Method>* block = nullptr;
    assignment::rank_role role{};
    layer_state<Backend, Method> state{};
    step_statistics<Backend> statistics{};
    layer_scratch<Backend, Method> scratch{};

    [[nodiscard]] const std::string& name() const noexcept { return host.name; }
    [[nodiscard]] const layer_description& description() const noexcept { return host.description; }
};

}  // namespace kfac::detail
