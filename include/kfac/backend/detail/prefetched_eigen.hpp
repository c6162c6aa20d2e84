// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file prefetched_eigen.hpp
/// The decompositions a backend computed ahead of symmetric_eigen() (kfac/backend/batched_eigen.hpp),
/// kept per thread until asked for: keyed by the factor's storage (its data pointer and size,
/// which do not change while the preconditioner's update runs), each taken at most once.

#include <cstdint>
#include <map>
#include <optional>
#include <utility>

namespace kfac::backend::detail {

template <class Matrix, class Vector>
class prefetched_eigen {
public:
    /// The kept decompositions of this thread (the preconditioner runs a device backend's tasks
    /// from one thread).
    static prefetched_eigen& of_this_thread() {
        thread_local prefetched_eigen kept;
        return kept;
    }

    void put(const void* factor, std::int64_t size, Matrix q, Vector lambda) {
        kept_[{factor, size}] = entry{std::move(q), std::move(lambda)};
    }

    /// The decomposition kept for this factor, moved out (then forgotten); false when none is.
    bool take(const void* factor, std::int64_t size, Matrix& q, Vector& lambda) {
        const auto it = kept_.find({factor, size});
        if (it == kept_.end()) return false;
        q = std::move(it->second.q);
        lambda = std::move(it->second.lambda);
        kept_.erase(it);
        return true;
    }

    void clear() noexcept { kept_.clear(); }
    [[nodiscard]] std::size_t size() const noexcept { return kept_.size(); }

private:
    struct entry {
        Matrix q;
        Vector lambda;
    };
    std::map<std::pair<const void*, std::int64_t>, entry> kept_;
};

}  // namespace kfac::backend::detail
