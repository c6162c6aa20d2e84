// SPDX-License-Identifier: Apache-2.0
// quickstart: trains the same small MLP twice on a synthetic three-spiral problem, once with
// plain SGD and once with SGD on K-FAC preconditioned gradients, and prints both side by side.
//
// The network, its forward/backward pass and the data are written in plain Eigen, as a host
// framework would have them (the Linear layer is the examples' shared one, in
// common/eigen_mlp.hpp); the library only sees each Linear layer through a
// kfac::layer_view<float>: four non-owning views of buffers the MLP already keeps.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <numbers>
#include <string>
#include <vector>

#include <Eigen/Core>

#include <kfac/kfac.hpp>

#include "eigen_mlp.hpp"

namespace {

// The Linear layer, the random numbers and the loss are the examples' shared plain-Eigen
// pieces (common/eigen_mlp.hpp); the tanh MLP and the data are this program's own.
using kfac_examples::accuracy;
using kfac_examples::cross_entropy;
using kfac_examples::linear_layer;
using kfac_examples::matrix;
using kfac_examples::random_source;

// ---------------------------------------------------------------------------------------
// Hyper-parameters
// ---------------------------------------------------------------------------------------

struct settings {
    std::uint32_t seed = 7;
    int points_per_class = 1000;  // 3000 points, 2400 to train, 600 to test
    int hidden = 64;
    int epochs = 60;
    int batch_size = 64;
    float lr = 0.5f;  // the same for both runs; the best of 0.1, 0.3, 0.5, 1, 2 for plain SGD
};

/// K-FAC's knobs, as a user would set them for this problem (each picked from a few values
/// tried on this data, like the learning rate).
kfac::options kfac_settings(const settings& s) {
    kfac::options o;
    // With a mean loss the output gradients carry a 1/batch factor, so G (and thus λ_G λ_A)
    // is tiny and the damping dominates: without kl_clip the step is about Γ/damping and
    // training diverges. kl_clip rescales every step so that η²·Σ P·Γ stays below 0.001;
    // here it always binds, which makes K-FAC's step length independent of the lr.
    o.kl_clip = 0.001;
    o.lr = s.lr;        // kl_clip's η must be the optimizer's learning rate
    o.damping = 0.003;  // of 0.001, 0.003, 0.01, 0.03, the fastest to 90 % here
    o.factor_decay = 0.95;      // running averages over roughly the last 20 batches
    o.factor_update_steps = 1;  // the statistics cost two small rank-k updates per layer
    o.inv_update_steps = 10;    // the eigendecompositions are the costly part and change slowly
    return o;
}

// ---------------------------------------------------------------------------------------
// Data: three interleaved spirals in the plane
// ---------------------------------------------------------------------------------------

struct dataset {
    matrix x;            // [n, 2]
    std::vector<int> y;  // class of each row, 0..2
};

/// Class c's points lie on an arm that winds 1.5 turns outwards, rotated by c·120°. The arms
/// interleave, so no straight (or nearly straight) boundary separates them.
dataset make_spirals(int per_class, random_source& rng) {
    constexpr int classes = 3;
    constexpr float pi = std::numbers::pi_v<float>;
    dataset d;
    d.x.resize(classes * per_class, 2);
    d.y.resize(static_cast<std::size_t>(classes * per_class));
    for (int c = 0; c < classes; ++c) {
        for (int i = 0; i < per_class; ++i) {
            const float t = (static_cast<float>(i) + 0.5f) / static_cast<float>(per_class);
            const float radius = t + 0.02f * rng.normal();
            const float angle = 2.0f * pi * (static_cast<float>(c) / classes + 1.5f * t) +
                                0.2f * rng.normal();
            const int row = c * per_class + i;
            d.x(row, 0) = radius * std::cos(angle);
            d.x(row, 1) = radius * std::sin(angle);
            d.y[static_cast<std::size_t>(row)] = c;
        }
    }
    return d;
}

/// The rows `rows` of `d`, in that order.
dataset subset(const dataset& d, const std::vector<int>& rows) {
    dataset s;
    s.x.resize(static_cast<Eigen::Index>(rows.size()), d.x.cols());
    s.y.resize(rows.size());
    for (std::size_t i = 0; i < rows.size(); ++i) {
        s.x.row(static_cast<Eigen::Index>(i)) = d.x.row(rows[i]);
        s.y[i] = d.y[static_cast<std::size_t>(rows[i])];
    }
    return s;
}

// ---------------------------------------------------------------------------------------
// The model: the shared Linear layers with tanh between them
// ---------------------------------------------------------------------------------------

/// 2 → hidden → hidden → 3 with tanh between the layers.
struct mlp {
    std::vector<linear_layer> layers;  // built once and never resized (see linear_layer::view)

    mlp(int hidden, random_source& rng) {
        layers.reserve(3);
        layers.emplace_back(2, hidden, rng, 1.0f);  // LeCun normal, for tanh
        layers.emplace_back(hidden, hidden, rng, 1.0f);
        layers.emplace_back(hidden, 3, rng, 1.0f);
    }

    matrix forward(const matrix& x) {
        matrix h = x;
        for (std::size_t i = 0; i + 1 < layers.size(); ++i)
            h = layers[i].forward(h).array().tanh().matrix();
        return layers.back().forward(h);
    }

    void backward(const matrix& grad_logits) {
        matrix g = layers.back().backward(grad_logits);
        for (std::size_t i = layers.size() - 1; i-- > 0;) {
            // The next layer's input is this layer's tanh output h, and tanh' = 1 − h².
            const matrix& h = layers[i + 1].input;
            g = (g.array() * (1.0f - h.array().square())).matrix();
            g = layers[i].backward(g);
        }
    }
};

double test_accuracy(mlp& model, const dataset& d) { return accuracy(model.forward(d.x), d.y); }

// ---------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------

/// One optimizer's run: the model, its optional preconditioner and what it has reached.
struct run {
    std::string name;
    mlp model;
    kfac::KFAC<>* precond = nullptr;  // null: plain SGD
    double seconds = 0.0;             // training time only (evaluation excluded)
    double last_loss = 0.0, last_accuracy = 0.0, best_accuracy = 0.0;
    int best_epoch = 0;
    int epoch_reaching_target = 0;  // first epoch with test accuracy >= target, 0 if none
};

/// One pass over the training set in the given order; returns the mean training loss.
double train_epoch(run& r, const dataset& train, const std::vector<int>& order,
                   const settings& s) {
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0.0;
    int batches = 0;
    matrix xb, grad_logits;
    std::vector<int> yb;
    for (std::size_t first = 0; first < order.size(); first += static_cast<std::size_t>(s.batch_size)) {
        const std::size_t count = std::min(order.size() - first, static_cast<std::size_t>(s.batch_size));
        xb.resize(static_cast<Eigen::Index>(count), train.x.cols());
        yb.resize(count);
        for (std::size_t i = 0; i < count; ++i) {
            const int row = order[first + i];
            xb.row(static_cast<Eigen::Index>(i)) = train.x.row(row);
            yb[i] = train.y[static_cast<std::size_t>(row)];
        }
        const matrix logits = r.model.forward(xb);
        loss_sum += cross_entropy(logits, yb, &grad_logits);
        ++batches;
        r.model.backward(grad_logits);
        if (r.precond) {
            for (auto& layer : r.model.layers) layer.point_views();
            r.precond->step();  // replaces grad_weight and grad_bias in place
        }
        for (auto& layer : r.model.layers) layer.sgd_update(s.lr);
    }
    r.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return loss_sum / batches;
}

}  // namespace

int main() {
    try {
        const settings s;
        constexpr double target = 0.90;  // test accuracy whose first epoch is reported

        random_source rng(s.seed);
        const dataset all = make_spirals(s.points_per_class, rng);
        std::vector<int> rows(static_cast<std::size_t>(all.x.rows()));
        for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int>(i);
        rng.shuffle(rows);
        const std::size_t n_train = rows.size() * 4 / 5;
        const dataset train = subset(all, {rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(n_train)});
        const dataset test = subset(all, {rows.begin() + static_cast<std::ptrdiff_t>(n_train), rows.end()});

        // The same initial weights for both runs: the second model is a copy of the first.
        const mlp initial(s.hidden, rng);
        run sgd{"SGD", initial};
        run kf{"SGD + K-FAC", initial};

        const kfac::options opts = kfac_settings(s);
        kfac::KFAC<> precond(opts);
        precond.register_layer("fc1", kf.model.layers[0].view);
        precond.register_layer("fc2", kf.model.layers[1].view);
        precond.register_layer("fc3", kf.model.layers[2].view);
        precond.on_non_finite([](const kfac::non_finite_event& e) {
            std::fprintf(stderr, "kfac: non-finite values in layer %s at step %lld (contained)\n",
                         e.layer.c_str(), static_cast<long long>(e.step));
        });
        kf.precond = &precond;

        std::printf("three spirals: %zu training and %zu test points; MLP 2-%d-%d-3 (tanh)\n",
                    train.y.size(), test.y.size(), s.hidden, s.hidden);
        std::printf("batch %d, lr %g for both; K-FAC: damping %g, kl_clip %g, factor decay %g, "
                    "eigendecompositions every %lld steps\n\n",
                    s.batch_size, static_cast<double>(s.lr), opts.damping(0), opts.kl_clip(0).value_or(0.0),
                    opts.factor_decay(0), static_cast<long long>(opts.inv_update_steps(0)));
        std::printf("epoch |          SGD                  |        SGD + K-FAC\n");
        std::printf("      | train loss  test acc   time   | train loss  test acc   time\n");

        std::vector<int> order(train.y.size());
        for (int epoch = 1; epoch <= s.epochs; ++epoch) {
            // Both runs see the batches in the same order.
            for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
            rng.shuffle(order);
            for (run* r : {&sgd, &kf}) {
                r->last_loss = train_epoch(*r, train, order, s);
                r->last_accuracy = test_accuracy(r->model, test);
                if (r->last_accuracy > r->best_accuracy) {
                    r->best_accuracy = r->last_accuracy;
                    r->best_epoch = epoch;
                }
                if (r->epoch_reaching_target == 0 && r->last_accuracy >= target)
                    r->epoch_reaching_target = epoch;
                if (!std::isfinite(r->last_loss)) {
                    std::fprintf(stderr, "%s diverged at epoch %d\n", r->name.c_str(), epoch);
                    return 1;
                }
            }
            std::printf("%5d |   %.4f     %5.1f%%  %6.2fs  |   %.4f     %5.1f%%  %6.2fs\n", epoch,
                        sgd.last_loss, 100.0 * sgd.last_accuracy, sgd.seconds, kf.last_loss,
                        100.0 * kf.last_accuracy, kf.seconds);
        }

        std::printf("\nafter %d epochs (%lld steps each):\n", s.epochs,
                    static_cast<long long>(precond.steps()));
        for (const run* r : {&sgd, &kf}) {
            std::printf("  %-12s test accuracy %5.1f%% (best %5.1f%% at epoch %2d), train loss %.4f, "
                        "%.2f s, ",
                        r->name.c_str(), 100.0 * r->last_accuracy, 100.0 * r->best_accuracy,
                        r->best_epoch, r->last_loss, r->seconds);
            if (r->epoch_reaching_target)
                std::printf("first reached %.0f%% at epoch %d\n", 100.0 * target, r->epoch_reaching_target);
            else
                std::printf("never reached %.0f%%\n", 100.0 * target);
        }
        // The honest trade: fewer epochs, but each K-FAC step costs more than an SGD step on a
        // network this small (the factor work is fixed per layer, the forward pass is tiny).
        std::printf("  a training step with K-FAC took %.1fx as long as a plain SGD step\n",
                    kf.seconds / sgd.seconds);
        const auto& h = precond.health();
        std::printf("K-FAC: last kl_clip scale %.3g; contained non-finite events: %lld statistics, "
                    "%lld decompositions, %lld gradients\n",
                    precond.last_kl_scale(), static_cast<long long>(h.skipped_factor_updates),
                    static_cast<long long>(h.kept_decompositions),
                    static_cast<long long>(h.zeroed_gradients));
        return 0;
    } catch (const std::exception& e) {  // kfac::error names the layer and the fix
        std::fprintf(stderr, "quickstart: %s\n", e.what());
        return 1;
    }
}
