// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file device_layer_kernels.cuh
/// The CUDA backend's kernels for the layer kinds beyond Linear and convolution with
/// `expand`: an Embedding's token counts and diagonal factor, weight sharing `reduce`'s one row
/// per example, the unit-wise blocks of LayerNorm/BatchNorm, [in, out] weight transposes and
/// the Rayleigh quotients of eigenbasis reuse. Like device_kernels.cuh, each is a Thrust
/// algorithm over an index range taking an execution policy, so the CPU tests run them through
/// Thrust's CPP system against the CPU backend.
///
/// Column-major storage (element (i, j) at i + j·ld); host views are C-order. Every reduction
/// a kernel performs runs in one thread in a fixed order, so a result does not depend on the
/// launch configuration.

#include <cstdint>

#include <cuda/atomic>
#include <thrust/reduce.h>

#include "kfac/backend/detail/device_kernels.cuh"

namespace kfac::backend::kernels {

// --- Embedding: token frequencies (a diagonal A factor) ------------------------------------

/// counts[v] += occurrences of token v among the `count` ids (integers held as T); an id that
/// is not an integer in [0, tokens) adds to counts[tokens] instead. counts holds tokens + 1
/// zeroed entries. Integer atomics: the counts do not depend on the order of the additions.
template <class Policy, class T>
void count_tokens(Policy&& policy, const T* ids, index count, index tokens, std::int64_t* counts) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index i) {
        const T id = ids[i];
        const bool valid = id >= T(0) && id < static_cast<T>(tokens) && id == static_cast<T>(static_cast<index>(id));
        cuda::atomic_ref<std::int64_t, cuda::thread_scope_device> slot(counts[valid ? static_cast<index>(id) : tokens]);
        slot.fetch_add(1, cuda::memory_order_relaxed);
    });
}

/// sum(v) = beta·sum(v) + alpha·counts[v]: the CPU backend's two roundings, and no read of
/// sum when beta = 0.
template <class Policy, class T>
void token_frequencies(Policy&& policy, T* sum, const std::int64_t* counts, index tokens, T alpha, T beta) {
    for_each_index(policy, tokens, [=] KFAC_HOST_DEVICE(index v) {
        const T frequency = alpha * static_cast<T>(counts[v]);
        sum[v] = beta == T(0) ? frequency : beta * sum[v] + frequency;
    });
}

// --- Weight sharing `reduce`: one row per example ------------------------------------------

/// out(k, e) = (1/P) Σ_p x[e·P + p][k] for a C-order [examples·P, cols] input: the mean over
/// positions of example e's inputs, as column e of a column-major cols × examples matrix with
/// leading dimension ld (ld > cols leaves room for a bias's ones row).
template <class Policy, class T>
void mean_rows_per_example(Policy&& policy, const T* x, index examples, index positions, index cols, T* out, index ld) {
    for_each_index(policy, examples * cols, [=] KFAC_HOST_DEVICE(index t) {
        const index k = t % cols, e = t / cols;
        T s = T(0);
        for (index p = 0; p < positions; ++p) s += x[(e * positions + p) * cols + k];
        out[k + e * ld] = s / static_cast<T>(positions);
    });
}

/// out(k, e) = the mean over grid positions of element k of sample e's patches (zero padding
/// included), as above; `elements` = C·k_h·k_w.
template <class Policy, class T>
void mean_patch_per_example(Policy&& policy, const T* input, index examples, index channels, index height, index width,
                            const conv2d_geometry& g, const patch_grid& grid, T* out, index ld) {
    const index elements = channels * g.kernel[0] * g.kernel[1];
    const auto read = make_patch_reader(input, channels, height, width, g, grid);
    const index rows = grid.rows, cols = grid.cols;
    for_each_index(policy, examples * elements, [=] KFAC_HOST_DEVICE(index t) {
        const index k = t % elements, e = t / elements;
        T s = T(0);
        for (index i = 0; i < rows; ++i)
            for (index j = 0; j < cols; ++j) s += read(e, i, j, k);
        out[k + e * ld] = s / static_cast<T>(rows * cols);
    });
}

/// out(o, e) = Σ_p y[e·P + p][o] for a C-order [examples·P, channels] gradient (Linear).
template <class Policy, class T>
void sum_rows_per_example(Policy&& policy, const T* y, index examples, index positions, index channels, T* out) {
    for_each_index(policy, examples * channels, [=] KFAC_HOST_DEVICE(index t) {
        const index o = t % channels, e = t / channels;
        T s = T(0);
        for (index p = 0; p < positions; ++p) s += y[(e * positions + p) * channels + o];
        out[o + e * channels] = s;
    });
}

/// out(o, e) = Σ_s y[e][o][s] for a C-order [examples, channels, S] gradient (convolutions).
template <class Policy, class T>
void sum_positions_per_example(Policy&& policy, const T* y, index examples, index channels, index spatial, T* out) {
    for_each_index(policy, examples * channels, [=] KFAC_HOST_DEVICE(index t) {
        const T* row = y + t * spatial;  // t = e·channels + o: the C-order block of (e, o)
        T s = T(0);
        for (index p = 0; p < spatial; ++p) s += row[p];
        out[t] = s;
    });
}

// --- Unit-wise blocks (LayerNorm, BatchNorm) -----------------------------------------------

/// sum(c, ·) = beta·sum(c, ·) + alpha·Σ_rows (t_γ², t_γ t_β, t_β²) of channel c (columns 0, 1,
/// 2 of the column-major C × (shift ? 3 : 1) matrix). With `sum_positions` a row is an example
/// and t = (Σ_p x̂ ⊙ dy, Σ_p dy); otherwise a row is one (example, position) and
/// t = (x̂ dy, dy). Element (e, p, c) of x̂ and dy is at (e·P + p)·C + c with `channels_last`,
/// else (e·C + c)·P + p. One thread per channel.
template <class Policy, class T>
void unit_wise_statistic(Policy&& policy, const T* x, const T* dy, index examples, index positions, index channels,
                         bool channels_last, bool sum_positions, bool shift, T alpha, T beta, T* sum) {
    for_each_index(policy, channels, [=] KFAC_HOST_DEVICE(index c) {
        T gg = T(0), gb = T(0), bb = T(0);
        for (index e = 0; e < examples; ++e) {  // per example first, as the CPU backend sums
            T s_gg = T(0), s_gb = T(0), s_bb = T(0);  // t_γ, t_β with sum_positions
            for (index p = 0; p < positions; ++p) {
                const index at = channels_last ? (e * positions + p) * channels + c : (e * channels + c) * positions + p;
                const T u = x[at] * dy[at];
                if (sum_positions) {
                    s_gg += u;
                    s_bb += dy[at];
                } else {
                    s_gg += u * u;
                    s_gb += u * dy[at];
                    s_bb += dy[at] * dy[at];
                }
            }
            if (sum_positions) {
                gg += s_gg * s_gg;
                gb += s_gg * s_bb;
                bb += s_bb * s_bb;
            } else {
                gg += s_gg;
                gb += s_gb;
                bb += s_bb;
            }
        }
        auto add = [&](index column, T s) {  // beta = 0 reads nothing of sum
            T& out = sum[c + column * channels];
            out = beta == T(0) ? alpha * s : beta * out + alpha * s;
        };
        add(0, gg);
        if (shift) {
            add(1, gb);
            add(2, bb);
        }
    });
}

/// Every block the identity: columns (1, 0, 1) of a C × 3 matrix, or (1) of a C × 1 one.
template <class Policy, class T>
void unit_wise_identity(Policy&& policy, T* blocks, index channels, index columns) {
    for_each_index(policy, channels * columns, [=] KFAC_HOST_DEVICE(index t) { blocks[t] = t / channels == 1 ? T(0) : T(1); });
}

/// out = (F_c + γI)⁻¹ per channel, in the closed form of the CPU backend (cpu_unit_wise.hpp):
/// det = max(F_γγF_ββ − F_γβ², 0) + γ(F_γγ + F_ββ) + γ².
template <class Policy, class T>
void unit_wise_damped_inverse(Policy&& policy, const T* blocks, index channels, index columns, T damping, T* out) {
    for_each_index(policy, channels, [=] KFAC_HOST_DEVICE(index c) {
        if (columns == 1) {
            out[c] = T(1) / (blocks[c] + damping);
            return;
        }
        const T f_gg = blocks[c], f_gb = blocks[c + channels], f_bb = blocks[c + 2 * channels];
        const T det_f = f_gg * f_bb - f_gb * f_gb;
        const T det = (det_f > T(0) ? det_f : T(0)) + damping * (f_gg + f_bb) + damping * damping;
        out[c] = (f_bb + damping) / det;
        out[c + channels] = -f_gb / det;
        out[c + 2 * channels] = (f_gg + damping) / det;
    });
}

/// P_t(:, c) = B_c Γᵀ(:, c) for the k × C gradient Γᵀ (k = columns == 3 ? 2 : 1; row 0 the
/// scale, row 1 the shift).
template <class Policy, class T>
void unit_wise_multiply(Policy&& policy, const T* blocks, index channels, index columns, const T* gamma_t, T* p_t) {
    for_each_index(policy, channels, [=] KFAC_HOST_DEVICE(index c) {
        if (columns == 1) {
            p_t[c] = blocks[c] * gamma_t[c];
            return;
        }
        const T b_gg = blocks[c], b_gb = blocks[c + channels], b_bb = blocks[c + 2 * channels];
        const T g_scale = gamma_t[2 * c], g_shift = gamma_t[2 * c + 1];
        p_t[2 * c] = b_gg * g_scale + b_gb * g_shift;
        p_t[2 * c + 1] = b_gb * g_scale + b_bb * g_shift;
    });
}

/// F ← decay·F + weight·S, element by element (blocks and diagonal factors, which are no
/// triangle of a symmetric matrix).
template <class Policy, class T>
void axpby(Policy&& policy, T* f, const T* s, index count, T decay, T weight) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { f[t] = decay * f[t] + weight * s[t]; });
}

// --- Diagonal factors and [in, out] weights ------------------------------------------------

/// out_i = 1 / (column_i + damping).
template <class Policy, class T>
void damped_reciprocal(Policy&& policy, const T* column, index n, T damping, T* out) {
    for_each_index(policy, n, [=] KFAC_HOST_DEVICE(index i) { out[i] = T(1) / (column[i] + damping); });
}

/// M(i, j) *= column_i for a column-major rows × cols M.
template <class Policy, class T>
void scale_rows(Policy&& policy, T* m, index rows, index cols, const T* column) {
    for_each_index(policy, rows * cols, [=] KFAC_HOST_DEVICE(index t) { m[t] = m[t] * column[t % rows]; });
}

/// dst = scale·src as a column-major rows × cols matrix, src the C-order rows × cols array;
/// and its inverse. A C-order array is its column-major transpose, so each is a transpose.
template <class Policy, class T>
void c_order_to_column_major(Policy&& policy, const T* src, index rows, index cols, T* dst) {
    for_each_index(policy, rows * cols, [=] KFAC_HOST_DEVICE(index t) {
        const index i = t % rows, j = t / rows;
        dst[t] = src[i * cols + j];
    });
}
template <class Policy, class T>
void column_major_to_c_order(Policy&& policy, const T* src, index rows, index cols, T scale, T* dst) {
    for_each_index(policy, rows * cols, [=] KFAC_HOST_DEVICE(index t) {
        const index i = t / cols, j = t % cols;
        dst[t] = scale * src[i + j * rows];
    });
}

// --- Eigenbasis reuse ----------------------------------------------------------------------

/// Per column j of the n × n matrices: λ_j = Σ_i Q(i, j)·FQ(i, j), residual_j = Σ_i (FQ(i, j) −
/// λ_j Q(i, j))², norm_j = Σ_i F(i, j)², all in double in the CPU backend's order.
template <class Policy, class T>
void rayleigh_columns(Policy&& policy, const T* f, const T* q, const T* fq, index n, T* lambda, double* residual,
                      double* norm) {
    for_each_index(policy, n, [=] KFAC_HOST_DEVICE(index j) {
        double quotient = 0.0;
        for (index i = 0; i < n; ++i) quotient += static_cast<double>(q[i + j * n]) * static_cast<double>(fq[i + j * n]);
        lambda[j] = static_cast<T>(quotient);
        double r2 = 0.0, f2 = 0.0;
        for (index i = 0; i < n; ++i) {
            const double r = static_cast<double>(fq[i + j * n]) - quotient * static_cast<double>(q[i + j * n]);
            const double x = static_cast<double>(f[i + j * n]);
            r2 += r * r;
            f2 += x * x;
        }
        residual[j] = r2;
        norm[j] = f2;
    });
}

// --- Gradient checks: every layer's at once ------------------------------------------------

/// `count` elements from `first` of pair `pair` of the gradient checks.
struct check_chunk {
    index pair, first, count;
};

/// Per chunk c, in element order: dot[c] = Σ x·y in double, bad[c] = the non-finite entries of
/// x and y (xs[p], ys[p]: the pair's two arrays).
template <class Policy, class T>
void chunk_checks(Policy&& policy, const T* const* xs, const T* const* ys, const check_chunk* chunks, index n_chunks,
                  double* dot, std::int64_t* bad) {
    for_each_index(policy, n_chunks, [=] KFAC_HOST_DEVICE(index c) {
        const check_chunk k = chunks[c];
        const T* x = xs[k.pair] + k.first;
        const T* y = ys[k.pair] + k.first;
        double s = 0.0;
        std::int64_t n = 0;
        for (index i = 0; i < k.count; ++i) {
            n += non_finite(x[i]) + non_finite(y[i]);
            s += static_cast<double>(x[i]) * static_cast<double>(y[i]);
        }
        dot[c] = s;
        bad[c] = n;
    });
}

/// Per pair p, its chunks [begin[p], begin[p + 1]) summed in order: dots[p], bad[p].
template <class Policy>
void pair_totals(Policy&& policy, const index* begin, index pairs, const double* chunk_dot, const std::int64_t* chunk_bad,
                 double* dots, std::int64_t* bad) {
    for_each_index(policy, pairs, [=] KFAC_HOST_DEVICE(index p) {
        double s = 0.0;
        std::int64_t n = 0;
        for (index c = begin[p]; c < begin[p + 1]; ++c) {
            s += chunk_dot[c];
            n += chunk_bad[c];
        }
        dots[p] = s;
        bad[p] = n;
    });
}

// --- Many small decompositions at once ------------------------------------------------------

/// dst[b·n + i] = src[b][i]: `count` arrays of n elements side by side (a batched solver's input).
template <class Policy, class T>
void gather_arrays(Policy&& policy, const T* const* src, index n, index count, T* dst) {
    for_each_index(policy, n * count, [=] KFAC_HOST_DEVICE(index t) { dst[t] = src[t / n][t % n]; });
}

/// dst[b][i] = src[b·n + i]: the inverse of gather_arrays.
template <class Policy, class T>
void scatter_arrays(Policy&& policy, const T* src, index n, index count, T* const* dst) {
    for_each_index(policy, n * count, [=] KFAC_HOST_DEVICE(index t) { dst[t / n][t % n] = src[t]; });
}

/// status[b] = −1 when the solver reported info[b] ≠ 0 for matrix b, else the non-finite entries
/// among its n × n eigenvectors (q + b·n²) and n eigenvalues (w + b·n): 0 is a usable result.
template <class Policy, class T>
void batch_status(Policy&& policy, const int* info, const T* q, const T* w, index n, index count, std::int64_t* status) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index b) {
        if (info[b] != 0) {
            status[b] = -1;
            return;
        }
        std::int64_t bad = 0;
        for (index i = 0; i < n * n; ++i) bad += non_finite(q[b * n * n + i]);
        for (index i = 0; i < n; ++i) bad += non_finite(w[b * n + i]);
        status[b] = bad;
    });
}

/// Σ of `count` doubles (synchronises).
template <class Policy>
double sum(Policy&& policy, const double* v, index count) {
    if (count <= 0) return 0.0;
    return thrust::reduce(policy, v, v + count, 0.0, thrust::plus<double>());
}

}  // namespace kfac::backend::kernels
