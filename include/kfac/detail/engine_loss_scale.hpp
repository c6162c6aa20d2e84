// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_loss_scale.hpp
/// Loss scaling (options.loss_scale): the overflow vote of a step and the skipped step. The
/// host multiplied its loss by s; when s was too large, some gradient overflowed, the host's
/// scaler will skip its optimizer step and lower s, and K-FAC must skip the step with it:
/// folding the overflowed statistics in would leave inf in the factors, and preconditioning
/// would zero gradients the scaler then never sees as overflowed.

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kfac/comm/serial.hpp"
#include "kfac/detail/engine.hpp"
#include "kfac/detail/number_conversion.hpp"

namespace kfac::detail {

/// Whether a view the step reads (in the compute type) is finite: on the host by its bits, in
/// device memory by the backend (a host backend never holds device views: the checks refused
/// them).
template <class Backend, class T>
[[nodiscard]] bool view_finite(const tensor_view<T>& view) {
    const tensor_view<const T> v = as_const(view);
    if (v.empty()) return true;
    if (v.space == memory_space::device) {
        if constexpr (requires { Backend::device_view_finite(v); })
            return Backend::device_view_finite(v);
        else
            throw error("options.loss_scale with device views needs a backend that checks them "
                        "(device_view_finite); this backend has none");
    }
    return all_finite(v.data, v.size(), precision_of<std::remove_const_t<T>>);
}

/// One allreduce of a flag over the ranks, made only with loss scaling on (which every rank
/// agreed on in the configuration, so every rank makes it or none does).
template <class Backend, class CommPolicy, class ComputeMethod>
bool engine<Backend, CommPolicy, ComputeMethod>::overflowed(const step_plan& plan) {
    if (!loss_scaling(options_)) return false;
    std::vector<std::int64_t> overflow{0};
    for (const auto& l : layers_) {
        const auto& s = l.scratch;
        bool finite = true;
        if (s.active) finite = view_finite<Backend>(s.weight_gradient) && view_finite<Backend>(s.bias_gradient);
        if (plan.factor_update && l.role.holds_factors)
            for (std::size_t i = 0; finite && i < s.activations.size(); ++i)
                finite = view_finite<Backend>(s.activations[i]) && view_finite<Backend>(s.output_gradients[i]);
        if (!finite) {
            overflow[0] = 1;
            break;
        }
    }
    comm::announce_phase(comm_, "the step's plan (the loss-scale overflow vote)");
    comm_.allreduce_max(overflow);
    return overflow[0] != 0;
}

/// Reads the pass (the host's end_pass, agreed: as a counted step does) and drops the
/// statistics accumulate() folded into this step; the step count, the running factors, the
/// second-order data and the host's gradients stay as they are.
template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::skip() {
    agree_on([&] { end_pass(); });
    passes_ = 0;
    applied_in_step_ = false;
    if constexpr (method_estimating_scaling<method>)  // the rows of the step's accumulate() passes
        for (auto& l : layers_) method::release_rows(l.scratch.method_ws);
    health_.add({.skipped_steps = 1});
}

}  // namespace kfac::detail
