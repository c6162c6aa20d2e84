// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file staged_backend.hpp
/// The CPU backend declared device-resident: the preconditioner then moves every collective
/// payload through kfac::detail::host_staging (download into pinned buffers, collective,
/// upload), exactly as it does for backend::cuda with a communication library that is not
/// CUDA-aware; and, as backend::cuda has them, the batched gradient checks and the prefetched
/// decompositions, computed here by the CPU backend's own code. Its "pinned" buffers are plain host memory and download/upload are copies, so
/// the staging path runs, and is checked against the golden cases under mpiexec, without a
/// GPU: a receiver whose upload were lost would keep stale factors or gradients.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <kfac/backend/cpu_eigen.hpp>
#include <kfac/backend/detail/prefetched_eigen.hpp>

namespace kfac_replay {

/// Bytes moved by staged_backend's download() and upload(), for tests to assert on.
inline std::atomic<std::size_t>& staged_bytes() {
    static std::atomic<std::size_t> bytes{0};
    return bytes;
}

/// Decompositions staged_backend::symmetric_eigen() returned from the prefetched ones.
inline std::atomic<std::size_t>& prefetched_taken() {
    static std::atomic<std::size_t> taken{0};
    return taken;
}

template <class Scalar>
struct staged_backend : kfac::backend::cpu_eigen<Scalar> {
    static constexpr bool device_memory = true;

    class pinned_buffer {
    public:
        explicit pinned_buffer(std::size_t count) : data_(count) {}
        [[nodiscard]] Scalar* data() noexcept { return data_.data(); }
        [[nodiscard]] std::size_t size() const noexcept { return data_.size(); }

    private:
        std::vector<Scalar> data_;
    };

    static void download(const Scalar* device, Scalar* host, std::size_t count) {
        std::copy(device, device + count, host);
        staged_bytes() += count * sizeof(Scalar);
    }
    static void upload(const Scalar* host, Scalar* device, std::size_t count) {
        std::copy(host, host + count, device);
        staged_bytes() += count * sizeof(Scalar);
    }

    using matrix = typename kfac::backend::cpu_eigen<Scalar>::matrix;
    using vector = typename kfac::backend::cpu_eigen<Scalar>::vector;

    /// A device backend's prefetched decompositions (kfac/backend/batched_eigen.hpp), so the
    /// preconditioner's prefetch path runs here: every factor decomposed ahead by the CPU
    /// backend's own solver and kept, symmetric_eigen() returning the kept result (so the
    /// results are the CPU backend's, bitwise).
    using kept_eigen = kfac::backend::detail::prefetched_eigen<matrix, vector>;
    static void prefetch_symmetric_eigen(const std::vector<const matrix*>& factors) {
        for (const auto* f : factors) {
            matrix q;
            vector lambda;
            if (kfac::backend::cpu_eigen<Scalar>::symmetric_eigen(*f, q, lambda))
                kept_eigen::of_this_thread().put(f->data(), f->size(), std::move(q), std::move(lambda));
        }
    }
    static void clear_prefetched_eigen() noexcept { kept_eigen::of_this_thread().clear(); }
    static bool symmetric_eigen(const matrix& m, matrix& q, vector& lambda) {
        if (kept_eigen::of_this_thread().take(m.data(), m.size(), q, lambda)) {
            ++prefetched_taken();
            return true;
        }
        return kfac::backend::cpu_eigen<Scalar>::symmetric_eigen(m, q, lambda);
    }

    /// A device backend's batched gradient checks (kfac/backend/gradient_checks.hpp), so the
    /// preconditioner's batched path runs here as it does for backend::cuda: each pair's
    /// non-finite entries, and its dot product as the CPU backend's frobenius_dot computes it
    /// (so kl_clip is the same, bitwise).
    static void gradient_checks(const std::vector<const matrix*>& gammas, const std::vector<const matrix*>& ps,
                                std::vector<std::int64_t>& non_finite, std::vector<double>& dots) {
        non_finite.assign(gammas.size(), 0);
        dots.assign(gammas.size(), 0.0);
        for (std::size_t i = 0; i < gammas.size(); ++i) {
            for (const auto* m : {gammas[i], ps[i]})
                non_finite[i] += static_cast<std::int64_t>(std::count_if(m->data(), m->data() + m->size(),
                                                                         [](Scalar x) { return !std::isfinite(x); }));
            dots[i] = kfac::backend::cpu_eigen<Scalar>::frobenius_dot(*ps[i], *gammas[i]);
        }
    }
};

}  // namespace kfac_replay
