// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cuda_batched_eigen.cuh
/// The CUDA backend's prefetched decompositions (kfac/backend/batched_eigen.hpp;
/// kfac::backend::cuda derives from it): the dense factors of at most 32 rows that an inverse
/// update is about to decompose, grouped by size, each group decomposed by one call of
/// cuSOLVER's batched Jacobi solver (?syevjBatched) instead of one ?syevd and one host
/// synchronisation per factor — a depthwise convolution's channels, say. Per group: one upload
/// of its pointer tables, a gather kernel, the solver, a status kernel (solver info and
/// finiteness), scatter kernels into each factor's own Q and λ, and one download of the statuses.
/// A factor whose status is not 0 is not kept, so symmetric_eigen() decomposes it on its own.
/// `cuda<T>::batch_small_factors(false)` turns it off (the benchmark measures both ways).

#include <atomic>
#include <cstdint>
#include <map>
#include <vector>

#include "kfac/backend/detail/cuda_library_calls.cuh"
#include "kfac/backend/detail/cuda_storage.cuh"
#include "kfac/backend/detail/device_layer_kernels.cuh"
#include "kfac/backend/detail/prefetched_eigen.hpp"

namespace kfac::backend::cuda_detail {

/// Whether the CUDA backends of this process batch small decompositions (default: yes).
inline std::atomic<bool>& small_factor_batching() {
    static std::atomic<bool> on{true};
    return on;
}

template <class Scalar>
struct cuda_batched_eigen {
    using index = std::int64_t;
    using matrix = device_matrix<Scalar>;
    using vector = matrix;
    using calls = device_calls<Scalar>;
    using kept = backend::detail::prefetched_eigen<matrix, vector>;

    /// ?syevjBatched's limit.
    static constexpr index max_batched_rows = 32;

    static void prefetch_symmetric_eigen(const std::vector<const matrix*>& factors) {
        if (!small_factor_batching().load(std::memory_order_relaxed)) return;
        std::map<index, std::vector<const matrix*>> by_size;
        for (const auto* f : factors)
            if (f->rows() == f->cols() && f->rows() >= 1 && f->rows() <= max_batched_rows) by_size[f->rows()].push_back(f);
        for (const auto& [n, group] : by_size)
            if (group.size() >= 2) decompose_together(n, group);  // one factor alone: ?syevd as usual
    }

    static void clear_prefetched_eigen() noexcept { kept::of_this_thread().clear(); }

    /// symmetric_eigen()'s first question: was this factor decomposed ahead?
    static bool take_prefetched(const matrix& m, matrix& q, vector& lambda) {
        return kept::of_this_thread().take(m.data(), m.size(), q, lambda);
    }

private:
    static void decompose_together(index n, const std::vector<const matrix*>& group) {
        const auto count = static_cast<index>(group.size());
        std::vector<matrix> qs(group.size()), lambdas(group.size());
        // One upload of the pointers: [inputs | Q outputs | λ outputs] (the inputs only read).
        std::vector<void*> table(3 * group.size());
        for (std::size_t b = 0; b < group.size(); ++b) {
            qs[b].resize(n, n);
            lambdas[b].resize(n, 1);
            table[b] = const_cast<Scalar*>(group[b]->data());
            table[group.size() + b] = qs[b].data();
            table[2 * group.size() + b] = lambdas[b].data();
        }
        thread_local device_buffer<void*> device_table;
        thread_local device_buffer<Scalar> a, w, work;
        thread_local device_buffer<int> info;
        thread_local device_buffer<std::int64_t> status;
        a.reserve(static_cast<std::size_t>(count * n * n));
        w.reserve(static_cast<std::size_t>(count * n));
        info.reserve(static_cast<std::size_t>(count));
        status.reserve(static_cast<std::size_t>(count));
        void** d_table = calls::upload_table(table, device_table, "cudaMemcpyAsync(batched eigen tables)");
        const auto* d_inputs = reinterpret_cast<const Scalar* const*>(d_table);
        auto* const* d_q = reinterpret_cast<Scalar* const*>(d_table + count);
        auto* const* d_lambda = reinterpret_cast<Scalar* const*>(d_table + 2 * count);
        calls::launch("gather_arrays", [&] { kernels::gather_arrays(calls::policy(), d_inputs, n * n, count, a.data()); });
        const syevj_parameters parameters;
        const int lwork = syevj_batched_workspace<Scalar>(calls::narrow(n), a.data(), w.data(), parameters,
                                                          calls::narrow(count));
        work.reserve(static_cast<std::size_t>(lwork));
        syevj_batched<Scalar>(calls::narrow(n), a.data(), w.data(), work.data(), lwork, info.data(), parameters,
                              calls::narrow(count));
        calls::launch("batch_status", [&] {
            kernels::batch_status(calls::policy(), info.data(), a.data(), w.data(), n, count, status.data());
        });
        calls::launch("scatter_arrays", [&] { kernels::scatter_arrays(calls::policy(), a.data(), n * n, count, d_q); });
        calls::launch("scatter_arrays", [&] { kernels::scatter_arrays(calls::policy(), w.data(), n, count, d_lambda); });
        std::vector<std::int64_t> host(group.size());
        note_blocking_download();
        check(cudaMemcpy(host.data(), status.data(), host.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost),
              "cudaMemcpy(batched eigen status)");
        for (std::size_t b = 0; b < group.size(); ++b)
            if (host[b] == 0) kept::of_this_thread().put(group[b]->data(), group[b]->size(), std::move(qs[b]), std::move(lambdas[b]));
    }
};

}  // namespace kfac::backend::cuda_detail
