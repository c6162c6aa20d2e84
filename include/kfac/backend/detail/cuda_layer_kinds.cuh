// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cuda_layer_kinds.cuh
/// The CUDA backend's optional members (kfac::backend::cuda derives from it): the unit-wise
/// blocks of LayerNorm/BatchNorm (kfac/backend/unit_wise_factors.hpp), an Embedding's diagonal
/// factor and [in, out] weight (kfac/backend/diagonal_factors.hpp), the Rayleigh quotients of
/// eigenbasis reuse (kfac/backend/eigenbasis_reuse.hpp), and a grouped convolution's channels
/// gathered on the device. Each mirrors its CPU twin (cpu_unit_wise.hpp, cpu_eigen.hpp,
/// group_views.hpp) operation for operation.

#include <cmath>
#include <cstdint>

#include "kfac/backend/detail/cuda_library_calls.cuh"
#include "kfac/backend/detail/cuda_statistics.cuh"
#include "kfac/backend/detail/cuda_storage.cuh"
#include "kfac/backend/detail/device_kernels.cuh"
#include "kfac/backend/detail/device_layer_kernels.cuh"
#include "kfac/detail/statistics_views.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"

namespace kfac::backend::cuda_detail {

template <class Scalar>
struct cuda_layer_kinds {
    using index = std::int64_t;
    using matrix = device_matrix<Scalar>;
    using vector = matrix;
    using workspace = device_workspace<Scalar>;
    using base = device_calls<Scalar>;  ///< the checked helpers

    // --- unit-wise blocks: C rows, columns F_γγ, F_γβ, F_ββ (F_γγ alone without shift) ----

    static void accumulate_unit_wise_statistic(matrix& sum, const layer_description& d, tensor_view<const Scalar> x,
                                               tensor_view<const Scalar> dy, Scalar beta, workspace& ws) {
        const auto layout = kfac::detail::norm_layout_of(d, x);
        const Scalar* xd = base::on_device(x, ws.input);
        const Scalar* dyd = base::on_device(dy, ws.patches);
        const Scalar alpha = Scalar(1) / static_cast<Scalar>(layout.rows());
        base::launch("unit_wise_statistic", [&] {
            kernels::unit_wise_statistic(base::policy(), xd, dyd, layout.examples, layout.positions, layout.channels,
                                         layout.channels_last, layout.sum_positions, d.bias, alpha, beta, sum.data());
        });
    }

    static matrix unit_wise_identity(index channels, index k) {
        matrix m(channels, k * (k + 1) / 2);
        base::launch("unit_wise_identity",
                     [&] { kernels::unit_wise_identity(base::policy(), m.data(), channels, m.cols()); });
        return m;
    }

    static bool unit_wise_damped_inverse(const matrix& blocks, Scalar damping, matrix& out) {
        out.resize(blocks.rows(), blocks.cols());
        base::launch("unit_wise_damped_inverse", [&] {
            kernels::unit_wise_damped_inverse(base::policy(), blocks.data(), blocks.rows(), blocks.cols(), damping,
                                              out.data());
        });
        return base::all_finite(out);
    }

    static void unit_wise_multiply(const matrix& blocks, const matrix& gamma_t, matrix& p_t) {
        p_t.resize(gamma_t.rows(), gamma_t.cols());
        base::launch("unit_wise_multiply", [&] {
            kernels::unit_wise_multiply(base::policy(), blocks.data(), blocks.rows(), blocks.cols(), gamma_t.data(),
                                        p_t.data());
        });
    }

    static void scale_blocks(matrix& blocks, Scalar s) {
        base::launch("scale", [&] { kernels::scale(base::policy(), blocks.data(), blocks.size(), s); });
    }
    static void average_blocks(matrix& f, const matrix& sum, Scalar decay, Scalar weight) {
        base::launch("axpby", [&] { kernels::axpby(base::policy(), f.data(), sum.data(), f.size(), decay, weight); });
    }

    // --- diagonal factors and [in, out] weights -------------------------------------------

    static void diagonal_values(const matrix& column, vector& values) { values = column; }

    static bool damped_reciprocal(const matrix& column, Scalar damping, matrix& out) {
        out.resize(column.rows(), 1);
        base::launch("damped_reciprocal", [&] {
            kernels::damped_reciprocal(base::policy(), column.data(), column.rows(), damping, out.data());
        });
        return base::all_finite(out);
    }

    static void scale_rows(matrix& m, const matrix& column) {
        base::launch("scale_rows",
                     [&] { kernels::scale_rows(base::policy(), m.data(), m.rows(), m.cols(), column.data()); });
    }

    /// gamma ← Γᵀ: the [in, out] weight gradient (host or device) as an in × out matrix.
    static void load_gradient_transposed(matrix& gamma, tensor_view<const Scalar> w) {
        const index rows = w.extent(0), cols = w.extent(1);
        thread_local device_buffer<Scalar> staged;
        const Scalar* src = base::on_device(w, staged);
        gamma.resize(rows, cols);
        base::launch("c_order_to_column_major",
                     [&] { kernels::c_order_to_column_major(base::policy(), src, rows, cols, gamma.data()); });
    }

    /// w ← scale·P_t in the [in, out] layout; returns once a host view holds the result.
    static void store_gradient_transposed(const matrix& pt, Scalar scale, tensor_view<Scalar> w) {
        const index rows = w.extent(0), cols = w.extent(1);
        thread_local device_buffer<Scalar> staged;
        Scalar* dst = w.data;
        if (w.space == memory_space::host) {
            staged.reserve(static_cast<std::size_t>(w.size()));
            dst = staged.data();
        }
        base::launch("column_major_to_c_order",
                     [&] { kernels::column_major_to_c_order(base::policy(), pt.data(), rows, cols, scale, dst); });
        if (w.space == memory_space::host) {
            note_blocking_download();
            check(cudaMemcpy(w.data, dst, base::bytes(w.size()), cudaMemcpyDeviceToHost), "cudaMemcpy(weight gradient)");
        }
    }

    // --- eigenbasis reuse -----------------------------------------------------------------

    /// λ_i = q_iᵀ F q_i and ‖F Q − Q diag(λ)‖_F / ‖F‖_F: F Q by one GEMM, then one thread per
    /// column in double and two sums (one synchronisation).
    static double rayleigh_quotients(const matrix& f, const matrix& q, vector& lambda) {
        const index n = q.cols();
        matrix fq(n, n);
        gemm<Scalar>(CUBLAS_OP_N, CUBLAS_OP_N, base::narrow(n), base::narrow(n), base::narrow(n), Scalar(1), f.data(),
                     base::narrow(n), q.data(), base::narrow(n), Scalar(0), fq.data(), base::narrow(n));
        lambda.resize(n, 1);
        thread_local device_buffer<double> partial;
        partial.reserve(static_cast<std::size_t>(2 * n));
        double residual = 0.0, norm = 0.0;
        base::launch("rayleigh_columns", [&] {
            kernels::rayleigh_columns(base::policy(), f.data(), q.data(), fq.data(), n, lambda.data(), partial.data(),
                                      partial.data() + n);
            note_blocking_download();
            residual = kernels::sum(base::sync_policy(), partial.data(), n);
            norm = kernels::sum(base::sync_policy(), partial.data() + n, n);
        });
        return std::sqrt(residual) / std::sqrt(norm);  // NaN for F = 0 or non-finite input
    }

    // --- grouped convolutions ---------------------------------------------------------------

    using channel_buffer = device_buffer<Scalar>;

    /// Channels [group·C/groups, (group + 1)·C/groups) of a [N, C, spatial...] view (host or
    /// device), copied by one strided copy into `buffer`, as the device view
    /// [N, C/groups, spatial...] over it (kfac/detail/group_views.hpp on the host).
    static tensor_view<const Scalar> gather_group_channels(const tensor_view<const Scalar>& v, index group, index groups,
                                                           channel_buffer& buffer) {
        if (groups == 1 || v.empty()) return v;
        const index n = v.extent(0), channels = v.extent(1);
        const index per_group = channels / groups;
        const index inner = n * channels == 0 ? 0 : v.size() / (n * channels);
        const index block = per_group * inner;
        buffer.reserve(static_cast<std::size_t>(n * block));
        if (v.space == memory_space::host) note_upload();
        if (n * block > 0)
            check(cudaMemcpy2DAsync(buffer.data(), base::bytes(block), v.data + group * block, base::bytes(channels * inner),
                                    base::bytes(block), static_cast<std::size_t>(n), cudaMemcpyDefault, stream()),
                  "cudaMemcpy2DAsync(group channels)");
        tensor_view<const Scalar> out = v;
        out.data = buffer.data();
        out.extents[1] = per_group;
        out.space = memory_space::device;
        return out;
    }
};

}  // namespace kfac::backend::cuda_detail
