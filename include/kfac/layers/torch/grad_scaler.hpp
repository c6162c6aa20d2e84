// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/grad_scaler.hpp
/// `kfac::torch::grad_scaler`: dynamic loss scaling for fp16 training in LibTorch, which has no
/// C++ GradScaler (Debian's LibTorch 1.13): PyTorch's torch.amp.GradScaler rule, and the
/// preconditioner told the scale (options.loss_scale) so that K-FAC's statistics see the true
/// output gradients and K-FAC skips the steps the scaler skips.
///
/// ```cpp
/// kfac::torch::grad_scaler scaler;          // s = 2^16, ×2 after 2000 good steps, ×½ on overflow
/// kfac::options o;
/// o.loss_scale = scaler.loss_scale();       // read at every accumulate() and step()
/// ...
/// scaler.scale(loss).backward();
/// scaler.unscale(optimizer);                // true gradients; notes an overflow
/// if (!precond.step().skipped) optimizer.step();   // K-FAC skipped it too: same verdict
/// scaler.update();                          // lowers s after an overflow, raises it in time
/// ```
/// A room of the LibTorch adapter (kfac/layers/torch.hpp).

#include <cmath>
#include <cstdint>
#include <functional>

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include "kfac/config.hpp"

namespace kfac::torch {

/// Dynamic loss scaling: the scale s, lowered after an overflow and raised after a run of
/// good steps (above).
class grad_scaler {
public:
    /// The scaler's rule, PyTorch's GradScaler defaults.
    struct settings {
        double initial_scale = 65536.0;  ///< 2^16, PyTorch's
        double growth_factor = 2.0;      ///< s ← s × growth_factor after growth_interval good steps (> 1)
        double backoff_factor = 0.5;     ///< s ← s × backoff_factor after an overflow, in (0, 1)
        std::int64_t growth_interval = 2000;  ///< good steps before the scale grows
    };

    grad_scaler() : grad_scaler(settings{}) {}  ///< with the default settings
    /// @throws kfac::error unless initial_scale is finite and > 0, growth_factor > 1,
    ///         backoff_factor in (0, 1) and growth_interval > 0.
    explicit grad_scaler(settings s) : settings_(s), scale_(s.initial_scale) {
        if (!(std::isfinite(s.initial_scale) && s.initial_scale > 0.0 && s.growth_factor > 1.0 &&
              s.backoff_factor > 0.0 && s.backoff_factor < 1.0 && s.growth_interval > 0))
            throw error("kfac::torch::grad_scaler: initial_scale must be finite and > 0, growth_factor > 1, "
                        "backoff_factor in (0, 1) and growth_interval > 0");
    }

    /// loss · s, to back-propagate.
    [[nodiscard]] at::Tensor scale(const at::Tensor& loss) const { return loss * scale_; }

    /// Divides every parameter gradient of the optimizer by s (in place) and notes whether any
    /// of them holds an inf or a NaN (the step must then be skipped).
    void unscale(::torch::optim::Optimizer& optimizer) {
        const ::torch::NoGradGuard no_grad;
        found_inf_ = false;
        for (auto& group : optimizer.param_groups())
            for (auto& p : group.params()) {
                if (!p.grad().defined()) continue;
                auto g = p.mutable_grad();
                g.div_(scale_);
                if (!g.isfinite().all().item<bool>()) found_inf_ = true;
            }
    }
    /// Whether the last unscale() met an inf or a NaN.
    [[nodiscard]] bool found_inf() const noexcept { return found_inf_; }

    /// After the step: s × backoff when it overflowed, s × growth after growth_interval good
    /// steps in a row.
    void update() {
        if (found_inf_) {
            scale_ *= settings_.backoff_factor;
            good_steps_ = 0;
        } else if (++good_steps_ == settings_.growth_interval) {
            scale_ *= settings_.growth_factor;
            good_steps_ = 0;
        }
        found_inf_ = false;
    }

    [[nodiscard]] double current_scale() const noexcept { return scale_; }  ///< s
    /// options.loss_scale following this scaler (which must outlive the preconditioner).
    [[nodiscard]] std::function<double(std::int64_t)> loss_scale() const {
        return [this](std::int64_t) { return scale_; };
    }

private:
    settings settings_;
    double scale_;
    std::int64_t good_steps_ = 0;
    bool found_inf_ = false;
};

}  // namespace kfac::torch
