// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file call_guard.hpp
/// One call at a time on a preconditioner (docs/k-fac.md, "Threads"). step(), accumulate(), save(),
/// load() and registration change the factors, the second-order data and the step's
/// statistics as they go; a second such call on the same object while one is in progress
/// (from another thread) would race on them: two concurrent step() calls freed the same
/// buffers twice. The late call raises a kfac::error instead, before it touches anything or
/// issues any collective; the call in progress completes as if alone.

#include <atomic>
#include <string>

#include "kfac/config.hpp"

namespace kfac::detail {

class exclusive_calls {
public:
    exclusive_calls() = default;
    /// A copy or a moved-to preconditioner starts with no call in progress.
    exclusive_calls(const exclusive_calls&) noexcept {}
    exclusive_calls& operator=(const exclusive_calls&) noexcept { return *this; }

    /// The call in progress, for as long as it lives.
    class scope {
    public:
        explicit scope(std::atomic<const char*>* running) noexcept : running_(running) {}
        scope(const scope&) = delete;
        scope& operator=(const scope&) = delete;
        ~scope() { running_->store(nullptr, std::memory_order_release); }

    private:
        std::atomic<const char*>* running_;
    };

    /// Marks `call` ("step()", say) in progress.
    /// @throws kfac::error when another call is in progress, naming both.
    [[nodiscard]] scope enter(const char* call) {
        const char* running = nullptr;
        if (!running_.compare_exchange_strong(running, call, std::memory_order_acquire))
            throw error(std::string(call) + " was called while " + running +
                        " is in progress on the same preconditioner (from another thread, or from its on_non_finite "
                        "callback); a preconditioner serves one call at a time, so this call did nothing: make the "
                        "threads take turns (a mutex around their calls), or give each thread its own preconditioner");
        return scope(&running_);
    }

private:
    std::atomic<const char*> running_{nullptr};
};

}  // namespace kfac::detail
