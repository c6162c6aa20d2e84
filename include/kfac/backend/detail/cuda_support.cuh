// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cuda_support.cuh
/// What the CUDA backend stands on: status checks that throw kfac::error naming the call and
/// the status, RAII device and pinned host buffers, and the per-thread cuBLAS/cuSOLVER
/// handles.
///
/// Every allocation and kernel goes to the legacy default stream. It orders the backend's
/// work after whatever the host framework queued on its default (blocking) streams, which is
/// what makes device views of a framework's buffers safe to read in place, and it lets
/// stream-ordered allocation (cudaMallocAsync) keep steady-state steps free of cudaMalloc.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include "kfac/config.hpp"

namespace kfac::backend::cuda_detail {

inline const char* status_name(cusolverStatus_t s) noexcept {
    switch (s) {
        case CUSOLVER_STATUS_SUCCESS: return "CUSOLVER_STATUS_SUCCESS";
        case CUSOLVER_STATUS_NOT_INITIALIZED: return "CUSOLVER_STATUS_NOT_INITIALIZED";
        case CUSOLVER_STATUS_ALLOC_FAILED: return "CUSOLVER_STATUS_ALLOC_FAILED";
        case CUSOLVER_STATUS_INVALID_VALUE: return "CUSOLVER_STATUS_INVALID_VALUE";
        case CUSOLVER_STATUS_ARCH_MISMATCH: return "CUSOLVER_STATUS_ARCH_MISMATCH";
        case CUSOLVER_STATUS_EXECUTION_FAILED: return "CUSOLVER_STATUS_EXECUTION_FAILED";
        case CUSOLVER_STATUS_INTERNAL_ERROR: return "CUSOLVER_STATUS_INTERNAL_ERROR";
        case CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED: return "CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED";
        case CUSOLVER_STATUS_NOT_SUPPORTED: return "CUSOLVER_STATUS_NOT_SUPPORTED";
        case CUSOLVER_STATUS_INVALID_WORKSPACE: return "CUSOLVER_STATUS_INVALID_WORKSPACE";
        default: return "cusolverStatus_t";
    }
}

/// "cusolverDnSsyevd failed: CUSOLVER_STATUS_INVALID_VALUE (3)".
[[noreturn]] inline void fail(const char* call, const char* status, long code, const char* detail = nullptr) {
    std::string what(call);
    what += " failed: ";
    what += status;
    what += " (";
    what += std::to_string(code);
    what += ')';
    if (detail) {
        what += ", ";
        what += detail;
    }
    throw error(what);
}

inline void check(cudaError_t s, const char* call) {
    if (s != cudaSuccess) {
        (void)cudaGetLastError();  // clear a sticky launch error so the next call can report its own
        fail(call, cudaGetErrorName(s), static_cast<long>(s), cudaGetErrorString(s));
    }
}
inline void check(cublasStatus_t s, const char* call) {
    if (s != CUBLAS_STATUS_SUCCESS) fail(call, cublasGetStatusName(s), static_cast<long>(s));
}
inline void check(cusolverStatus_t s, const char* call) {
    if (s != CUSOLVER_STATUS_SUCCESS) fail(call, status_name(s), static_cast<long>(s));
}

/// How often the backend made the host wait for the device, and how many copies crossed the
/// bus each way, since the process started (kfac::backend::cuda<T>::transfers()). Counted at
/// each call that synchronises (a blocking copy, a reduction whose result the host reads, a
/// solver's status, cudaStreamSynchronize) and each copy between host and device memory,
/// whatever its size: a host view read by a statistic counts as one host-to-device copy.
struct transfer_counts {
    std::int64_t synchronizations = 0, device_to_host = 0, host_to_device = 0;

    friend transfer_counts operator-(transfer_counts a, const transfer_counts& b) noexcept {
        a.synchronizations -= b.synchronizations;
        a.device_to_host -= b.device_to_host;
        a.host_to_device -= b.host_to_device;
        return a;
    }
};

/// The process's counters (relaxed atomics: the backend queues from one thread per
/// preconditioner, but several preconditioners may run in several threads).
struct transfer_ledger {
    std::atomic<std::int64_t> synchronizations{0}, device_to_host{0}, host_to_device{0};

    static transfer_ledger& process() {
        static transfer_ledger l;
        return l;
    }
    [[nodiscard]] transfer_counts read() const noexcept {
        return {synchronizations.load(std::memory_order_relaxed), device_to_host.load(std::memory_order_relaxed),
                host_to_device.load(std::memory_order_relaxed)};
    }
};

inline void note_synchronization() noexcept {
    transfer_ledger::process().synchronizations.fetch_add(1, std::memory_order_relaxed);
}
/// A copy the host waits for (cudaMemcpy and the like): one synchronisation and one copy.
inline void note_blocking_download() noexcept {
    note_synchronization();
    transfer_ledger::process().device_to_host.fetch_add(1, std::memory_order_relaxed);
}
inline void note_upload() noexcept { transfer_ledger::process().host_to_device.fetch_add(1, std::memory_order_relaxed); }
inline void note_blocking_upload() noexcept {
    note_synchronization();
    note_upload();
}
inline void note_download() noexcept { transfer_ledger::process().device_to_host.fetch_add(1, std::memory_order_relaxed); }

/// The stream every call of the backend uses (see the file comment).
inline cudaStream_t stream() noexcept { return cudaStreamLegacy; }

/// Device memory of `count` T, stream-ordered; contents undefined after allocation.
template <class T>
class device_buffer {
public:
    device_buffer() = default;
    explicit device_buffer(std::size_t count) { allocate(count); }
    device_buffer(const device_buffer&) = delete;
    device_buffer& operator=(const device_buffer&) = delete;
    device_buffer(device_buffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
    device_buffer& operator=(device_buffer&& o) noexcept {
        if (this != &o) {
            release();
            data_ = std::exchange(o.data_, nullptr);
            size_ = std::exchange(o.size_, 0);
        }
        return *this;
    }
    ~device_buffer() { release(); }

    /// Grows (never shrinks) to at least `count` elements; the contents are not kept.
    void reserve(std::size_t count) {
        if (count > size_) {
            release();
            allocate(count);
        }
    }
    [[nodiscard]] T* data() const noexcept { return data_; }
    [[nodiscard]] std::size_t size() const noexcept { return size_; }

private:
    void allocate(std::size_t count) {
        if (count == 0) return;
        void* p = nullptr;
        check(cudaMallocAsync(&p, count * sizeof(T), stream()), "cudaMallocAsync");
        data_ = static_cast<T*>(p);
        size_ = count;
    }
    void release() noexcept {
        if (data_) (void)cudaFreeAsync(data_, stream());  // a destructor must not throw
        data_ = nullptr;
        size_ = 0;
    }

    T* data_ = nullptr;
    std::size_t size_ = 0;
};

/// Page-locked host memory, for staging collectives (kfac/detail/host_staging.hpp).
template <class T>
class pinned_buffer {
public:
    explicit pinned_buffer(std::size_t count) : size_(count) {
        if (count == 0) return;
        void* p = nullptr;
        check(cudaMallocHost(&p, count * sizeof(T)), "cudaMallocHost");
        data_ = static_cast<T*>(p);
    }
    pinned_buffer(const pinned_buffer&) = delete;
    pinned_buffer& operator=(const pinned_buffer&) = delete;
    pinned_buffer(pinned_buffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
    pinned_buffer& operator=(pinned_buffer&& o) noexcept {
        std::swap(data_, o.data_);
        std::swap(size_, o.size_);
        return *this;
    }
    ~pinned_buffer() {
        if (data_) (void)cudaFreeHost(data_);
    }
    [[nodiscard]] T* data() const noexcept { return data_; }
    [[nodiscard]] std::size_t size() const noexcept { return size_; }

private:
    T* data_ = nullptr;
    std::size_t size_ = 0;
};

/// cuBLAS and cuSOLVER handles of the calling thread, created at first use and bound to the
/// backend's stream. A handle must not be used by two threads at once; one per thread avoids
/// locking.
class library_handles {
public:
    library_handles(const library_handles&) = delete;
    library_handles& operator=(const library_handles&) = delete;
    ~library_handles() {
        if (blas_) (void)cublasDestroy(blas_);
        if (solver_) (void)cusolverDnDestroy(solver_);
    }

    static library_handles& of_this_thread() {
        thread_local library_handles h;
        return h;
    }
    cublasHandle_t blas() {
        if (!blas_) {
            check(cublasCreate(&blas_), "cublasCreate");
            check(cublasSetStream(blas_, stream()), "cublasSetStream");
        }
        return blas_;
    }
    cusolverDnHandle_t solver() {
        if (!solver_) {
            check(cusolverDnCreate(&solver_), "cusolverDnCreate");
            check(cusolverDnSetStream(solver_, stream()), "cusolverDnSetStream");
        }
        return solver_;
    }

private:
    library_handles() = default;
    cublasHandle_t blas_ = nullptr;
    cusolverDnHandle_t solver_ = nullptr;
};

/// Number of CUDA devices, 0 when there is none or no driver (never throws).
inline int device_count() noexcept {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

}  // namespace kfac::backend::cuda_detail
