// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's element-wise kernels run on the CPU through Thrust's CPP system
// (this file is compiled by g++ with THRUST_DEVICE_SYSTEM_CPP), checked against the CPU
// backend. Together with a host emulation of the SYRK calls the backend makes (same
// transpose, sizes and leading dimensions), this pins down every layout and scaling
// convention of the CUDA statistics on machines without a GPU.

#include <catch2/catch.hpp>

#include <algorithm>
#include <limits>

#include <thrust/system/cpp/execution_policy.h>

#include <kfac/backend/detail/device_kernels.cuh>

#include "unit/test_util.hpp"

namespace {

using kfac_test::mat;
using kfac_test::random_vector;
using kfac_test::rel_err;
namespace kernels = kfac::backend::kernels;
using index = std::int64_t;

/// Column-major host emulation of cuBLAS ?syrk with CUBLAS_FILL_MODE_LOWER:
/// C = alpha·op(A)·op(A)ᵀ + beta·C, op(A) n × k (trans: A is k × n with leading dim lda).
template <class T>
void host_syrk(bool trans, index n, index k, T alpha, const T* a, index lda, T beta, T* c, index ldc) {
    for (index j = 0; j < n; ++j)
        for (index i = j; i < n; ++i) {
            T s = 0;
            for (index p = 0; p < k; ++p) {
                const T x = trans ? a[p + i * lda] : a[i + p * lda];
                const T y = trans ? a[p + j * lda] : a[j + p * lda];
                s += x * y;
            }
            c[i + j * ldc] = (beta == T(0) ? T(0) : beta * c[i + j * ldc]) + alpha * s;
        }
}

template <class T>
mat<T> lower_of(const mat<T>& m) {
    return m.template triangularView<Eigen::Lower>();
}

TEST_CASE("patch kernel + one SYRK equals the CPU backend's conv A statistic", "[cuda][kernels]") {
    using T = double;
    using cpu = kfac::backend::cpu_eigen<T>;
    struct config {
        kfac::conv2d_geometry g;
        bool bias;
        kfac::conv_patch_mode mode;
    };
    const std::vector<config> configs = {
        {{{3, 3}, {1, 1}, {1, 1}, {1, 1}, 1}, true, kfac::conv_patch_mode::reference},
        {{{3, 2}, {2, 1}, {0, 1}, {1, 1}, 1}, false, kfac::conv_patch_mode::reference},
        {{{2, 3}, {1, 2}, {2, 0}, {2, 1}, 1}, true, kfac::conv_patch_mode::dilated},
        {{{2, 3}, {1, 2}, {2, 0}, {2, 1}, 1}, true, kfac::conv_patch_mode::reference},
    };
    const index n = 3, c_in = 2, h = 7, w = 6, c_out = 4;
    for (const auto& cfg : configs) {
        const auto d = kfac::conv2d_description(c_in, c_out, cfg.g, cfg.bias);
        const auto input = random_vector<T>(static_cast<std::size_t>(n * c_in * h * w), 11);
        const kfac::tensor_view<const T> a(input.data(), {n, c_in, h, w});
        mat<T> expected = mat<T>::Zero(d.a_dim(), d.a_dim());
        cpu::workspace ws;
        cpu::accumulate_a_statistic(expected, d, a, cfg.mode, T(0), ws);

        // What backend::cuda does: patches of every (sample, grid row) at once, then one SYRK
        // with op = T over positions, alpha = 1/(N·S³).
        const auto grid = kfac::make_patch_grid(cfg.g, h, w, cfg.mode);
        const index rows = n * grid.rows, positions = rows * grid.cols, ld = positions + 3;  // ld > positions
        std::vector<T> patches(static_cast<std::size_t>(ld * d.a_dim()), T(-99));
        kernels::extract_patches(thrust::cpp::par, input.data(), c_in, h, w, cfg.g, grid, 0, rows, cfg.bias,
                                 patches.data(), ld);
        const T s = static_cast<T>(grid.positions());
        mat<T> got = mat<T>::Constant(d.a_dim(), d.a_dim(), T(7));
        host_syrk<T>(true, d.a_dim(), positions, T(1) / (T(n) * s * s * s), patches.data(), ld, T(0), got.data(),
                     d.a_dim());
        CHECK(rel_err(lower_of<T>(got), lower_of<T>(expected)) < 1e-13);

        // Chunked: the grid rows in two pieces, the second accumulated with beta = 1.
        const index first_chunk = rows / 2;
        got.setConstant(T(7));
        for (auto [first, count] : {std::pair<index, index>{0, first_chunk}, {first_chunk, rows - first_chunk}}) {
            const index k = count * grid.cols;
            kernels::extract_patches(thrust::cpp::par, input.data(), c_in, h, w, cfg.g, grid, first, count, cfg.bias,
                                     patches.data(), ld);
            host_syrk<T>(true, d.a_dim(), k, T(1) / (T(n) * s * s * s), patches.data(), ld, first == 0 ? T(0) : T(1),
                         got.data(), d.a_dim());
        }
        CHECK(rel_err(lower_of<T>(got), lower_of<T>(expected)) < 1e-13);
    }
}

TEST_CASE("Linear A statistic with the ones row and the G statistics match the CPU backend", "[cuda][kernels]") {
    using T = double;
    using cpu = kfac::backend::cpu_eigen<T>;
    const index rows = 9, in = 5, out = 3;
    const auto x = random_vector<T>(static_cast<std::size_t>(rows * in), 3);
    const auto d = kfac::linear_description(in, out, true);
    mat<T> expected = mat<T>::Zero(in + 1, in + 1);
    cpu::workspace ws;
    cpu::accumulate_a_statistic(expected, d, kfac::tensor_view<const T>(x.data(), {rows, in}),
                                kfac::conv_patch_mode::reference, T(0), ws);
    // backend::cuda: X copied into an (in + 1) × rows column-major buffer, then the ones row.
    std::vector<T> augmented(static_cast<std::size_t>((in + 1) * rows), T(-5));
    for (index r = 0; r < rows; ++r)
        for (index k = 0; k < in; ++k) augmented[static_cast<std::size_t>(k + r * (in + 1))] = x[static_cast<std::size_t>(r * in + k)];
    kernels::fill_row(thrust::cpp::par, augmented.data(), in + 1, in, rows, T(1));
    mat<T> got = mat<T>::Zero(in + 1, in + 1);
    host_syrk<T>(false, in + 1, rows, T(1) / T(rows), augmented.data(), in + 1, T(0), got.data(), in + 1);
    CHECK(rel_err(lower_of<T>(got), lower_of<T>(expected)) < 1e-14);

    // Conv G: [N, C, S] reordered to (N·S) × C, one SYRK with op = T.
    const index n = 4, c = 3, sp_h = 2, sp_w = 3, spatial = sp_h * sp_w;
    const auto y = random_vector<T>(static_cast<std::size_t>(n * c * spatial), 5);
    const auto conv = kfac::conv2d_description(2, c, {{1, 1}, {1, 1}, {0, 0}, {1, 1}, 1}, false);
    mat<T> g_expected = mat<T>::Zero(c, c);
    cpu::accumulate_g_statistic(g_expected, conv, kfac::tensor_view<const T>(y.data(), {n, c, sp_h, sp_w}), T(0), ws);
    std::vector<T> permuted(static_cast<std::size_t>(n * spatial * c));
    kernels::channels_last(thrust::cpp::par, y.data(), n, c, spatial, permuted.data());
    mat<T> g_got = mat<T>::Zero(c, c);
    const T s = T(spatial);
    host_syrk<T>(true, c, n * spatial, T(1) / (T(n) * s * s * s), permuted.data(), n * spatial, T(0), g_got.data(), c);
    CHECK(rel_err(lower_of<T>(g_got), lower_of<T>(g_expected)) < 1e-14);
}

TEST_CASE("running average, mirroring and scaling match the CPU backend", "[cuda][kernels]") {
    using T = float;
    using cpu = kfac::backend::cpu_eigen<T>;
    const index n = 6;
    mat<T> sum = mat<T>::Map(random_vector<T>(static_cast<std::size_t>(n * n), 7).data(), n, n);
    mat<T> f = mat<T>::Map(random_vector<T>(static_cast<std::size_t>(n * n), 8).data(), n, n);
    mat<T> sum_cpu = sum, f_cpu = f;
    cpu::running_average(f_cpu, sum_cpu, T(0.95), T(0.05));
    kernels::running_average(thrust::cpp::par, f.data(), sum.data(), n, T(0.95), T(0.05));
    CHECK(f == f_cpu);  // the same two roundings per element

    mat<T> m = sum, m_cpu = sum;
    cpu::scale_symmetric(m_cpu, T(3));
    kernels::mirror_lower(thrust::cpp::par, m.data(), n);
    kernels::scale(thrust::cpp::par, m.data(), n * n, T(3));
    CHECK(m == m_cpu);
}

TEST_CASE("eigenvalue products, clamping and identities match the CPU backend", "[cuda][kernels]") {
    using T = float;
    using cpu = kfac::backend::cpu_eigen<T>;
    const index m = 4, n = 3;
    cpu::vector a = cpu::vector::Map(random_vector<T>(static_cast<std::size_t>(m), 1).data(), m);
    cpu::vector g = cpu::vector::Map(random_vector<T>(static_cast<std::size_t>(n), 2).data(), n);
    cpu::vector a_dev = a;
    cpu::clamp_nonnegative(a);
    kernels::clamp_nonnegative(thrust::cpp::par, a_dev.data(), m);
    CHECK(a_dev == a);
    // Factored damping's shift of the eigenvalues: the same one rounding per entry.
    cpu::add_constant(a, T(0.125));
    kernels::add_constant(thrust::cpp::par, a_dev.data(), m, T(0.125));
    CHECK(a_dev == a);
    cpu::clamp_nonnegative(g);
    cpu::matrix d_cpu, d(m, n);
    cpu::inverse_eigen_product(a, g, T(0.003), d_cpu);
    kernels::inverse_eigen_product(thrust::cpp::par, a.data(), m, g.data(), n, T(0.003), d.data());
    CHECK(d == d_cpu);

    cpu::matrix v = cpu::matrix::Map(random_vector<T>(static_cast<std::size_t>(m * n), 4).data(), m, n);
    cpu::matrix v_cpu = v, v2 = v, v2_cpu = v;
    cpu::divide_by_eigen_product(v_cpu, a, g, T(0.003));
    kernels::divide_by_eigen_product(thrust::cpp::par, v.data(), a.data(), m, g.data(), n, T(0.003));
    CHECK(v == v_cpu);
    cpu::multiply_elementwise(v2_cpu, d_cpu);
    kernels::multiply_elementwise(thrust::cpp::par, v2.data(), d.data(), m * n);
    CHECK(v2 == v2_cpu);

    cpu::matrix id(5, 5);
    kernels::scaled_identity(thrust::cpp::par, id.data(), 5, T(0.25));
    CHECK(id == cpu::scaled_identity(5, T(0.25)));
    kernels::add_to_diagonal(thrust::cpp::par, id.data(), 5, T(1));
    CHECK(id == cpu::scaled_identity(5, T(1.25)));
}

TEST_CASE("finiteness counts and the double-accumulated dot product", "[cuda][kernels]") {
    using T = float;
    const index n = 4;
    std::vector<T> m(static_cast<std::size_t>(n * n), T(1));
    CHECK(kernels::count_non_finite(thrust::cpp::par, m.data(), n * n) == 0);
    m[static_cast<std::size_t>(0 + 2 * n)] = std::numeric_limits<T>::quiet_NaN();  // (0, 2): upper triangle
    CHECK(kernels::count_non_finite(thrust::cpp::par, m.data(), n * n) == 1);
    CHECK(kernels::count_non_finite(thrust::cpp::par, m.data(), n * n, n) == 0);  // lower only
    m[static_cast<std::size_t>(3 + 1 * n)] = -std::numeric_limits<T>::infinity();  // (3, 1): lower
    CHECK(kernels::count_non_finite(thrust::cpp::par, m.data(), n * n, n) == 1);

    const auto x = random_vector<T>(1000, 12), y = random_vector<T>(1000, 13);
    double expected = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) expected += static_cast<double>(x[i]) * static_cast<double>(y[i]);
    CHECK(std::abs(kernels::frobenius_dot(thrust::cpp::par, x.data(), y.data(), 1000) - expected) <=
          1e-12 * std::abs(expected) + 1e-12);
}

}  // namespace

TEST_CASE("the format kernels round as the host does: bf16/fp16 device views", "[cuda][kernels][precision]") {
    // widen_elements and narrow_elements run the host's constexpr conversions per element
    // (kfac/detail/number_conversion.hpp, checked against the definition of rounding in
    // tests/unit/precision_inputs_test.cpp); here, that the kernels apply them element by
    // element, in both formats, from float and from double, specials included.
    std::vector<double> values = random_vector<double>(4096, 17, 300.0);
    for (double x : {0.0, -0.0, 1.0 + 0x1p-8 + 0x1p-40, 65504.0, 65520.0, 1e-8, -3e38, 1e300,
                     std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()})
        values.push_back(x);
    const auto n = static_cast<std::int64_t>(values.size());
    for (const kfac::precision f : {kfac::precision::bf16, kfac::precision::fp16}) {
        std::vector<std::uint16_t> from_double(values.size()), host(values.size());
        kernels::narrow_elements(thrust::cpp::par, values.data(), n, f, from_double.data());
        kfac::detail::narrow(values.data(), n, f, host.data());
        CHECK(from_double == host);
        std::vector<float> floats(values.begin(), values.end());
        std::vector<std::uint16_t> from_float(values.size()), host_float(values.size());
        kernels::narrow_elements(thrust::cpp::par, floats.data(), n, f, from_float.data());
        kfac::detail::narrow(floats.data(), n, f, host_float.data());
        CHECK(from_float == host_float);
        std::vector<double> widened(values.size()), host_widened(values.size());
        kernels::widen_elements(thrust::cpp::par, from_double.data(), n, f, widened.data());
        kfac::detail::widen(from_double.data(), n, f, host_widened.data());
        for (std::size_t i = 0; i < values.size(); ++i)
            CHECK((widened[i] == host_widened[i] || (std::isnan(widened[i]) && std::isnan(host_widened[i]))));
        // The write-back's check: as many values beyond the format as the host counts, which are
        // the ones narrowed to a non-finite value (65520 and 1e300, ±Inf and NaN at least).
        const auto beyond = kernels::count_beyond_format(thrust::cpp::par, values.data(), n, f);
        CHECK(beyond == kfac::detail::count_beyond_format(values.data(), n, f));
        CHECK(beyond == std::count_if(host.begin(), host.end(), [&](std::uint16_t b) {
                  return !std::isfinite(kfac::detail::widen_16_bits(b, f));
              }));
        CHECK(beyond >= (f == kfac::precision::fp16 ? 4 : 3));
        CHECK(kernels::count_beyond_format(thrust::cpp::par, floats.data(), n, f) ==
              kfac::detail::count_beyond_format(floats.data(), n, f));
    }
    CHECK(kernels::count_beyond_format(thrust::cpp::par, values.data(), n, kfac::precision::fp32) ==
          kfac::detail::count_beyond_format(values.data(), n, kfac::precision::fp32));
}
