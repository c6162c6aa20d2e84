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
#include <cstddef>
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
};

}  // namespace kfac_replay
