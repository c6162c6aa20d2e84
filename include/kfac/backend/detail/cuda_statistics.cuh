// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cuda_statistics.cuh
/// The CUDA backend's factor statistics (kfac::backend::cuda derives from it): the A and G
/// statistics of Linear layers and convolutions (golden/README.md §4), an Embedding's token
/// frequencies, and the one row per example of weight sharing `reduce`, each one GEMM over an
/// operand the kernels of device_kernels.cuh / device_layer_kernels.cuh lay out; and the
/// running average that folds a statistic into its factor.

#include <algorithm>
#include <cstdint>
#include <string>

#include "kfac/backend/detail/cuda_library_calls.cuh"
#include "kfac/backend/detail/cuda_storage.cuh"
#include "kfac/backend/detail/device_kernels.cuh"
#include "kfac/backend/detail/device_layer_kernels.cuh"
#include "kfac/detail/statistics_views.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/layers/layer_description.hpp"
#include "kfac/layers/tensor_view.hpp"
#include "kfac/options.hpp"

/// Most elements of one chunk of conv patches (positions × A_dim) on the device: 2²⁶ is
/// 256 MiB in float. Larger inputs are processed in chunks, each one GEMM.
#ifndef KFAC_CUDA_PATCH_CHUNK_ELEMENTS
#define KFAC_CUDA_PATCH_CHUNK_ELEMENTS (std::int64_t{1} << 26)
#endif

namespace kfac::backend::cuda_detail {

/// Device scratch kept per layer: uploaded host views, patches, permuted gradients, the rows
/// of `reduce`, token counts, a group's channels.
template <class Scalar>
struct device_workspace {
    device_buffer<Scalar> input, patches, reduced;
    device_buffer<std::int64_t> counts;
};

template <class Scalar>
struct cuda_statistics {
    using index = std::int64_t;
    using matrix = device_matrix<Scalar>;
    using workspace = device_workspace<Scalar>;
    using base = device_calls<Scalar>;  ///< the checked helpers

    /// sum = beta·sum + X̃ᵀX̃ / (N·S³) (lower triangle; S = 1 for Linear), golden §4.1–4.2.
    /// The bias's ones column is part of the GEMM operand, so one call gives the whole
    /// factor including the bias row and corner.
    static void accumulate_a_statistic(matrix& sum, const layer_description& d, tensor_view<const Scalar> a,
                                       conv_patch_mode mode, Scalar beta, workspace& ws) {
        if (d.kind == layer_kind::embedding) {
            add_token_frequencies(sum, a, d.in, beta, ws);
            return;
        }
        if (d.sharing == weight_sharing::reduce) {
            reduce_inputs(d, a, mode, ws);
            add_example_gram(sum, ws, d.a_dim(), kfac::detail::examples_in(d, a), beta);
            return;
        }
        const index cols = d.weight_columns(), n_a = d.a_dim();
        if (d.kind == layer_kind::linear) {
            const index rows = a.size() / cols;
            const Scalar alpha = Scalar(1) / static_cast<Scalar>(rows);
            const Scalar* x = nullptr;
            if (!d.bias) {
                x = base::on_device(a, ws.input);
            } else {  // [X | 1] as an (in + 1) × rows column-major operand
                ws.input.reserve(static_cast<std::size_t>(n_a * rows));
                if (a.space == memory_space::host) note_upload();
                check(cudaMemcpy2DAsync(ws.input.data(), base::bytes(n_a), a.data, base::bytes(cols),
                                        base::bytes(cols), static_cast<std::size_t>(rows), cudaMemcpyDefault, stream()),
                      "cudaMemcpy2DAsync(activations)");
                base::launch("fill_row",
                             [&] { kernels::fill_row(base::policy(), ws.input.data(), n_a, cols, rows, Scalar(1)); });
                x = ws.input.data();
            }
            gram<Scalar>(CUBLAS_OP_N, base::narrow(n_a), base::narrow(rows), alpha, x, base::narrow(n_a), beta,
                         sum.data(), base::narrow(sum.rows()));
            return;
        }
        const index n = a.extent(0), channels = a.extent(1), height = a.extent(2), width = a.extent(3);
        const Scalar* input = base::on_device(a, ws.input);
        const patch_grid grid = make_patch_grid(d.conv, height, width, mode);
        const Scalar s = static_cast<Scalar>(grid.positions());
        const Scalar alpha = Scalar(1) / (static_cast<Scalar>(n) * s * s * s);  // golden §4.2
        const index total_rows = n * grid.rows;
        const index chunk_rows =
            std::max<index>(1, std::min<index>(total_rows, KFAC_CUDA_PATCH_CHUNK_ELEMENTS / std::max<index>(1, grid.cols * n_a)));
        const index ld = chunk_rows * grid.cols;
        ws.patches.reserve(static_cast<std::size_t>(ld * n_a));
        for (index first = 0; first < total_rows; first += chunk_rows) {
            const index count = std::min(chunk_rows, total_rows - first);
            base::launch("extract_patches", [&] {
                kernels::extract_patches(base::policy(), input, channels, height, width, d.conv, grid, first, count,
                                         d.bias, ws.patches.data(), ld);
            });
            gram<Scalar>(CUBLAS_OP_T, base::narrow(n_a), base::narrow(count * grid.cols), alpha, ws.patches.data(),
                         base::narrow(ld), first == 0 ? beta : Scalar(1), sum.data(), base::narrow(sum.rows()));
        }
    }

    /// sum = beta·sum + YᵀY / (N·S³) (golden §4.1, §4.2 step 5); under `reduce`, of the
    /// per-example sums ĝ_n.
    static void accumulate_g_statistic(matrix& sum, const layer_description& d, tensor_view<const Scalar> g,
                                       Scalar beta, workspace& ws) {
        const index out = d.out;
        if (d.sharing == weight_sharing::reduce) {
            reduce_gradients(d, g, ws);
            add_example_gram(sum, ws, out, kfac::detail::examples_in(d, g), beta);
            return;
        }
        if (d.kind == layer_kind::linear || d.kind == layer_kind::embedding) {
            const index rows = g.size() / out;
            gram<Scalar>(CUBLAS_OP_N, base::narrow(out), base::narrow(rows), Scalar(1) / static_cast<Scalar>(rows),
                         base::on_device(g, ws.input), base::narrow(out), beta, sum.data(), base::narrow(sum.rows()));
            return;
        }
        const index n = g.extent(0), spatial = g.extent(2) * g.extent(3);
        const Scalar s = static_cast<Scalar>(spatial);
        const Scalar alpha = Scalar(1) / (static_cast<Scalar>(n) * s * s * s);
        const Scalar* y = base::on_device(g, ws.input);
        ws.patches.reserve(static_cast<std::size_t>(n * spatial * out));
        base::launch("channels_last",
                     [&] { kernels::channels_last(base::policy(), y, n, out, spatial, ws.patches.data()); });
        gram<Scalar>(CUBLAS_OP_T, base::narrow(out), base::narrow(n * spatial), alpha, ws.patches.data(),
                     base::narrow(n * spatial), beta, sum.data(), base::narrow(sum.rows()));
    }

    /// F ← decay·F + weight·sym(sum), reading sum's lower triangle only; a diagonal factor's
    /// n × 1 column entry by entry.
    static void running_average(matrix& f, matrix& sum, Scalar decay, Scalar weight) {
        if (f.cols() == 1) {
            base::launch("axpby",
                         [&] { kernels::axpby(base::policy(), f.data(), sum.data(), f.size(), decay, weight); });
            return;
        }
        base::launch("running_average",
                     [&] { kernels::running_average(base::policy(), f.data(), sum.data(), f.rows(), decay, weight); });
    }

    /// M ← s·M after mirroring its lower triangle into the upper one (a one-column matrix has
    /// nothing to mirror).
    static void scale_symmetric(matrix& m, Scalar s) {
        if (m.cols() > 1) base::launch("mirror_lower", [&] { kernels::mirror_lower(base::policy(), m.data(), m.rows()); });
        base::launch("scale", [&] { kernels::scale(base::policy(), m.data(), m.size(), s); });
    }

private:
    /// The diagonal A statistic of an Embedding (n × 1): sum = beta·sum + c / R, c(v) the
    /// occurrences of token v among the R ids, counted in integers. Ids in host memory were
    /// checked by the preconditioner; ids in device memory are checked here, by the count of
    /// invalid ones the counting kernel leaves in the extra slot (one synchronisation).
    static void add_token_frequencies(matrix& sum, tensor_view<const Scalar> ids, index tokens, Scalar beta,
                                      workspace& ws) {
        const index rows = ids.size();
        const Scalar* id = base::on_device(ids, ws.input);
        ws.counts.reserve(static_cast<std::size_t>(tokens + 1));
        check(cudaMemsetAsync(ws.counts.data(), 0, static_cast<std::size_t>(tokens + 1) * sizeof(std::int64_t), stream()),
              "cudaMemsetAsync(token counts)");
        base::launch("count_tokens", [&] { kernels::count_tokens(base::policy(), id, rows, tokens, ws.counts.data()); });
        if (ids.space == memory_space::device) {
            std::int64_t invalid = 0;
            note_blocking_download();
            check(cudaMemcpy(&invalid, ws.counts.data() + tokens, sizeof(invalid), cudaMemcpyDeviceToHost),
                  "cudaMemcpy(invalid token ids)");
            if (invalid > 0)
                throw error(std::to_string(invalid) + " of the " + std::to_string(rows) + " token ids " +
                            ids.shape_string() + " are not integers in [0, " + std::to_string(tokens) +
                            "); pass the layer's input indices, converted to the scalar type");
        }
        const Scalar alpha = Scalar(1) / static_cast<Scalar>(rows);
        base::launch("token_frequencies", [&] {
            kernels::token_frequencies(base::policy(), sum.data(), ws.counts.data(), tokens, alpha, beta);
        });
    }

    /// ws.reduced ← ā_n as column n of an A_dim × examples column-major matrix: the mean over
    /// positions of example n's inputs (Linear) or patches (convolutions, zero padding
    /// included), then a bias's ones row.
    static void reduce_inputs(const layer_description& d, tensor_view<const Scalar> a, conv_patch_mode mode,
                              workspace& ws) {
        const index cols = d.weight_columns(), n_a = d.a_dim(), n = kfac::detail::examples_in(d, a);
        const Scalar* x = base::on_device(a, ws.input);
        ws.reduced.reserve(static_cast<std::size_t>(n_a * n));
        if (d.kind == layer_kind::linear) {
            const index positions = a.size() / cols / n;
            base::launch("mean_rows_per_example", [&] {
                kernels::mean_rows_per_example(base::policy(), x, n, positions, cols, ws.reduced.data(), n_a);
            });
        } else {
            const patch_grid grid = make_patch_grid(d.conv, a.extent(2), a.extent(3), mode);
            base::launch("mean_patch_per_example", [&] {
                kernels::mean_patch_per_example(base::policy(), x, n, a.extent(1), a.extent(2), a.extent(3), d.conv,
                                                grid, ws.reduced.data(), n_a);
            });
        }
        if (d.bias)
            base::launch("fill_row", [&] { kernels::fill_row(base::policy(), ws.reduced.data(), n_a, cols, n, Scalar(1)); });
    }

    /// ws.reduced ← ĝ_n, the sum over positions of example n's output gradients, as column n
    /// of an out × examples matrix.
    static void reduce_gradients(const layer_description& d, tensor_view<const Scalar> g, workspace& ws) {
        const index out = d.out, n = kfac::detail::examples_in(d, g);
        const Scalar* y = base::on_device(g, ws.input);
        ws.reduced.reserve(static_cast<std::size_t>(out * n));
        if (d.kind == layer_kind::linear) {
            const index positions = g.size() / out / n;
            base::launch("sum_rows_per_example", [&] {
                kernels::sum_rows_per_example(base::policy(), y, n, positions, out, ws.reduced.data());
            });
            return;
        }
        base::launch("sum_positions_per_example", [&] {
            kernels::sum_positions_per_example(base::policy(), y, n, out, g.size() / (n * out), ws.reduced.data());
        });
    }

    /// sum = beta·sum + (1/n)·R Rᵀ for the dim × n matrix R in ws.reduced (lower triangle used).
    static void add_example_gram(matrix& sum, const workspace& ws, index dim, index n, Scalar beta) {
        gram<Scalar>(CUBLAS_OP_N, base::narrow(dim), base::narrow(n), Scalar(1) / static_cast<Scalar>(n),
                     ws.reduced.data(), base::narrow(dim), beta, sum.data(), base::narrow(sum.rows()));
    }
};

}  // namespace kfac::backend::cuda_detail
