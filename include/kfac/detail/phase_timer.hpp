// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file phase_timer.hpp
/// The timer of preconditioner::step(): a steady-clock lap at the end of each phase
/// (kfac/step_times.hpp), and, where the CUDA toolkit's NVTX v3 headers are on the include path
/// (a kfac::cuda build, nvcc), an NVTX range per phase ("kfac step: capture", ...) that Nsight
/// Systems shows on the host thread's timeline. NVTX v3 is header-only and costs a branch per
/// call without a profiler attached; without its headers nothing is emitted.

#include <chrono>
#include <cstddef>

#if defined(__has_include)
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define KFAC_HAS_NVTX 1
#endif
#endif

#include "kfac/step_times.hpp"

namespace kfac::detail {

class phase_timer {
    using clock = std::chrono::steady_clock;

public:
    /// Starts the first phase; `out` is reset and filled as the phases end.
    explicit phase_timer(step_times& out) noexcept : out_(out), start_(clock::now()) {
        out_ = {};
        begin_range(step_phase::plan);
    }
    phase_timer(const phase_timer&) = delete;
    phase_timer& operator=(const phase_timer&) = delete;
    ~phase_timer() { end_range(); }

    /// `finished` ended now (`ran` false: the step skipped it, and it took 0); the next begins.
    void lap(step_phase finished, bool ran = true) noexcept {
        const auto now = clock::now();
        out_.seconds[static_cast<std::size_t>(finished)] = ran ? std::chrono::duration<double>(now - start_).count() : 0.0;
        start_ = now;
        end_range();
        const auto next = static_cast<std::size_t>(finished) + 1;
        if (next < step_phase_count) begin_range(static_cast<step_phase>(next));
    }

private:
    void begin_range([[maybe_unused]] step_phase p) noexcept {
#if KFAC_HAS_NVTX
        static constexpr const char* names[step_phase_count] = {
            "kfac step: plan",         "kfac step: capture", "kfac step: factors",    "kfac step: second_order",
            "kfac step: precondition", "kfac step: kl_clip", "kfac step: write_back", "kfac step: commit"};
        nvtxRangePushA(names[static_cast<std::size_t>(p)]);
        open_ = true;
#endif
    }
    void end_range() noexcept {
#if KFAC_HAS_NVTX
        if (open_) nvtxRangePop();
        open_ = false;
#endif
    }

    step_times& out_;
    clock::time_point start_;
#if KFAC_HAS_NVTX
    bool open_ = false;
#endif
};

}  // namespace kfac::detail
