// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cuda_storage.cuh
/// What every part of the CUDA backend (kfac/backend/cuda.cuh) stands on: the device matrix
/// type, the solver scratch of a thread, and device_calls<Scalar>, the checked ways to launch a
/// Thrust kernel, to name a view's device pointer, to check a matrix's finiteness and to read a
/// solver's status.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>

#include "kfac/backend/detail/cuda_support.cuh"
#include "kfac/backend/detail/device_kernels.cuh"
#include "kfac/config.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::backend::cuda_detail {

/// A column-major rows × cols matrix in device memory (a vector is n × 1). Copies are
/// device-to-device; resize() keeps nothing, like Eigen's.
template <class T>
class device_matrix {
public:
    using index = std::int64_t;

    device_matrix() = default;
    device_matrix(index rows, index cols) { resize(rows, cols); }
    device_matrix(const device_matrix& o) { *this = o; }
    device_matrix(device_matrix&&) noexcept = default;
    device_matrix& operator=(device_matrix&&) noexcept = default;
    device_matrix& operator=(const device_matrix& o) {
        if (this == &o) return *this;
        resize(o.rows_, o.cols_);
        if (size() > 0)
            check(cudaMemcpyAsync(data(), o.data(), static_cast<std::size_t>(size()) * sizeof(T),
                                  cudaMemcpyDeviceToDevice, stream()),
                  "cudaMemcpyAsync");
        return *this;
    }
    ~device_matrix() = default;

    void resize(index rows, index cols) {
        if (rows * cols != size()) buffer_ = device_buffer<T>(static_cast<std::size_t>(rows * cols));
        rows_ = rows;
        cols_ = cols;
    }
    void resize(index n) { resize(n, 1); }

    [[nodiscard]] T* data() noexcept { return buffer_.data(); }
    [[nodiscard]] const T* data() const noexcept { return buffer_.data(); }
    [[nodiscard]] index rows() const noexcept { return rows_; }
    [[nodiscard]] index cols() const noexcept { return cols_; }
    [[nodiscard]] index size() const noexcept { return rows_ * cols_; }

private:
    device_buffer<T> buffer_;
    index rows_ = 0, cols_ = 0;
};

/// Scratch of the solver calls of one thread, kept between calls.
template <class T>
struct solver_scratch {
    device_buffer<T> work;
    device_buffer<int> info{1};
    device_buffer<int> pivots;

    static solver_scratch& of_this_thread() {
        thread_local solver_scratch s;
        return s;
    }
    /// The status the last solver call left in `info` (synchronises).
    int read_info() {
        int h = 0;
        note_blocking_download();
        check(cudaMemcpy(&h, info.data(), sizeof(int), cudaMemcpyDeviceToHost), "cudaMemcpy(devInfo)");
        return h;
    }
};

/// The checked helpers the backend's parts share (all static).
template <class Scalar>
struct device_calls {
    using index = std::int64_t;

    static std::size_t bytes(index count) { return static_cast<std::size_t>(count) * sizeof(Scalar); }

    /// cuBLAS and cuSOLVER take int dimensions.
    static int narrow(index v) {
        if (v > static_cast<index>(std::numeric_limits<int>::max())) {
            std::string what = std::to_string(v);  // appended: GCC 12 -Wrestrict bug 105329
            what += " exceeds the 32-bit dimensions cuBLAS and cuSOLVER take";
            throw error(what);
        }
        return static_cast<int>(v);
    }

    static auto policy() { return thrust::cuda::par_nosync.on(cuda_detail::stream()); }
    static auto sync_policy() { return thrust::cuda::par.on(cuda_detail::stream()); }

    /// Thrust reports failures as thrust::system_error; the library's callers expect kfac::error.
    template <class F>
    static void launch(const char* what, F&& f) {
        try {
            f();
        } catch (const thrust::system_error& e) {
            throw error(std::string("Thrust kernel ") + what + " failed: " + e.what());
        }
    }

    /// A device pointer to the view's elements: the view's own when it is in device memory,
    /// else a copy in `buffer`.
    static const Scalar* on_device(tensor_view<const Scalar> v, cuda_detail::device_buffer<Scalar>& buffer) {
        if (v.space == memory_space::device) return v.data;
        buffer.reserve(static_cast<std::size_t>(v.size()));
        note_upload();
        cuda_detail::check(cudaMemcpyAsync(buffer.data(), v.data, bytes(v.size()), cudaMemcpyHostToDevice,
                                           cuda_detail::stream()),
                           "cudaMemcpyAsync(host view)");
        return buffer.data();
    }

    /// `host`'s elements copied into `device` (grown as needed), queued on the stream: the
    /// tables batched kernels read. A pageable source is staged before the call returns, so it
    /// may go at once.
    template <class T>
    static T* upload_table(const std::vector<T>& host, device_buffer<T>& device, const char* what) {
        device.reserve(host.size());
        note_upload();
        check(cudaMemcpyAsync(device.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream()), what);
        return device.data();
    }

    /// Whether every element of `m` is finite (one reduction the host waits for).
    static bool all_finite(const device_matrix<Scalar>& m) {
        bool ok = false;
        launch("count_non_finite", [&] {
            note_blocking_download();
            ok = kernels::count_non_finite(sync_policy(), m.data(), m.size()) == 0;
        });
        return ok;
    }

    /// devInfo: 0 success, > 0 a numerical failure (the caller keeps its previous data),
    /// < 0 an invalid argument, which is a bug and throws.
    static bool solver_succeeded(int info, const char* call) {
        if (info < 0)
            cuda_detail::fail(call, "devInfo", info, "invalid argument (parameter -devInfo)");
        return info == 0;
    }
};

}  // namespace kfac::backend::cuda_detail
