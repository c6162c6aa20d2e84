// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file eigen_mlp.hpp
/// A small multi-layer perceptron written in plain Eigen, as a host framework would have it,
/// shared by the examples (quickstart, and the digits ones in one process and data-parallel):
/// Linear layers with their own backward pass, a ReLU MLP, mean softmax cross-entropy, and SGD
/// with momentum.
///
/// kfac only sees each Linear layer through a kfac::layer_view<float>: four non-owning views
/// of buffers the layer already keeps (its last input, the gradient w.r.t. its output, and
/// its weight and bias gradients).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <Eigen/Core>

#include <kfac/kfac.hpp>

namespace kfac_examples {

// kfac's views are C-order (row-major), so every matrix is row-major: the rows of an
// activation matrix are the samples of a batch, as in PyTorch.
using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using row_vector = Eigen::Matrix<float, 1, Eigen::Dynamic>;

/// Reproducible random numbers. std::mt19937 is specified bit for bit by the standard; the
/// std distributions are not, so uniforms, normals and shuffles are derived here and give the
/// same weights and batch order with every standard library.
class random_source {
public:
    explicit random_source(std::uint32_t seed) : engine_(seed) {}

    float uniform() { return static_cast<float>(engine_() >> 8) * (1.0f / 16777216.0f); }  // [0, 1)

    float normal() {  // Box–Muller
        const float u1 = 1.0f - uniform();  // (0, 1]: the log stays finite
        const float u2 = uniform();
        return std::sqrt(-2.0f * std::log(u1)) * std::cos(2.0f * std::numbers::pi_v<float> * u2);
    }

    template <class T>
    void shuffle(std::vector<T>& v) {  // Fisher–Yates
        for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[engine_() % i]);
    }

private:
    std::mt19937 engine_;
};

/// y = x Wᵀ + b. Like a framework's layer with hooks, it keeps the input of its last forward
/// pass and the gradient w.r.t. its output from the last backward pass: K-FAC's A and G
/// factors are built from exactly these two.
struct linear_layer {
    matrix weight;       // [out, in]
    row_vector bias;     // [out]
    matrix grad_weight;  // [out, in]
    row_vector grad_bias;
    matrix input;        // [batch, in]
    matrix grad_output;  // [batch, out]
    // SGD momentum buffers (PyTorch's convention: v ← μ v + g, w ← w − η v).
    matrix velocity_weight;
    row_vector velocity_bias;

    /// What K-FAC reads and writes. The preconditioner keeps a pointer to it, so a layer must
    /// not move after register_layer().
    kfac::layer_view<float> view;

    /// Weights drawn from N(0, gain / in): gain 2 (He) suits ReLU, gain 1 (LeCun) tanh.
    linear_layer(int in, int out, random_source& rng, float gain = 2.0f)
        : weight(out, in), bias(row_vector::Zero(out)), grad_weight(matrix::Zero(out, in)),
          grad_bias(row_vector::Zero(out)), velocity_weight(matrix::Zero(out, in)),
          velocity_bias(row_vector::Zero(out)) {
        const float scale = std::sqrt(gain / static_cast<float>(in));
        for (Eigen::Index i = 0; i < weight.size(); ++i) weight.data()[i] = scale * rng.normal();
        view.description = kfac::linear_description(in, out, /*bias=*/true);
    }

    matrix forward(const matrix& x) {
        input = x;
        matrix z = x * weight.transpose();
        z.rowwise() += bias;
        return z;
    }

    matrix backward(const matrix& dz) {
        grad_output = dz;
        grad_weight.noalias() = dz.transpose() * input;
        grad_bias = dz.colwise().sum();
        return dz * weight;
    }

    /// Points the views at the current buffers. Needed before each K-FAC step because Eigen
    /// reallocates when the batch size changes (the last batch of an epoch is smaller).
    void point_views() {
        view.input = {input.data(), {input.rows(), input.cols()}};
        view.grad_output = {grad_output.data(), {grad_output.rows(), grad_output.cols()}};
        view.grad_weight = {grad_weight.data(), {grad_weight.rows(), grad_weight.cols()}};
        view.grad_bias = {grad_bias.data(), {grad_bias.cols()}};
    }

    void sgd_update(float lr) {
        weight -= lr * grad_weight;
        bias -= lr * grad_bias;
    }

    void sgd_momentum_update(float lr, float momentum) {
        velocity_weight = momentum * velocity_weight + grad_weight;
        velocity_bias = momentum * velocity_bias + grad_bias;
        weight -= lr * velocity_weight;
        bias -= lr * velocity_bias;
    }
};

/// widths[0] → widths[1] → … → widths.back(), with ReLU between the Linear layers.
struct mlp {
    std::vector<linear_layer> layers;  // built once and never resized (see linear_layer::view)

    mlp(const std::vector<int>& widths, random_source& rng) {
        if (widths.size() < 2) throw std::invalid_argument("mlp: at least an input and an output width");
        layers.reserve(widths.size() - 1);
        for (std::size_t i = 0; i + 1 < widths.size(); ++i) layers.emplace_back(widths[i], widths[i + 1], rng);
    }
    // Copies keep the weights; the views are re-pointed before each use, but must be
    // re-registered with a preconditioner (it holds pointers to the original's views).
    mlp(const mlp&) = default;
    mlp& operator=(const mlp&) = delete;

    /// "64-128-64-10".
    [[nodiscard]] std::string shape() const {
        std::string s = std::to_string(layers.front().weight.cols());
        for (const auto& l : layers) {
            s += '-';  // (not "-" + to_string(...): GCC 12 gives a false -Wrestrict on it)
            s += std::to_string(l.weight.rows());
        }
        return s;
    }

    matrix forward(const matrix& x) {
        matrix h = x;
        for (std::size_t i = 0; i + 1 < layers.size(); ++i) h = layers[i].forward(h).cwiseMax(0.0f);
        return layers.back().forward(h);
    }

    void backward(const matrix& grad_logits) {
        matrix g = layers.back().backward(grad_logits);
        for (std::size_t i = layers.size() - 1; i-- > 0;) {
            // The next layer's input is this layer's ReLU output h, and ReLU' = [h > 0].
            const matrix& h = layers[i + 1].input;
            g = (h.array() > 0.0f).select(g, 0.0f);
            g = layers[i].backward(g);
        }
    }

    void point_views() {
        for (auto& l : layers) l.point_views();
    }

    void sgd_momentum_update(float lr, float momentum) {
        for (auto& l : layers) l.sgd_momentum_update(lr, momentum);
    }

    /// Every parameter, layer by layer (weight then bias): for checksums.
    template <class F>
    void for_each_parameter_block(F&& f) const {
        for (const auto& l : layers) {
            f(l.weight.data(), static_cast<std::size_t>(l.weight.size()));
            f(l.bias.data(), static_cast<std::size_t>(l.bias.size()));
        }
    }
    /// Every gradient, layer by layer (weight then bias): for allreduces.
    template <class F>
    void for_each_gradient_block(F&& f) {
        for (auto& l : layers) {
            f(l.grad_weight.data(), static_cast<std::size_t>(l.grad_weight.size()));
            f(l.grad_bias.data(), static_cast<std::size_t>(l.grad_bias.size()));
        }
    }
};

/// Mean softmax cross-entropy over the rows of `logits`. Writes d(loss)/d(logits) to `grad`
/// when it is not null: each row carries the 1/batch factor of the mean, as a framework's
/// autograd delivers it, which is what K-FAC's G factor expects.
inline float cross_entropy(const matrix& logits, const std::vector<int>& labels, matrix* grad) {
    const auto n = logits.rows();
    matrix p = (logits.colwise() - logits.rowwise().maxCoeff()).array().exp().matrix();
    p.array().colwise() /= p.rowwise().sum().array();
    double loss = 0.0;
    for (Eigen::Index i = 0; i < n; ++i)
        loss -= std::log(std::max(p(i, labels[static_cast<std::size_t>(i)]), 1e-30f));
    if (grad) {
        *grad = p;
        for (Eigen::Index i = 0; i < n; ++i) (*grad)(i, labels[static_cast<std::size_t>(i)]) -= 1.0f;
        *grad /= static_cast<float>(n);
    }
    return static_cast<float>(loss / static_cast<double>(n));
}

/// Fraction of the rows whose largest logit is at the label.
inline double accuracy(const matrix& logits, const std::vector<int>& labels) {
    int correct = 0;
    for (Eigen::Index i = 0; i < logits.rows(); ++i) {
        Eigen::Index best = 0;
        logits.row(i).maxCoeff(&best);
        correct += best == labels[static_cast<std::size_t>(i)];
    }
    return logits.rows() ? static_cast<double>(correct) / static_cast<double>(logits.rows()) : 0.0;
}

/// Rows [first, first + count) of `order`, gathered from a row-major [n, features] table:
/// the inputs `x` and labels `y` of one (shard of a) minibatch.
inline void gather_batch(const std::vector<float>& table, const std::vector<int>& labels, int features,
                         const std::vector<std::size_t>& order, std::size_t first, std::size_t count,
                         matrix& x, std::vector<int>& y) {
    x.resize(static_cast<Eigen::Index>(count), features);
    y.resize(count);
    for (std::size_t i = 0; i < count; ++i) {
        const std::size_t row = order[first + i];
        std::memcpy(x.row(static_cast<Eigen::Index>(i)).data(), table.data() + row * static_cast<std::size_t>(features),
                    sizeof(float) * static_cast<std::size_t>(features));
        y[i] = labels[row];
    }
}

/// The whole table as a matrix (for evaluation).
inline matrix as_matrix(const std::vector<float>& table, int features) {
    const auto rows = static_cast<Eigen::Index>(table.size() / static_cast<std::size_t>(features));
    return Eigen::Map<const matrix>(table.data(), rows, features);
}

}  // namespace kfac_examples
