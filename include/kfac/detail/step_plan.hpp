// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file step_plan.hpp
/// What one step() does, with every scheduled hyper-parameter read and checked before the
/// step changes anything: a schedule that returns an invalid value is an error that leaves
/// the preconditioner as it was, and every rank reaches the same verdict (the preconditioner
/// reads the plan inside its cross-rank agreement).

#include <cstdint>
#include <limits>
#include <optional>

#include "kfac/options.hpp"

namespace kfac::detail {

struct step_plan {
    std::int64_t step = 0;        ///< k: the number of completed step() calls
    bool factor_update = false;   ///< k % factor_update_steps == 0
    bool inverse_update = false;  ///< k % inv_update_steps == 0
    double damping = 0.0;
    double factor_decay = 0.0;    ///< read on factor-update steps only
    std::optional<double> kl_clip;
    double lr = 0.0;              ///< read only when kl_clip is set (it only scales ν)
    double loss_scale = 1.0;      ///< read on factor-update steps with loss scaling
};

/// options.loss_scale at step k, checked: finite, > 0, and such that s² and 1/s² are normal
/// numbers of the compute type (the statistics are divided by s²; check_loss_scale_representable).
template <class Scalar>
double read_loss_scale(const options& o, std::int64_t k) {
    if (!loss_scaling(o)) return 1.0;
    const double s = o.loss_scale(k);
    const std::optional<std::int64_t> step = o.loss_scale.is_schedule() ? std::optional<std::int64_t>(k) : std::nullopt;
    check_loss_scale(s, step);
    check_loss_scale_representable<Scalar>(s, step);
    return s;
}

/// Whether step k updates the factors (all accumulate() needs to know).
inline bool is_factor_update_step(const options& o, std::int64_t k) {
    const std::int64_t interval = o.factor_update_steps(k);
    check_interval("factor_update_steps", interval, k);
    return k % interval == 0;
}

/// Reads every hyper-parameter step k uses, in the precision of the factors.
/// @throws kfac::error naming the option, its value, the step and the valid range.
template <class Scalar>
step_plan read_step_plan(const options& o, std::int64_t k) {
    step_plan p;
    p.step = k;
    p.factor_update = is_factor_update_step(o, k);
    const std::int64_t inverse_interval = o.inv_update_steps(k);
    check_interval("inv_update_steps", inverse_interval, k);
    p.inverse_update = k % inverse_interval == 0;
    p.damping = o.damping(k);
    check_damping(p.damping, k);
    check_damping_representable<Scalar>(p.damping, k);
    if (p.factor_update) {
        p.factor_decay = o.factor_decay(k);
        check_factor_decay(p.factor_decay, k);
        p.loss_scale = read_loss_scale<Scalar>(o, k);
    }
    p.kl_clip = o.kl_clip(k);
    check_kl_clip(p.kl_clip, k);
    if (p.kl_clip) {
        p.lr = o.lr(k);
        check_lr(p.lr, k);
    }
    return p;
}

}  // namespace kfac::detail
