// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file step_times.hpp
/// Where a step's time goes: the phases of preconditioner::step() (the pipeline its comment
/// lists) and the seconds the last step spent in each (preconditioner::last_step_times()).

#include <array>
#include <cstddef>

namespace kfac {

/// The phases of a step, in the order step() runs them.
enum class step_phase : int {
    plan,          ///< setup, the scheduled options and the host's views read and agreed, the overflow vote
    capture,       ///< this pass's factor statistics, and the host's end_pass()
    factors,       ///< the running factors, averaged over the ranks (factor-update steps)
    second_order,  ///< decompositions or inverses, and their broadcasts (inverse-update steps); under compute::ekfac also its scaling (factor-update steps)
    precondition,  ///< every layer's preconditioned gradient, shared and checked
    kl_clip,       ///< kl_clip's scale ν
    write_back,    ///< the gradients written into the host's buffers
    commit,        ///< the step counted, and the on_non_finite callbacks
};
/// The number of phases.
inline constexpr std::size_t step_phase_count = 8;

/// The phase's name, as NVTX ranges and benchmarks print it.
[[nodiscard]] constexpr const char* step_phase_name(step_phase p) noexcept {
    constexpr std::array<const char*, step_phase_count> names{"plan",         "capture", "factors",    "second_order",
                                                              "precondition", "kl_clip", "write_back", "commit"};
    return names[static_cast<std::size_t>(p)];
}

/// Seconds of wall-clock time (std::chrono::steady_clock) the last step spent in each phase, as
/// the host saw it: a phase that waits for a device or for other ranks includes the wait, and a
/// device backend's work queued in one phase and waited for in a later one counts there. A phase
/// the step did not run (no factor update, a skipped step) took 0.
struct step_times {
    std::array<double, step_phase_count> seconds{};  ///< indexed by step_phase

    /// Seconds spent in phase `p`.
    [[nodiscard]] double operator[](step_phase p) const noexcept { return seconds[static_cast<std::size_t>(p)]; }
    /// Seconds spent in all the phases together.
    [[nodiscard]] double total() const noexcept {
        double sum = 0.0;
        for (double s : seconds) sum += s;
        return sum;
    }
};

}  // namespace kfac
