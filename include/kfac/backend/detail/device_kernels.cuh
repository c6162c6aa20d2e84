// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file device_kernels.cuh
/// The element-wise work of the CUDA backend as Thrust algorithms over index ranges. Each
/// kernel takes a Thrust execution policy: the backend passes a CUDA stream policy, and the
/// CPU tests pass `thrust::cpp::par` (compiled by g++ with THRUST_DEVICE_SYSTEM_CPP), so the
/// index arithmetic (patch extraction, layouts, the eigenvalue products) is tested against
/// the CPU backend on machines without a GPU.
///
/// Storage is column-major throughout, as in cuBLAS: element (i, j) of a matrix with leading
/// dimension ld is at i + j·ld. Host views are C-order (row-major).

#include <cmath>
#include <cstdint>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform_reduce.h>
#include <thrust/functional.h>

#include "kfac/detail/number_conversion.hpp"
#include "kfac/layers/im2col.hpp"
#include "kfac/precision.hpp"

#if defined(__CUDACC__)
#define KFAC_HOST_DEVICE __host__ __device__
#else
#define KFAC_HOST_DEVICE
#endif

namespace kfac::backend::kernels {

using index = std::int64_t;

/// 1 for NaN and ±Inf, 0 otherwise (x − x is NaN exactly then), on host and device alike.
template <class T>
KFAC_HOST_DEVICE index non_finite(T x) {
    return (x - x) == (x - x) ? 0 : 1;
}

template <class Policy, class F>
void for_each_index(Policy&& policy, index n, F f) {
    if (n <= 0) return;
    thrust::for_each_n(policy, thrust::counting_iterator<index>(0), n, f);
}

/// One element of one patch of a [N, C, H, W] input: element e = (c·k_h + u)·k_w + v of the
/// patch at grid position (i, j) of sample n, 0 where it falls in the padding.
template <class T>
struct patch_reader {
    const T* input;
    index channels, height, width;
    index kh, kw, sh, sw, ph, pw, dil_h, dil_w;

    KFAC_HOST_DEVICE T operator()(index n, index i, index j, index e) const {
        const index c = e / (kh * kw), u = (e / kw) % kh, v = e % kw;
        const index ih = i * sh + u * dil_h - ph, iw = j * sw + v * dil_w - pw;
        return ih >= 0 && ih < height && iw >= 0 && iw < width ? input[((n * channels + c) * height + ih) * width + iw]
                                                               : T(0);
    }
};

template <class T>
patch_reader<T> make_patch_reader(const T* input, index channels, index height, index width, const conv2d_geometry& g,
                                  const patch_grid& grid) {
    return {input,       channels,    height,       width,        g.kernel[0], g.kernel[1],
            g.stride[0], g.stride[1], g.padding[0], g.padding[1], grid.dil_h,  grid.dil_w};
}

/// Patches of a [N, C, H, W] input as a column-major positions × elements matrix M with
/// leading dimension ld: M(p, e) for patch position p (flattened over (sample, grid row,
/// grid column), starting at grid row `first_row`) and element e (patch_reader); with
/// `bias`, element `elements` is 1. Then Mᵀ M is the A statistic's X̃ᵀX̃ (one SYRK).
template <class T>
struct patch_matrix {
    patch_reader<T> read;
    T* out;
    index ld, grid_rows, grid_cols, first_row, positions, elements;

    KFAC_HOST_DEVICE void operator()(index t) const {
        const index e = t / positions, p = t % positions;
        T value = T(1);  // the bias's ones column
        if (e < elements) {
            const index flat = first_row + p / grid_cols, j = p % grid_cols;
            value = read(flat / grid_rows, flat % grid_rows, j, e);
        }
        out[p + e * ld] = value;
    }
};

/// Writes grid rows [first_row, first_row + row_count) of the patches (see patch_matrix);
/// `bias` appends the ones column. M holds row_count·Ŵ rows and ld ≥ that.
template <class Policy, class T>
void extract_patches(Policy&& policy, const T* input, index channels, index height, index width,
                     const conv2d_geometry& g, const patch_grid& grid, index first_row, index row_count, bool bias,
                     T* out, index ld) {
    const index elements = channels * g.kernel[0] * g.kernel[1];
    const index positions = row_count * grid.cols;
    patch_matrix<T> f{make_patch_reader(input, channels, height, width, g, grid), out, ld, grid.rows, grid.cols,
                      first_row, positions, elements};
    for_each_index(policy, positions * (elements + (bias ? 1 : 0)), f);
}

/// Row `row` of a column-major matrix with leading dimension ld, columns [0, cols), set to 1:
/// the ones a Linear layer's bias adds to its inputs.
template <class Policy, class T>
void fill_row(Policy&& policy, T* m, index ld, index row, index cols, T value) {
    for_each_index(policy, cols, [=] KFAC_HOST_DEVICE(index j) { m[row + j * ld] = value; });
}

/// A conv output gradient [N, C, S] as the column-major (N·S) × C matrix M(i·S + s, c), so
/// that Mᵀ M = Σ over samples and positions of y yᵀ (the G statistic, one SYRK).
template <class Policy, class T>
void channels_last(Policy&& policy, const T* y, index samples, index channels, index spatial, T* out) {
    const index rows = samples * spatial;
    for_each_index(policy, rows * channels, [=] KFAC_HOST_DEVICE(index t) {
        const index c = t / rows, r = t % rows;
        const index i = r / spatial, s = r % spatial;
        out[t] = y[(i * channels + c) * spatial + s];
    });
}

/// M's strict upper triangle ← its lower one (n × n, column-major).
template <class Policy, class T>
void mirror_lower(Policy&& policy, T* m, index n) {
    for_each_index(policy, n * n, [=] KFAC_HOST_DEVICE(index t) {
        const index i = t % n, j = t / n;
        if (i < j) m[t] = m[j + i * n];
    });
}

template <class Policy, class T>
void scale(Policy&& policy, T* m, index count, T s) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { m[t] = s * m[t]; });
}

/// dst ← s·src.
template <class Policy, class T>
void scaled_copy(Policy&& policy, const T* src, index count, T s, T* dst) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { dst[t] = s * src[t]; });
}

/// F ← decay·F + weight·sym(S), S defined by its lower triangle (n × n).
template <class Policy, class T>
void running_average(Policy&& policy, T* f, const T* s, index n, T decay, T weight) {
    for_each_index(policy, n * n, [=] KFAC_HOST_DEVICE(index t) {
        const index i = t % n, j = t / n;
        const T v = i >= j ? s[t] : s[j + i * n];
        f[t] = decay * f[t] + weight * v;
    });
}

/// M ← s·I (n × n).
template <class Policy, class T>
void scaled_identity(Policy&& policy, T* m, index n, T diagonal) {
    for_each_index(policy, n * n, [=] KFAC_HOST_DEVICE(index t) { m[t] = t % n == t / n ? diagonal : T(0); });
}

/// dst[t] ← src[t] in another floating-point type (widening is exact, narrowing rounds to
/// nearest): a float factor decomposed in double and back (options.fp64_decompositions).
template <class Policy, class S, class D>
void convert(Policy&& policy, const S* src, index count, D* dst) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { dst[t] = static_cast<D>(src[t]); });
}

/// out[t] ← the bf16 or fp16 element in[t] (its bits) as T: exact (a bf16/fp16 device view read
/// into the compute type, docs/precision.md).
template <class Policy, class T>
void widen_elements(Policy&& policy, const std::uint16_t* in, index count, precision format, T* out) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) {
        out[t] = static_cast<T>(kfac::detail::widen_16_bits(in[t], format));
    });
}

/// out[t] ← in[t] rounded once to nearest even in bf16 or fp16 (a preconditioned gradient
/// written back into its view's format; the host's rounding, kfac/detail/number_conversion.hpp).
template <class Policy, class T>
void narrow_elements(Policy&& policy, const T* in, index count, precision format, std::uint16_t* out) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { out[t] = kfac::detail::narrow_to_16_bits(in[t], format); });
}

/// How many of `count` values do not round to a finite value of `format` (a preconditioned
/// gradient checked before it is written into a narrower view; the host's rule,
/// kfac/detail/number_conversion.hpp).
template <class T>
struct beyond_format_counter {
    const T* in;
    precision format;
    KFAC_HOST_DEVICE index operator()(index t) const { return kfac::detail::rounds_to_finite(in[t], format) ? 0 : 1; }
};

template <class Policy, class T>
index count_beyond_format(Policy&& policy, const T* in, index count, precision format) {
    if (count <= 0) return 0;
    return thrust::transform_reduce(policy, thrust::counting_iterator<index>(0), thrust::counting_iterator<index>(count),
                                    beyond_format_counter<T>{in, format}, index{0}, thrust::plus<index>());
}

template <class Policy, class T>
void fill(Policy&& policy, T* m, index count, T value) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { m[t] = value; });
}

/// M(i, i) += d.
template <class Policy, class T>
void add_to_diagonal(Policy&& policy, T* m, index n, T d) {
    for_each_index(policy, n, [=] KFAC_HOST_DEVICE(index i) { m[i + i * n] += d; });
}

template <class Policy, class T>
void clamp_nonnegative(Policy&& policy, T* v, index n) {
    for_each_index(policy, n, [=] KFAC_HOST_DEVICE(index i) { v[i] = v[i] > T(0) ? v[i] : T(0); });
}

/// v_i += s.
template <class Policy, class T>
void add_constant(Policy&& policy, T* v, index n, T s) {
    for_each_index(policy, n, [=] KFAC_HOST_DEVICE(index i) { v[i] += s; });
}

/// D(i, j) = 1 / (a_i·g_j + damping): the same two roundings as the CPU backend.
template <class Policy, class T>
void inverse_eigen_product(Policy&& policy, const T* a, index m, const T* g, index n, T damping, T* d) {
    for_each_index(policy, m * n, [=] KFAC_HOST_DEVICE(index t) {
        const index i = t % m, j = t / m;
        d[t] = T(1) / (a[i] * g[j] + damping);
    });
}

/// V(i, j) /= a_i·g_j + damping.
template <class Policy, class T>
void divide_by_eigen_product(Policy&& policy, T* v, const T* a, index m, const T* g, index n, T damping) {
    for_each_index(policy, m * n, [=] KFAC_HOST_DEVICE(index t) {
        const index i = t % m, j = t / m;
        v[t] = v[t] / (a[i] * g[j] + damping);
    });
}

template <class Policy, class T>
void multiply_elementwise(Policy&& policy, T* v, const T* d, index count) {
    for_each_index(policy, count, [=] KFAC_HOST_DEVICE(index t) { v[t] = v[t] * d[t]; });
}

/// Number of non-finite values among the first `count` (or, with n > 0, in the lower
/// triangle of an n × n matrix).
template <class T>
struct non_finite_counter {
    const T* m;
    index n;  // 0: every element; else only i ≥ j of an n × n matrix
    KFAC_HOST_DEVICE index operator()(index t) const {
        if (n > 0 && t % n < t / n) return 0;
        return non_finite(m[t]);
    }
};

template <class Policy, class T>
index count_non_finite(Policy&& policy, const T* m, index count, index lower_of_n = 0) {
    if (count <= 0) return 0;
    return thrust::transform_reduce(policy, thrust::counting_iterator<index>(0), thrust::counting_iterator<index>(count),
                                    non_finite_counter<T>{m, lower_of_n}, index{0}, thrust::plus<index>());
}

template <class T>
struct product_in_double {
    const T* x;
    const T* y;
    KFAC_HOST_DEVICE double operator()(index t) const { return static_cast<double>(x[t]) * static_cast<double>(y[t]); }
};

/// Σ x∘y accumulated in double.
template <class Policy, class T>
double frobenius_dot(Policy&& policy, const T* x, const T* y, index count) {
    if (count <= 0) return 0.0;
    return thrust::transform_reduce(policy, thrust::counting_iterator<index>(0), thrust::counting_iterator<index>(count),
                                    product_in_double<T>{x, y}, 0.0, thrust::plus<double>());
}

}  // namespace kfac::backend::kernels
