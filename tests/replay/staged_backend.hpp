// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file staged_backend.hpp
/// The CPU backend declared device-resident: the preconditioner then moves every collective
/// payload through kfac::detail::host_staging (download into pinned buffers, collective,
/// upload), exactly as it does for backend::cuda with a communication library that is not
/// CUDA-aware. Its "pinned" buffers are plain host memory and download/upload are copies, so
/// the staging path runs, and is checked against the golden cases under mpiexec, without a
/// GPU: a receiver whose upload were lost would keep stale factors or gradients.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <kfac/backend/cpu_eigen.hpp>

namespace kfac_replay {

/// Bytes moved by staged_backend's download() and upload(), for tests to assert on.
inline std::atomic<std::size_t>& staged_bytes() {
    static std::atomic<std::size_t> bytes{0};
    return bytes;
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

    /// A device backend's batched gradient checks (kfac/backend/gradient_checks.hpp), so the
    /// preconditioner's batched path runs here as it does for backend::cuda: each pair's
    /// non-finite entries, and its dot product as the CPU backend's frobenius_dot computes it
    /// (so kl_clip is the same, bitwise).
    using matrix = typename kfac::backend::cpu_eigen<Scalar>::matrix;
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
