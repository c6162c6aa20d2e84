// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's kernels for Embedding, weight sharing `reduce`, LayerNorm/BatchNorm,
// [in, out] weights and eigenbasis reuse (device_layer_kernels.cuh), run on the CPU through
// Thrust's CPP system and checked against the CPU backend on the same inputs. Where the kernel
// performs the CPU backend's roundings in its order the check is equality; where a sum runs in
// another order the tolerance is the bound of a sum of k terms, k·ε relative to the sum of
// magnitudes, which for these well-scaled random inputs is below 1e-13 in double.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <thrust/system/cpp/execution_policy.h>

#include <kfac/backend/detail/device_layer_kernels.cuh>

#include "unit/test_util.hpp"

namespace {

using kfac_test::mat;
using kfac_test::random_vector;
using kfac_test::rel_err;
namespace kernels = kfac::backend::kernels;
using index = std::int64_t;

/// Column-major host emulation of the gram GEMM backend::cuda issues for `reduce`
/// (op = N): lower triangle of C = alpha·R Rᵀ + beta·C, R n × k with leading dimension n.
template <class T>
mat<T> gram_of_columns(const std::vector<T>& r, index n, index k, T alpha) {
    const Eigen::Map<const mat<T>> m(r.data(), n, k);
    return (alpha * (m * m.transpose())).template triangularView<Eigen::Lower>();
}

template <class T>
mat<T> lower_part(const mat<T>& m) {
    return m.template triangularView<Eigen::Lower>();
}

TEST_CASE("token counts and frequencies equal the CPU backend's Embedding statistic", "[cuda][kernels]") {
    using T = float;
    using cpu = kfac::backend::cpu_eigen<T>;
    const index tokens = 11, rows = 40;
    std::vector<T> ids(static_cast<std::size_t>(rows));
    for (index i = 0; i < rows; ++i) ids[static_cast<std::size_t>(i)] = static_cast<T>((i * 7 + i / 3) % 9);  // 9, 10 unused
    const auto d = kfac::embedding_description(tokens, 4);
    for (T beta : {T(0), T(0.9)}) {
        mat<T> expected = mat<T>::Map(random_vector<T>(static_cast<std::size_t>(tokens), 3).data(), tokens, 1);
        std::vector<T> got(expected.data(), expected.data() + tokens);
        cpu::workspace ws;
        cpu::accumulate_a_statistic(expected, d, kfac::tensor_view<const T>(ids.data(), {rows}),
                                    kfac::conv_patch_mode::reference, beta, ws);
        std::vector<std::int64_t> counts(static_cast<std::size_t>(tokens + 1), 0);
        kernels::count_tokens(thrust::cpp::par, ids.data(), rows, tokens, counts.data());
        CHECK(counts[static_cast<std::size_t>(tokens)] == 0);
        kernels::token_frequencies(thrust::cpp::par, got.data(), counts.data(), tokens, T(1) / T(rows), beta);
        for (index v = 0; v < tokens; ++v) CHECK(got[static_cast<std::size_t>(v)] == expected(v, 0));  // same roundings
    }
    // Ids that are not integers in [0, tokens) land in the extra slot, not in a row.
    const std::vector<T> bad = {T(1), T(-1), T(2.5), T(11), std::numeric_limits<T>::quiet_NaN(), T(10)};
    std::vector<std::int64_t> counts(static_cast<std::size_t>(tokens + 1), 0);
    kernels::count_tokens(thrust::cpp::par, bad.data(), static_cast<index>(bad.size()), tokens, counts.data());
    CHECK(counts[static_cast<std::size_t>(tokens)] == 4);
    CHECK(counts[1] == 1);
    CHECK(counts[10] == 1);
}

TEST_CASE("weight sharing reduce: per-example rows and one gram equal the CPU backend", "[cuda][kernels]") {
    using T = double;
    using cpu = kfac::backend::cpu_eigen<T>;
    const index n = 4;
    SECTION("Linear [N, positions, features]") {
        const index positions = 5, in = 3, out = 2;
        for (bool bias : {true, false}) {
            const auto d = kfac::with_sharing(kfac::linear_description(in, out, bias), kfac::weight_sharing::reduce);
            const auto x = random_vector<T>(static_cast<std::size_t>(n * positions * in), 5);
            const auto y = random_vector<T>(static_cast<std::size_t>(n * positions * out), 6);
            const kfac::tensor_view<const T> a(x.data(), {n, positions, in}), g(y.data(), {n, positions, out});
            mat<T> a_ref = mat<T>::Zero(d.a_dim(), d.a_dim()), g_ref = mat<T>::Zero(out, out);
            cpu::workspace ws;
            cpu::accumulate_a_statistic(a_ref, d, a, kfac::conv_patch_mode::reference, T(0), ws);
            cpu::accumulate_g_statistic(g_ref, d, g, T(0), ws);

            std::vector<T> reduced(static_cast<std::size_t>(d.a_dim() * n), T(-7));
            kernels::mean_rows_per_example(thrust::cpp::par, x.data(), n, positions, in, reduced.data(), d.a_dim());
            if (bias) kernels::fill_row(thrust::cpp::par, reduced.data(), d.a_dim(), in, n, T(1));
            CHECK(rel_err(gram_of_columns(reduced, d.a_dim(), n, T(1) / T(n)), lower_part(a_ref)) < 1e-14);
            std::vector<T> sums(static_cast<std::size_t>(out * n));
            kernels::sum_rows_per_example(thrust::cpp::par, y.data(), n, positions, out, sums.data());
            CHECK(rel_err(gram_of_columns(sums, out, n, T(1) / T(n)), lower_part(g_ref)) < 1e-14);
        }
    }
    SECTION("Conv2d: the mean patch of each example, padding included") {
        const index c_in = 2, c_out = 3, h = 6, w = 5;
        const kfac::conv2d_geometry geometry{{3, 2}, {2, 1}, {1, 1}, {1, 2}, 1};
        for (auto mode : {kfac::conv_patch_mode::reference, kfac::conv_patch_mode::dilated}) {
            const auto d = kfac::with_sharing(kfac::conv2d_description(c_in, c_out, geometry, true),
                                              kfac::weight_sharing::reduce);
            const auto grid = kfac::make_patch_grid(geometry, h, w, mode);
            const index ho = kfac::conv_output_extent(h, 3, 2, 1, 1), wo = kfac::conv_output_extent(w, 2, 1, 1, 2);
            const auto x = random_vector<T>(static_cast<std::size_t>(n * c_in * h * w), 7);
            const auto y = random_vector<T>(static_cast<std::size_t>(n * c_out * ho * wo), 8);
            const kfac::tensor_view<const T> a(x.data(), {n, c_in, h, w}), g(y.data(), {n, c_out, ho, wo});
            mat<T> a_ref = mat<T>::Zero(d.a_dim(), d.a_dim()), g_ref = mat<T>::Zero(c_out, c_out);
            cpu::workspace ws;
            cpu::accumulate_a_statistic(a_ref, d, a, mode, T(0), ws);
            cpu::accumulate_g_statistic(g_ref, d, g, T(0), ws);

            std::vector<T> reduced(static_cast<std::size_t>(d.a_dim() * n), T(-7));
            kernels::mean_patch_per_example(thrust::cpp::par, x.data(), n, c_in, h, w, geometry, grid, reduced.data(),
                                            d.a_dim());
            kernels::fill_row(thrust::cpp::par, reduced.data(), d.a_dim(), d.weight_columns(), n, T(1));
            CHECK(rel_err(gram_of_columns(reduced, d.a_dim(), n, T(1) / T(n)), lower_part(a_ref)) < 1e-14);
            std::vector<T> sums(static_cast<std::size_t>(c_out * n));
            kernels::sum_positions_per_example(thrust::cpp::par, y.data(), n, c_out, ho * wo, sums.data());
            CHECK(rel_err(gram_of_columns(sums, c_out, n, T(1) / T(n)), lower_part(g_ref)) < 1e-14);
        }
    }
}

TEST_CASE("unit-wise statistics, inverses and products equal the CPU backend's", "[cuda][kernels]") {
    using T = double;
    using cpu = kfac::backend::cpu_eigen<T>;
    struct norm_case {
        kfac::layer_description d;
        std::vector<index> shape;
    };
    const std::vector<norm_case> cases = {
        {kfac::layer_norm_description(5, true), {3, 4, 5}},
        {kfac::layer_norm_description(5, false), {6, 5}},
        {kfac::batch_norm_description(3, true), {4, 3, 2, 3}},  // `reduce`: positions summed per example
        {kfac::with_sharing(kfac::batch_norm_description(3, true), kfac::weight_sharing::expand), {4, 3, 2, 3}},
        {kfac::batch_norm_description(3, false), {4, 3, 5}},
    };
    for (const auto& c : cases) {
        index size = 1;
        for (index e : c.shape) size *= e;
        const auto x = random_vector<T>(static_cast<std::size_t>(size), 21);
        const auto dy = random_vector<T>(static_cast<std::size_t>(size), 22);
        kfac::tensor_view<const T> xv(x.data(), {}), dyv(dy.data(), {});
        xv.rank = dyv.rank = static_cast<int>(c.shape.size());
        for (std::size_t i = 0; i < c.shape.size(); ++i) xv.extents[i] = dyv.extents[i] = c.shape[i];
        const index channels = c.d.out, columns = c.d.bias ? 3 : 1;
        for (T beta : {T(0), T(0.5)}) {
            mat<T> expected = mat<T>::Map(random_vector<T>(static_cast<std::size_t>(channels * columns), 4).data(),
                                          channels, columns);
            mat<T> got = expected;
            cpu::workspace ws;
            cpu::accumulate_unit_wise_statistic(expected, c.d, xv, dyv, beta, ws);
            const auto layout = kfac::detail::norm_layout_of(c.d, xv);
            kernels::unit_wise_statistic(thrust::cpp::par, x.data(), dy.data(), layout.examples, layout.positions,
                                         channels, layout.channels_last, layout.sum_positions, c.d.bias,
                                         T(1) / static_cast<T>(layout.rows()), beta, got.data());
            CHECK(rel_err(got, expected) < 1e-14);
        }
        const mat<T> blocks = cpu::unit_wise_identity(channels, columns == 3 ? 2 : 1);
        mat<T> identity(channels, columns);
        kernels::unit_wise_identity(thrust::cpp::par, identity.data(), channels, columns);
        CHECK(identity == blocks);

        // A PSD block per channel (a mean of t tᵀ), then its damped inverse and the product.
        mat<T> f(channels, columns), inverse_cpu, inverse(channels, columns);
        cpu::workspace ws;
        cpu::accumulate_unit_wise_statistic(f, c.d, xv, dyv, T(0), ws);
        REQUIRE(cpu::unit_wise_damped_inverse(f, T(0.01), inverse_cpu));
        kernels::unit_wise_damped_inverse(thrust::cpp::par, f.data(), channels, columns, T(0.01), inverse.data());
        CHECK(inverse == inverse_cpu);  // the closed form's roundings, in the same order
        const index k = columns == 3 ? 2 : 1;
        const mat<T> gamma_t = mat<T>::Map(random_vector<T>(static_cast<std::size_t>(k * channels), 9).data(), k, channels);
        mat<T> p_cpu, p(k, channels);
        cpu::unit_wise_multiply(inverse_cpu, gamma_t, p_cpu);
        kernels::unit_wise_multiply(thrust::cpp::par, inverse_cpu.data(), channels, columns, gamma_t.data(), p.data());
        CHECK(p == p_cpu);
    }
    // Averaging and scaling entry by entry, as the CPU backend does (never mirrored).
    const mat<T> sum = mat<T>::Map(random_vector<T>(9, 31).data(), 3, 3);
    mat<T> f = mat<T>::Map(random_vector<T>(9, 32).data(), 3, 3), f_cpu = f;
    cpu::average_blocks(f_cpu, sum, T(0.95), T(0.05));
    kernels::axpby(thrust::cpp::par, f.data(), sum.data(), 9, T(0.95), T(0.05));
    CHECK(f == f_cpu);
}

TEST_CASE("diagonal factors and [in, out] weight transposes equal the CPU backend's", "[cuda][kernels]") {
    using T = float;
    using cpu = kfac::backend::cpu_eigen<T>;
    const index in = 6, out = 4;
    mat<T> column = mat<T>::Map(random_vector<T>(static_cast<std::size_t>(in), 41).data(), in, 1).cwiseAbs();
    mat<T> reciprocal_cpu, reciprocal(in, 1);
    REQUIRE(cpu::damped_reciprocal(column, T(0.003), reciprocal_cpu));
    kernels::damped_reciprocal(thrust::cpp::par, column.data(), in, T(0.003), reciprocal.data());
    CHECK(reciprocal == reciprocal_cpu);

    mat<T> m = mat<T>::Map(random_vector<T>(static_cast<std::size_t>(in * out), 42).data(), in, out), m_cpu = m;
    cpu::scale_rows(m_cpu, column);
    kernels::scale_rows(thrust::cpp::par, m.data(), in, out, column.data());
    CHECK(m == m_cpu);

    // Running average of a diagonal factor: its n × 1 column entry by entry.
    mat<T> sum = column, f = mat<T>::Ones(in, 1), f_cpu = f;
    cpu::running_average(f_cpu, sum, T(0.95), T(0.05));
    kernels::axpby(thrust::cpp::par, f.data(), sum.data(), in, T(0.95), T(0.05));
    CHECK(f == f_cpu);

    // An [in, out] weight gradient (C-order) in and out of its in × out matrix.
    auto w = random_vector<T>(static_cast<std::size_t>(in * out), 43);
    mat<T> gamma_cpu, gamma(in, out);
    cpu::load_gradient_transposed(gamma_cpu, kfac::tensor_view<const T>(w.data(), {in, out}));
    kernels::c_order_to_column_major(thrust::cpp::par, w.data(), in, out, gamma.data());
    CHECK(gamma == gamma_cpu);
    std::vector<T> stored_cpu(w.size()), stored(w.size());
    cpu::store_gradient_transposed(gamma, T(0.5), kfac::tensor_view<T>(stored_cpu.data(), {in, out}));
    kernels::column_major_to_c_order(thrust::cpp::par, gamma.data(), in, out, T(0.5), stored.data());
    CHECK(stored == stored_cpu);
}

TEST_CASE("Rayleigh quotients and the residual equal the CPU backend's", "[cuda][kernels]") {
    using T = double;
    using cpu = kfac::backend::cpu_eigen<T>;
    const index n = 7;
    const auto x = random_vector<T>(static_cast<std::size_t>(n * 2 * n), 51);
    const mat<T> xm = mat<T>::Map(x.data(), n, 2 * n);
    const mat<T> f = xm * xm.transpose() / T(2 * n);
    // The basis of a nearby matrix, so the residual is small but not zero.
    const mat<T> perturbed = f + T(1e-3) * mat<T>::Identity(n, n) + T(1e-3) * mat<T>::Ones(n, n);
    cpu::matrix q;
    cpu::vector eigenvalues;
    REQUIRE(cpu::symmetric_eigen(perturbed, q, eigenvalues));
    cpu::vector lambda_cpu;
    const double residual_cpu = cpu::rayleigh_quotients(f, q, lambda_cpu);
    const mat<T> fq = f * q;  // the GEMM, on the host
    std::vector<T> lambda(static_cast<std::size_t>(n));
    std::vector<double> partial(static_cast<std::size_t>(2 * n));
    kernels::rayleigh_columns(thrust::cpp::par, f.data(), q.data(), fq.data(), n, lambda.data(), partial.data(),
                              partial.data() + n);
    const double residual = std::sqrt(kernels::sum(thrust::cpp::par, partial.data(), n)) /
                            std::sqrt(kernels::sum(thrust::cpp::par, partial.data() + n, n));
    // F Q: the CPU backend's BLAS GEMM against Eigen's product here, each entry a sum of n
    // terms in another order: an error of n·ε·‖F‖ per entry. The quotients carry it relative
    // to their size; the residual, normalised by ‖F‖_F, carries it as an absolute error.
    for (index j = 0; j < n; ++j)
        CHECK(std::abs(lambda[static_cast<std::size_t>(j)] - lambda_cpu(j)) <= 1e-14 * std::abs(lambda_cpu(j)) + 1e-15);
    CHECK(residual_cpu > 1e-6);
    CHECK(std::abs(residual - residual_cpu) <= 1e-13);
}


TEST_CASE("batched gradient checks: per-pair non-finite counts and dots in chunks", "[cuda][kernels]") {
    using T = float;
    using cpu = kfac::backend::cpu_eigen<T>;
    // Three pairs of 7, 1 and 20 elements, cut into chunks of 3 (the backend cuts at 2¹⁴).
    const std::vector<index> sizes = {7, 1, 20};
    std::vector<std::vector<T>> x, y;
    for (std::size_t p = 0; p < sizes.size(); ++p) {
        x.push_back(random_vector<T>(static_cast<std::size_t>(sizes[p]), 61 + static_cast<std::uint32_t>(p)));
        y.push_back(random_vector<T>(static_cast<std::size_t>(sizes[p]), 71 + static_cast<std::uint32_t>(p)));
    }
    x[2][13] = std::numeric_limits<T>::infinity();
    y[2][4] = std::numeric_limits<T>::quiet_NaN();
    std::vector<const T*> xs, ys;
    std::vector<index> begin = {0};
    std::vector<kernels::check_chunk> chunks;
    for (std::size_t p = 0; p < sizes.size(); ++p) {
        xs.push_back(x[p].data());
        ys.push_back(y[p].data());
        for (index first = 0; first < sizes[p]; first += 3)
            chunks.push_back({static_cast<index>(p), first, std::min<index>(3, sizes[p] - first)});
        begin.push_back(static_cast<index>(chunks.size()));
    }
    std::vector<double> chunk_dot(chunks.size()), dots(sizes.size());
    std::vector<std::int64_t> chunk_bad(chunks.size()), bad(sizes.size());
    kernels::chunk_checks(thrust::cpp::par, xs.data(), ys.data(), chunks.data(), static_cast<index>(chunks.size()),
                          chunk_dot.data(), chunk_bad.data());
    kernels::pair_totals(thrust::cpp::par, begin.data(), static_cast<index>(sizes.size()), chunk_dot.data(),
                         chunk_bad.data(), dots.data(), bad.data());
    CHECK(bad == std::vector<std::int64_t>{0, 0, 2});
    for (std::size_t p = 0; p < 2; ++p) {
        const auto size = static_cast<index>(sizes[p]);
        const double expected = cpu::frobenius_dot(mat<T>::Map(x[p].data(), size, 1), mat<T>::Map(y[p].data(), size, 1));
        // Products exact in double; the sums of ≤ 20 terms in another association: 20 ε_double.
        CHECK(std::abs(dots[p] - expected) <= 20 * 2.2e-16 * (std::abs(expected) + 1));
    }
}


TEST_CASE("small decompositions together: gather, status and scatter", "[cuda][kernels]") {
    using T = double;
    const index n = 3, count = 4;
    std::vector<std::vector<T>> matrices;
    std::vector<const T*> inputs;
    for (index b = 0; b < count; ++b) {
        matrices.push_back(random_vector<T>(static_cast<std::size_t>(n * n), 81 + static_cast<std::uint32_t>(b)));
        inputs.push_back(matrices.back().data());
    }
    std::vector<T> packed(static_cast<std::size_t>(count * n * n));
    kernels::gather_arrays(thrust::cpp::par, inputs.data(), n * n, count, packed.data());
    for (index b = 0; b < count; ++b)
        for (index i = 0; i < n * n; ++i)
            CHECK(packed[static_cast<std::size_t>(b * n * n + i)] == matrices[static_cast<std::size_t>(b)][static_cast<std::size_t>(i)]);
    // What the solver left: item 1 failed (info 2), item 2 has a NaN eigenvalue, item 3 an
    // infinite eigenvector entry; item 0 is usable.
    std::vector<T> values(static_cast<std::size_t>(count * n), T(1));
    values[static_cast<std::size_t>(2 * n + 1)] = std::numeric_limits<T>::quiet_NaN();
    packed[static_cast<std::size_t>(3 * n * n + 4)] = -std::numeric_limits<T>::infinity();
    const std::vector<int> info = {0, 2, 0, 0};
    std::vector<std::int64_t> status(static_cast<std::size_t>(count), 99);
    kernels::batch_status(thrust::cpp::par, info.data(), packed.data(), values.data(), n, count, status.data());
    CHECK(status == std::vector<std::int64_t>{0, -1, 1, 1});
    std::vector<std::vector<T>> out(static_cast<std::size_t>(count), std::vector<T>(static_cast<std::size_t>(n)));
    std::vector<T*> outputs;
    for (auto& o : out) outputs.push_back(o.data());
    kernels::scatter_arrays(thrust::cpp::par, values.data(), n, count, outputs.data());
    for (index b = 0; b < count; ++b)
        for (index i = 0; i < n; ++i)
            CHECK((out[static_cast<std::size_t>(b)][static_cast<std::size_t>(i)] == values[static_cast<std::size_t>(b * n + i)] ||
                   std::isnan(values[static_cast<std::size_t>(b * n + i)])));
}

}  // namespace
