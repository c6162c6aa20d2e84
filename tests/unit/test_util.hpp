// SPDX-License-Identifier: Apache-2.0
#pragma once
// Helpers shared by the unit tests: seeded random data, naive reference computations and
// the error measure of golden/README.md §7.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <Eigen/Core>

#include <kfac/kfac.hpp>

namespace kfac_test {

template <class T>
std::vector<T> random_vector(std::size_t n, std::uint32_t seed, double scale = 1.0) {
    std::mt19937 gen(seed);
    std::normal_distribution<double> dist(0.0, scale);
    std::vector<T> v(n);
    for (auto& x : v) x = static_cast<T>(dist(gen));
    return v;
}

/// The CPU backend, the one most tests run on.
template <class T>
using backend = kfac::backend::cpu_eigen<T>;

inline bool all_finite(const std::vector<double>& v) {
    for (double x : v)
        if (!std::isfinite(x)) return false;
    return true;
}

/// A file's bytes.
inline std::string file_text(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// max|x − r| / max|r|.
template <class X, class R>
double rel_err(const X& x, const R& r) {
    double num = 0.0, den = 0.0;
    for (Eigen::Index i = 0; i < static_cast<Eigen::Index>(r.size()); ++i) {
        num = std::max(num, std::abs(static_cast<double>(x(i)) - static_cast<double>(r(i))));
        den = std::max(den, std::abs(static_cast<double>(r(i))));
    }
    return den > 0 ? num / den : num;
}

/// rel_err of two buffers; buffers of different lengths differ entirely (1).
template <class T>
double buffer_rel_err(const std::vector<T>& x, const std::vector<T>& r) {
    if (x.size() != r.size()) return 1.0;
    using map = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>;
    return rel_err(map(x.data(), static_cast<Eigen::Index>(x.size())), map(r.data(), static_cast<Eigen::Index>(r.size())));
}

/// Unit roundoff of T, the scale of every tolerance in the tests.
template <class T>
constexpr double eps() {
    return static_cast<double>(std::numeric_limits<T>::epsilon());
}

template <class T>
using mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;

/// A random orthonormal basis, as the eigen method's are: a random matrix's columns by modified
/// Gram–Schmidt (Eigen's SelfAdjointEigenSolver would give one too, at about 5 s of compile time
/// per scalar type; EKFAC's kernels take any Q_A, Q_G).
template <class T>
mat<T> random_orthonormal(std::int64_t dim, std::uint32_t seed) {
    const auto v = random_vector<T>(static_cast<std::size_t>(dim * dim), seed);
    mat<T> q = Eigen::Map<const mat<T>>(v.data(), dim, dim);
    for (Eigen::Index j = 0; j < q.cols(); ++j) {
        for (Eigen::Index k = 0; k < j; ++k) q.col(j) -= q.col(k).dot(q.col(j)) * q.col(k);
        q.col(j) /= q.col(j).norm();
    }
    return q;
}
template <class T>
using row_mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

enum class factor_side { a, g };

/// One batch's A or G statistic of `x` (shaped `shape`) as the preconditioner computes it on
/// the CPU backend (views reshaped by statistic_view), mirrored into a full matrix (a diagonal
/// factor's column made the diagonal matrix it stands for).
template <class T>
mat<T> factor_statistic(const kfac::layer_description& d, const std::vector<T>& x, const std::vector<std::int64_t>& shape,
                        factor_side side, kfac::conv_patch_mode mode = kfac::conv_patch_mode::reference) {
    using backend = kfac::backend::cpu_eigen<T>;
    const bool a = side == factor_side::a;
    const auto n = a ? d.a_dim() : d.g_dim();
    const auto cols = a ? kfac::blocks::layout_of(d).a_cols : n;
    mat<T> sum = mat<T>::Constant(n, cols, std::numeric_limits<T>::quiet_NaN());
    typename backend::workspace ws;
    const auto view = kfac::detail::statistic_view(d, kfac::tensor_view<const T>::from_extents(x.data(), shape));
    if (a) backend::accumulate_a_statistic(sum, d, view, mode, T(0), ws);
    else backend::accumulate_g_statistic(sum, d, view, T(0), ws);
    mat<T> f = mat<T>::Zero(n, cols);
    backend::running_average(f, sum, T(0), T(1));  // mirrors the lower triangle
    if (cols == n) return f;
    return f.col(0).asDiagonal();
}

/// Owns the buffers of one layer and exposes them as a kfac::layer_view.
template <class T>
struct owned_layer {
    kfac::layer_view<T> view;
    std::vector<T> input, grad_output, grad_weight, grad_bias;
    std::vector<std::int64_t> input_shape, output_shape;

    void bind() {
        view.input = kfac::tensor_view<const T>::from_extents(input.data(), input_shape);
        view.grad_output = kfac::tensor_view<const T>::from_extents(grad_output.data(), output_shape);
        const auto& d = view.description;
        if (d.kind == kfac::layer_kind::linear)
            view.grad_weight = kfac::tensor_view<T>(grad_weight.data(), {d.out, d.in});
        else if (d.kind == kfac::layer_kind::embedding)
            view.grad_weight = kfac::tensor_view<T>(grad_weight.data(), {d.in, d.out});
        else if (kfac::is_normalization(d.kind))
            view.grad_weight = kfac::tensor_view<T>(grad_weight.data(), {d.out});
        else if (d.kind == kfac::layer_kind::conv1d)
            view.grad_weight = kfac::tensor_view<T>(grad_weight.data(), {d.out, d.per_group(d.in), d.conv.kernel[1]});
        else
            view.grad_weight = kfac::tensor_view<T>(grad_weight.data(), {d.out, d.per_group(d.in), d.conv.kernel[0], d.conv.kernel[1]});
        view.grad_bias = d.bias ? kfac::tensor_view<T>(grad_bias.data(), {d.out}) : kfac::tensor_view<T>{};
    }
};

template <class T>
owned_layer<T> random_linear(std::int64_t rows, std::int64_t in, std::int64_t out, bool bias, std::uint32_t seed) {
    owned_layer<T> l;
    l.view.description = kfac::linear_description(in, out, bias);
    l.input = random_vector<T>(static_cast<std::size_t>(rows * in), seed);
    l.grad_output = random_vector<T>(static_cast<std::size_t>(rows * out), seed + 1, 1.0 / static_cast<double>(rows));
    l.grad_weight = random_vector<T>(static_cast<std::size_t>(out * in), seed + 2, 0.1);
    l.grad_bias = random_vector<T>(static_cast<std::size_t>(out), seed + 3, 0.1);
    l.input_shape = {rows, in};
    l.output_shape = {rows, out};
    l.bind();
    return l;
}

/// A Conv2d layer's buffers filled with seeded values: input [n, c_in, h, w], output
/// gradients of the convolution's output shape (dilation honoured).
template <class T>
owned_layer<T> random_conv(std::int64_t n, std::int64_t c_in, std::int64_t c_out, const kfac::conv2d_geometry& g,
                           bool bias, std::int64_t h, std::int64_t w, std::uint32_t seed) {
    owned_layer<T> l;
    l.view.description = kfac::conv2d_description(c_in, c_out, g, bias);
    const std::int64_t ho = kfac::conv_output_extent(h, g.kernel[0], g.stride[0], g.padding[0], g.dilation[0]);
    const std::int64_t wo = kfac::conv_output_extent(w, g.kernel[1], g.stride[1], g.padding[1], g.dilation[1]);
    l.input = random_vector<T>(static_cast<std::size_t>(n * c_in * h * w), seed);
    l.grad_output = random_vector<T>(static_cast<std::size_t>(n * c_out * ho * wo), seed + 1, 1.0 / static_cast<double>(n));
    l.grad_weight = random_vector<T>(static_cast<std::size_t>(c_out * (c_in / g.groups) * g.kernel[0] * g.kernel[1]), seed + 2, 0.1);
    l.grad_bias = random_vector<T>(static_cast<std::size_t>(c_out), seed + 3, 0.1);
    l.input_shape = {n, c_in, h, w};
    l.output_shape = {n, c_out, ho, wo};
    l.bind();
    return l;
}

/// A normalisation layer's views: x̂ and dy of `shape`, gradients of γ and β.
template <class T>
owned_layer<T> random_norm(const kfac::layer_description& d, const std::vector<std::int64_t>& shape, std::uint32_t seed) {
    owned_layer<T> l;
    l.view.description = d;
    std::int64_t size = 1;
    for (auto e : shape) size *= e;
    l.input = random_vector<T>(static_cast<std::size_t>(size), seed);
    l.grad_output = random_vector<T>(static_cast<std::size_t>(size), seed + 1, 0.1);
    l.grad_weight = random_vector<T>(static_cast<std::size_t>(d.out), seed + 2, 0.1);
    l.grad_bias = random_vector<T>(static_cast<std::size_t>(d.out), seed + 3, 0.1);
    l.input_shape = l.output_shape = shape;
    l.bind();
    return l;
}

/// An Embedding of `vocabulary` rows of `width` over [examples, positions] token ids, id i
/// being (i·step) mod vocabulary, with seeded output and weight gradients.
template <class T>
owned_layer<T> random_embedding(std::int64_t vocabulary, std::int64_t width, std::int64_t examples, std::int64_t positions,
                                std::int64_t step, std::uint32_t seed) {
    owned_layer<T> l;
    l.view.description = kfac::embedding_description(vocabulary, width);
    for (std::int64_t i = 0; i < examples * positions; ++i) l.input.push_back(static_cast<T>((i * step) % vocabulary));
    l.grad_output = random_vector<T>(static_cast<std::size_t>(examples * positions * width), seed, 0.1);
    l.grad_weight = random_vector<T>(static_cast<std::size_t>(vocabulary * width), seed + 1);
    l.input_shape = {examples, positions};
    l.output_shape = {examples, positions, width};
    l.bind();
    return l;
}

/// Naive direct convolution (zero padding, stride, dilation), NCHW, no bias.
template <class T>
std::vector<T> naive_conv2d(const std::vector<T>& x, std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w,
                            const std::vector<T>& weight, std::int64_t c_out, const kfac::conv2d_geometry& g,
                            std::int64_t& ho, std::int64_t& wo) {
    ho = kfac::conv_output_extent(h, g.kernel[0], g.stride[0], g.padding[0], g.dilation[0]);
    wo = kfac::conv_output_extent(w, g.kernel[1], g.stride[1], g.padding[1], g.dilation[1]);
    std::vector<T> y(static_cast<std::size_t>(n * c_out * ho * wo), T(0));
    for (std::int64_t s = 0; s < n; ++s)
        for (std::int64_t o = 0; o < c_out; ++o)
            for (std::int64_t i = 0; i < ho; ++i)
                for (std::int64_t j = 0; j < wo; ++j) {
                    double acc = 0;
                    for (std::int64_t ci = 0; ci < c; ++ci)
                        for (std::int64_t u = 0; u < g.kernel[0]; ++u)
                            for (std::int64_t v = 0; v < g.kernel[1]; ++v) {
                                const std::int64_t ih = i * g.stride[0] + u * g.dilation[0] - g.padding[0];
                                const std::int64_t iw = j * g.stride[1] + v * g.dilation[1] - g.padding[1];
                                if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
                                acc += static_cast<double>(x[static_cast<std::size_t>(((s * c + ci) * h + ih) * w + iw)]) *
                                       static_cast<double>(weight[static_cast<std::size_t>(((o * c + ci) * g.kernel[0] + u) * g.kernel[1] + v)]);
                            }
                    y[static_cast<std::size_t>(((s * c_out + o) * ho + i) * wo + j)] = static_cast<T>(acc);
                }
    return y;
}

}  // namespace kfac_test
