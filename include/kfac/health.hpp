// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file health.hpp
/// What the preconditioner tells about the non-finite values it met and contained.

#include <cstdint>
#include <limits>
#include <string>

#include "kfac/options.hpp"

namespace kfac {

/// Something non-finite the preconditioner met and contained (see preconditioner::health).
struct non_finite_event {
    std::string layer;          ///< the layer's registered name
    non_finite_source source;   ///< where the value was met
    std::int64_t step;          ///< the step's number k (step_result::step)
};

/// Counters of contained non-finite values. Nothing non-finite ever reaches the gradients
/// the preconditioner writes: a bad factor statistic is not folded into the running factor,
/// a failed decomposition keeps the previous one, and a layer whose gradient (or
/// preconditioned gradient, in the compute type or rounded to its view's format) is not finite
/// gets a zero gradient for that step.
struct health_counters {
    std::int64_t skipped_factor_updates = 0;  ///< batch statistics with NaN/Inf, not applied
    std::int64_t kept_decompositions = 0;     ///< decompositions that failed; previous kept
    std::int64_t zeroed_gradients = 0;        ///< layers whose gradient was zeroed for a step
    /// Steps skipped whole because, with options.loss_scale, their gradients or statistics
    /// overflowed (docs/precision.md).
    std::int64_t skipped_steps = 0;
    /// Decompositions that failed in the backend's type and were retried in double
    /// (options.fp64_retry), whether the retry succeeded or not.
    std::int64_t fp64_retries = 0;
    /// Factor updates that options.factor_storage = fp16 kept in bf16 instead, since fp16 would
    /// have flushed one of the factor's variances to zero or to a subnormal (docs/precision.md).
    std::int64_t storage_fallbacks = 0;

    /// Adds the counts of `o` (a step's, or a load's), each saturating at the largest
    /// std::int64_t: a counter never wraps, whatever a checkpoint started it at.
    void add(const health_counters& o) noexcept {
        const auto sum = [](std::int64_t& c, std::int64_t d) {
            c = d > std::numeric_limits<std::int64_t>::max() - c ? std::numeric_limits<std::int64_t>::max() : c + d;
        };
        sum(skipped_factor_updates, o.skipped_factor_updates);
        sum(kept_decompositions, o.kept_decompositions);
        sum(zeroed_gradients, o.zeroed_gradients);
        sum(skipped_steps, o.skipped_steps);
        sum(fp64_retries, o.fp64_retries);
        sum(storage_fallbacks, o.storage_fallbacks);
    }
};

/// What one step() did.
struct step_result {
    std::int64_t step = 0;        ///< its number k: the count of step() calls completed before it
    bool factor_update = false;   ///< the running factors were updated
    bool inverse_update = false;  ///< the second-order data was recomputed
    /// With options.loss_scale: the step overflowed and was skipped (nothing changed, the
    /// gradients were left as the host gave them, and the step was not counted).
    bool skipped = false;
    double kl_scale = 1.0;        ///< ν (1 when kl_clip is off, did not bind, or the step was skipped)
};

/// Dense factors a rank has computed second-order data for since construction (not saved in
/// checkpoints): with options.eigenbasis_reuse_tolerance, how many kept their previous
/// eigenvectors and how many were decomposed (every one without it).
struct eigenbasis_count {
    std::int64_t decomposed = 0;  ///< factors decomposed
    std::int64_t reused = 0;      ///< factors that kept their previous eigenvectors
};

}  // namespace kfac
