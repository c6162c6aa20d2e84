// SPDX-License-Identifier: Apache-2.0
// kfac_digits: trains the same MLP on the UCI handwritten digits twice, with the same initial
// weights and the same batch order: once with SGD with momentum, once with SGD with momentum on
// K-FAC preconditioned gradients. It prints both side by side per epoch, writes a CSV and
// plots it (test accuracy against epochs and against wall time) with plot_digits.py.
//
// The network and its forward/backward pass are plain Eigen (../common/eigen_mlp.hpp); kfac
// only sees each Linear layer through a kfac::layer_view<float>.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <kfac/kfac.hpp>

#include "cli.hpp"
#include "digits_dataset.hpp"
#include "digits_training.hpp"
#include "eigen_mlp.hpp"
#include "progress_bar.hpp"
#include "run_plot.hpp"

namespace {

using namespace kfac_examples;
namespace fs = std::filesystem;

constexpr int exit_skip = 77;  // the data set is missing (CTest's SKIP_RETURN_CODE)

/// One optimizer's run: its model, its optional preconditioner and what it reached.
struct run {
    std::string name;  // also the CSV's optimizer column
    mlp model;
    float lr = 0.0f, momentum = 0.0f;
    kfac::KFAC<>* precond = nullptr;  // null: plain SGD
    double seconds = 0.0;             // training time only, evaluation excluded
    double loss = 0.0, accuracy = 0.0;
    int epoch_reaching_target = 0;    // first epoch with test accuracy >= target, 0 if none
    double seconds_reaching_target = 0.0;
};

struct evaluation {
    double loss, accuracy;
};

evaluation evaluate(mlp& model, const matrix& x, const std::vector<int>& y) {
    const matrix logits = model.forward(x);
    return {cross_entropy(logits, y, nullptr), accuracy(logits, y)};
}

/// One pass over the training set in the given order; returns the mean minibatch loss.
double train_epoch(run& r, const digits::dataset& train, const std::vector<std::size_t>& order, int batch,
                   progress_bar& bar, int epoch, int epochs) {
    const auto start = std::chrono::steady_clock::now();
    const std::size_t steps = (order.size() + static_cast<std::size_t>(batch) - 1) / static_cast<std::size_t>(batch);
    double loss_sum = 0.0;
    matrix xb, grad_logits;
    std::vector<int> yb;
    for (std::size_t step = 0; step < steps; ++step) {
        const std::size_t first = step * static_cast<std::size_t>(batch);
        const std::size_t count = std::min(order.size() - first, static_cast<std::size_t>(batch));
        gather_batch(train.images, train.labels, digits::pixels, order, first, count, xb, yb);
        loss_sum += cross_entropy(r.model.forward(xb), yb, &grad_logits);
        r.model.backward(grad_logits);
        if (r.precond) {
            r.model.point_views();
            r.precond->step();  // replaces grad_weight and grad_bias in place
        }
        r.model.sgd_momentum_update(r.lr, r.momentum);
        bar.draw(epoch, epochs, r.name, step + 1, steps);
    }
    r.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return loss_sum / static_cast<double>(steps);
}

void usage() {
    std::printf(
        "usage: kfac_digits [options]\n"
        "Trains an MLP on the UCI digits with SGD+momentum and with SGD+momentum+K-FAC from the same\n"
        "initial weights and batch order; prints a table, writes a CSV and a PNG plot.\n\n%s"
        "  --csv PATH             per-epoch results (default kfac_digits.csv)\n"
        "  --plot PATH            the plot (default: the CSV's path with .png)\n"
        "  --no-plot              do not run plot_digits.py\n"
        "  --target X             test accuracy whose first epoch is reported (default 0.95)\n"
        "  --expect-accuracy X    exit 1 unless K-FAC's final test accuracy is >= X (for tests)\n"
        "exit status: 0 done, 1 error or expectation not met, 2 usage, 77 data set not found\n",
        digits_settings_usage);
}

}  // namespace

int main(int argc, char** argv) {
    digits_settings s;
    fs::path csv_path, png_path;
    bool want_plot = true;
    double target = 0.95;
    std::optional<double> expect_accuracy;
    try {
        cli args(argc, argv, {"help", "no-plot"});
        if (args.flag("help")) {
            usage();
            return 0;
        }
        s = read_digits_settings(args);
        csv_path = args.text("csv", "kfac_digits.csv");
        png_path = args.text("plot", fs::path(csv_path).replace_extension(".png").string());
        want_plot = !args.flag("no-plot");
        target = args.number("target", target);
        if (args.text("expect-accuracy")) expect_accuracy = args.number("expect-accuracy", 0.0);
        args.finish();
    } catch (const cli_error& e) {
        std::fprintf(stderr, "kfac_digits: %s\n", e.what());
        return 2;
    }

    try {
        const fs::path data_path = s.data.empty() ? digits::default_digits_path() : s.data;
        digits::dataset all;
        try {
            all = digits::load(data_path);
        } catch (const digits::dataset_missing& e) {
            std::fprintf(stderr, "kfac_digits: %s\n", e.what());
            return exit_skip;
        }
        const auto [train, test] = digits::train_test_split(all, s.seed);
        const matrix train_x = as_matrix(train.images, digits::pixels);
        const matrix test_x = as_matrix(test.images, digits::pixels);

        // The same initial weights for both runs: both models are copies of one.
        random_source rng(s.seed);
        const mlp initial(s.widths, rng);
        run sgd{"SGD", initial, s.lr, s.momentum};
        run kf{"SGD+K-FAC", initial, s.kfac_lr, s.kfac_momentum};

        const kfac::options opts = digits_kfac_options(s);
        // One core for both runs: with --threads 1, BLAS inside kfac is single-threaded too
        // (OpenBLAS would otherwise spin up every core for these tiny matrices, and spin-wait
        // badly when the machine is busy).
        std::optional<kfac::KFAC<>::backend_type::serial_blas_scope> one_blas_thread;
        if (s.threads == 1) one_blas_thread.emplace();
        kfac::KFAC<> precond(opts);
        register_mlp(precond, kf.model);
        precond.on_non_finite([](const kfac::non_finite_event& e) {
            std::fprintf(stderr, "kfac: non-finite values in layer %s at step %lld (contained)\n",
                         e.layer.c_str(), static_cast<long long>(e.step));
        });
        kf.precond = &precond;

        std::printf("UCI digits (%s): %zu training and %zu test images; MLP %s (ReLU), batch %d, seed %u\n",
                    data_path.c_str(), train.size(), test.size(), initial.shape().c_str(), s.batch, s.seed);
        std::printf("SGD:       lr %g, momentum %g\n", static_cast<double>(s.lr), static_cast<double>(s.momentum));
        std::printf("SGD+K-FAC: lr %g, momentum %g; damping %g, kl_clip %g, factor decay %g, factors every %d "
                    "and eigendecompositions every %d steps\n\n",
                    static_cast<double>(s.kfac_lr), static_cast<double>(s.kfac_momentum), s.damping, s.kl_clip,
                    s.factor_decay, s.factor_update_steps, s.inv_update_steps);
        std::printf("epoch |            SGD               |          SGD+K-FAC\n");
        std::printf("      | train loss  test acc   time  | train loss  test acc   time\n");

        std::ofstream csv(csv_path);
        if (!csv) throw std::runtime_error("cannot write " + csv_path.string());
        csv << "optimizer,epoch,train_loss,test_accuracy,wall_seconds\n";
        const auto write_row = [&](const run& r, int epoch) {
            char line[160];
            std::snprintf(line, sizeof line, "%s,%d,%.6f,%.6f,%.6f\n", r.name.c_str(), epoch, r.loss, r.accuracy,
                          r.seconds);
            csv << line;
        };
        // Epoch 0: the initial model, its loss over the whole training set.
        for (run* r : {&sgd, &kf}) {
            r->loss = evaluate(r->model, train_x, train.labels).loss;
            r->accuracy = evaluate(r->model, test_x, test.labels).accuracy;
            write_row(*r, 0);
        }

        progress_bar bar;
        std::vector<std::size_t> order = iota_order(train.size());
        for (int epoch = 1; epoch <= s.epochs; ++epoch) {
            rng.shuffle(order);  // both runs see the batches in the same order
            for (run* r : {&sgd, &kf}) {
                r->loss = train_epoch(*r, train, order, s.batch, bar, epoch, s.epochs);
                r->accuracy = evaluate(r->model, test_x, test.labels).accuracy;
                if (r->epoch_reaching_target == 0 && r->accuracy >= target) {
                    r->epoch_reaching_target = epoch;
                    r->seconds_reaching_target = r->seconds;
                }
                write_row(*r, epoch);
            }
            bar.clear();
            std::printf("%5d |   %.4f     %5.1f%%  %6.2fs  |   %.4f     %5.1f%%  %6.2fs\n", epoch, sgd.loss,
                        100.0 * sgd.accuracy, sgd.seconds, kf.loss, 100.0 * kf.accuracy, kf.seconds);
            std::fflush(stdout);
            for (const run* r : {&sgd, &kf}) {
                if (!std::isfinite(r->loss)) {
                    std::fprintf(stderr, "kfac_digits: %s diverged at epoch %d (loss %g); lower its learning rate\n",
                                 r->name.c_str(), epoch, r->loss);
                    return 1;
                }
            }
        }
        csv.close();
        if (!csv) throw std::runtime_error("error while writing " + csv_path.string());

        std::printf("\nsummary after %d epochs (%lld steps each):\n", s.epochs, static_cast<long long>(precond.steps()));
        for (const run* r : {&sgd, &kf}) {
            std::printf("  %-10s final test accuracy %5.1f%%, ", r->name.c_str(), 100.0 * r->accuracy);
            if (r->epoch_reaching_target)
                std::printf("%.0f%% first reached at epoch %d (%.2f s), ", 100.0 * target, r->epoch_reaching_target,
                            r->seconds_reaching_target);
            else
                std::printf("never reached %.0f%%, ", 100.0 * target);
            std::printf("%.3f s per epoch\n", r->seconds / s.epochs);
        }
        std::printf("  an epoch with K-FAC took %.1fx as long as one with plain SGD\n", kf.seconds / sgd.seconds);
        const auto& h = precond.health();
        std::printf("  K-FAC: last kl_clip scale %.3g; contained non-finite events: %lld statistics, %lld "
                    "decompositions, %lld gradients\n",
                    precond.last_kl_scale(), static_cast<long long>(h.skipped_factor_updates),
                    static_cast<long long>(h.kept_decompositions), static_cast<long long>(h.zeroed_gradients));
        std::printf("csv: %s\n", csv_path.c_str());
        if (want_plot) {
#ifdef KFAC_DIGITS_SOURCE_DIR
            run_plot("plot_digits.py", KFAC_DIGITS_SOURCE_DIR, csv_path, png_path);
#else
            run_plot("plot_digits.py", "", csv_path, png_path);
#endif
        }

        if (expect_accuracy && !(kf.accuracy >= *expect_accuracy)) {
            std::fprintf(stderr, "kfac_digits: FAILED: K-FAC's final test accuracy %.4f is below --expect-accuracy %.4f\n",
                         kf.accuracy, *expect_accuracy);
            return 1;
        }
        return 0;
    } catch (const std::exception& e) {  // kfac::error names the layer and the fix
        std::fprintf(stderr, "kfac_digits: %s\n", e.what());
        return 1;
    }
}
