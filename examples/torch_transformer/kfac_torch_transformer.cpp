// SPDX-License-Identifier: Apache-2.0
// kfac_torch_transformer: a small LibTorch transformer encoder learns to reverse sequences of
// tokens, once with SGD with momentum and once, from the same initial weights and batches, with
// SGD with momentum on K-FAC preconditioned gradients. Every layer with parameters is
// preconditioned: the token and position Embeddings, the attention's query/key/value/output
// Linears, the feed-forward Linears, the LayerNorms and the output head.
//
// The model is ordinary LibTorch code (pre-LayerNorm encoder blocks, Vaswani et al. 2017 with
// the normalisation first, as GPT-2 places it); attention is written with nn::Linear projections
// because nn::MultiheadAttention keeps its input projection as a bare parameter, which no K-FAC
// block describes. The loss has a term per token, so every Linear shares its weight over the
// tokens as K-FAC-expand (Eschenhagen et al., NeurIPS 2023): the library's default.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <kfac/kfac.hpp>
#include <kfac/layers/torch.hpp>

#include "cli.hpp"
#include "kfac_handle.hpp"

namespace {

namespace nn = torch::nn;
namespace F = torch::nn::functional;

struct settings {
    std::int64_t vocabulary = 16;
    std::int64_t length = 16;
    std::int64_t width = 32;
    std::int64_t heads = 4;
    std::int64_t blocks = 2;
    int steps = 300;
    int batch = 64;
    int report_every = 25;
    double lr = 0.4;       // plain SGD: the best of {0.05, 0.1, 0.2, 0.4} on seeds 1-2
    double kfac_lr = 0.1;  // SGD on K-FAC preconditioned gradients, from the same grid
    double momentum = 0.9;
    double damping = 0.01;
    double kl_clip = 0.001;
    int inv_update_steps = 10;
    std::uint64_t seed = 1;
    int threads = 1;
    std::vector<std::string> skip;  // options.skip_layers
    std::optional<double> expect_accuracy;
    std::string device = "cpu";  // cuda: both runs on the GPU, K-FAC on backend::cuda
};

/// Multi-head self-attention with four nn::Linear projections.
struct attention_impl : nn::Module {
    nn::Linear query{nullptr}, key{nullptr}, value{nullptr}, output{nullptr};
    std::int64_t heads;

    attention_impl(std::int64_t width, std::int64_t heads_) : heads(heads_) {
        query = register_module("query", nn::Linear(width, width));
        key = register_module("key", nn::Linear(width, width));
        value = register_module("value", nn::Linear(width, width));
        output = register_module("output", nn::Linear(width, width));
    }

    torch::Tensor forward(const torch::Tensor& x) {  // [N, T, D]
        const auto n = x.size(0), t = x.size(1), d = x.size(2), head_width = d / heads;
        auto split = [&](const torch::Tensor& y) { return y.view({n, t, heads, head_width}).transpose(1, 2); };
        const auto q = split(query(x)), k = split(key(x)), v = split(value(x));
        const auto weights = torch::softmax(torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(head_width)), -1);
        return output(torch::matmul(weights, v).transpose(1, 2).reshape({n, t, d}));
    }
};
TORCH_MODULE_IMPL(attention, attention_impl);

/// x + attention(LN(x)), then x + FF(LN(x)) with a GELU feed-forward of 2·width.
struct encoder_block_impl : nn::Module {
    nn::LayerNorm norm1{nullptr}, norm2{nullptr};
    attention attend{nullptr};
    nn::Linear expand{nullptr}, contract{nullptr};

    encoder_block_impl(std::int64_t width, std::int64_t heads) {
        norm1 = register_module("norm1", nn::LayerNorm(nn::LayerNormOptions({width})));
        attend = register_module("attention", attention(width, heads));
        norm2 = register_module("norm2", nn::LayerNorm(nn::LayerNormOptions({width})));
        expand = register_module("expand", nn::Linear(width, 2 * width));
        contract = register_module("contract", nn::Linear(2 * width, width));
    }

    torch::Tensor forward(torch::Tensor x) {
        x = x + attend(norm1(x));
        return x + contract(torch::gelu(expand(norm2(x))));
    }
};
TORCH_MODULE_IMPL(encoder_block, encoder_block_impl);

/// Token and learned position embeddings, encoder blocks, a final LayerNorm and a Linear head
/// giving each position's logits over the vocabulary.
struct transformer_impl : nn::Module {
    nn::Embedding tokens{nullptr}, positions{nullptr};
    std::vector<encoder_block> blocks;
    nn::LayerNorm norm{nullptr};
    nn::Linear head{nullptr};

    explicit transformer_impl(const settings& s) {
        tokens = register_module("tokens", nn::Embedding(s.vocabulary, s.width));
        positions = register_module("positions", nn::Embedding(s.length, s.width));
        for (std::int64_t b = 0; b < s.blocks; ++b)
            blocks.push_back(register_module("block" + std::to_string(b), encoder_block(s.width, s.heads)));
        norm = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({s.width})));
        head = register_module("head", nn::Linear(s.width, s.vocabulary));
    }

    torch::Tensor forward(const torch::Tensor& ids) {  // [N, T] → [N, T, V]
        auto x = tokens(ids) + positions(torch::arange(ids.size(1), torch::TensorOptions(torch::kLong).device(ids.device())));
        for (auto& b : blocks) x = b(x);
        return head(norm(x));
    }
};
TORCH_MODULE_IMPL(transformer, transformer_impl);

/// Sequences of random tokens and their reversals.
struct sequences {
    torch::Tensor inputs, targets;  // [N, T] int64 each
};

sequences make_sequences(std::int64_t count, const settings& s, torch::Generator& gen) {
    const auto x = torch::randint(0, s.vocabulary, {count, s.length}, gen, torch::kLong).to(torch::Device(s.device));
    return {x, x.flip({1})};
}

struct report_row {
    int step;
    double train_loss, token_accuracy, sequence_accuracy, seconds;
};

/// Token accuracy and whole-sequence accuracy on `test`.
std::pair<double, double> accuracy(transformer& model, const sequences& test) {
    torch::NoGradGuard no_grad;  // not captured by the tracker
    const auto right = model->forward(test.inputs).argmax(-1).eq(test.targets);
    return {right.to(torch::kDouble).mean().item<double>(), right.all(1).to(torch::kDouble).mean().item<double>()};
}

/// The learning rate of step k of `steps`: lr0 on a cosine from 1 to 0 (both runs).
double cosine_lr(double lr0, std::int64_t k, std::int64_t steps) {
    return 0.5 * lr0 * (1.0 + std::cos(3.14159265358979323846 * double(k) / double(steps)));
}

/// s.steps steps on fresh batches drawn from a generator seeded with s.seed (the same batches
/// for both runs); with `precond`, the gradients are preconditioned before the optimizer's step.
std::vector<report_row> train(transformer& model, const sequences& test, const settings& s,
                              kfac_examples::kfac_handle* precond) {
    const double lr0 = precond ? s.kfac_lr : s.lr;
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(lr0).momentum(s.momentum));
    auto gen = torch::make_generator<at::CPUGeneratorImpl>(s.seed + 1);
    std::vector<report_row> rows;
    double loss_sum = 0.0, seconds = 0.0;
    for (int step = 1; step <= s.steps; ++step) {
        const auto batch = make_sequences(s.batch, s, gen);
        const auto start = std::chrono::steady_clock::now();
        model->train();
        for (auto& group : optimizer.param_groups())
            static_cast<torch::optim::SGDOptions&>(group.options()).lr(cosine_lr(lr0, step - 1, s.steps));
        optimizer.zero_grad();
        const auto logits = model->forward(batch.inputs);
        const auto loss = F::cross_entropy(logits.flatten(0, 1), batch.targets.flatten());  // a term per token
        loss.backward();
        if (precond) precond->step();  // every registered .grad() is now preconditioned
        optimizer.step();
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        loss_sum += loss.item<double>();
        if (!std::isfinite(loss_sum)) break;
        if (step % s.report_every == 0 || step == s.steps) {
            model->eval();
            const auto [tokens, whole] = accuracy(model, test);
            const int since = step % s.report_every == 0 ? s.report_every : step % s.report_every;
            rows.push_back({step, loss_sum / since, tokens, whole, seconds});
            loss_sum = 0.0;
        }
    }
    return rows;
}

void usage() {
    std::printf(
        "usage: kfac_torch_transformer [options]\n"
        "Trains a small LibTorch transformer encoder to reverse token sequences with SGD+momentum and\n"
        "with SGD+momentum on K-FAC preconditioned gradients (every Embedding, Linear and LayerNorm).\n\n"
        "  --steps N              training steps, a fresh batch each (default 300)\n"
        "  --batch N              sequences per batch (default 64)\n"
        "  --report-every N       steps between the rows of the table (default 25)\n"
        "  --vocabulary N         tokens (default 16)\n"
        "  --length N             sequence length (default 16)\n"
        "  --width N              model width (default 32; a multiple of --heads)\n"
        "  --heads N              attention heads (default 4)\n"
        "  --blocks N             encoder blocks (default 2)\n"
        "  --lr X                 plain SGD's initial learning rate (default 0.4; cosine schedule)\n"
        "  --kfac-lr X            initial learning rate with K-FAC (default 0.1; cosine schedule)\n"
        "  --momentum X           momentum of both runs (default 0.9)\n"
        "  --damping X            K-FAC damping (default 0.01)\n"
        "  --kl-clip X            K-FAC kl_clip (default 0.001)\n"
        "  --inv-update-steps N   steps between eigendecompositions (default 10)\n"
        "  --threads N            LibTorch and K-FAC threads (default 1)\n"
        "  --device cpu|cuda      where both runs train; cuda: K-FAC on backend::cuda (a LibTorch with\n"
        "                         CUDA and a build with nvcc)\n"
        "  --skip REGEX           leave the layers it matches to plain SGD (names such as\n"
        "                         block0.attention.query, kinds such as LayerNorm or Embedding)\n"
        "  --seed N               initial weights and batches (default 1)\n"
        "  --expect-accuracy X    exit 1 unless K-FAC's final test token accuracy is >= X (for tests)\n"
        "exit status: 0 done, 1 error or expectation not met, 2 usage\n");
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
        s.steps = static_cast<int>(args.integer("steps", s.steps));
        s.batch = static_cast<int>(args.integer("batch", s.batch));
        s.report_every = static_cast<int>(args.integer("report-every", s.report_every));
        s.vocabulary = args.integer("vocabulary", s.vocabulary);
        s.length = args.integer("length", s.length);
        s.width = args.integer("width", s.width);
        s.heads = args.integer("heads", s.heads);
        s.blocks = args.integer("blocks", s.blocks);
        s.lr = args.number("lr", s.lr);
        s.kfac_lr = args.number("kfac-lr", s.kfac_lr);
        s.momentum = args.number("momentum", s.momentum);
        s.damping = args.number("damping", s.damping);
        s.kl_clip = args.number("kl-clip", s.kl_clip);
        s.inv_update_steps = static_cast<int>(args.integer("inv-update-steps", s.inv_update_steps));
        s.threads = static_cast<int>(args.integer("threads", s.threads));
        s.seed = static_cast<std::uint64_t>(args.integer("seed", static_cast<long>(s.seed)));
        if (auto skip = args.text("skip")) s.skip = {*skip};
        s.device = args.text("device", s.device);
        if (s.device != "cpu" && s.device != "cuda")
            throw kfac_examples::cli_error("--device must be cpu or cuda, not '" + s.device + "'");
        if (args.text("expect-accuracy")) s.expect_accuracy = args.number("expect-accuracy", 0.0);
        args.finish();
        if (s.steps < 1 || s.batch < 1 || s.report_every < 1 || s.vocabulary < 2 || s.length < 1 || s.blocks < 0 ||
            s.threads < 1 || s.heads < 1 || s.width < s.heads || s.width % s.heads != 0)
            throw kfac_examples::cli_error("sizes must be positive, --vocabulary at least 2 and --width a multiple "
                                           "of --heads");
    } catch (const kfac_examples::cli_error& e) {
        std::fprintf(stderr, "kfac_torch_transformer: %s\n", e.what());
        return 2;
    }

    if (s.device == "cuda" && !kfac_examples::built_with_cuda) {
        std::fprintf(stderr, "kfac_torch_transformer: --device cuda: this program was built without nvcc (kfac::cuda)\n");
        return 2;
    }
    if (s.device == "cuda" && !torch::cuda::is_available()) {
        std::fprintf(stderr, "kfac_torch_transformer: --device cuda: LibTorch sees no CUDA device (Debian's LibTorch is "
                             "CPU-only; build against a LibTorch with CUDA, docs/gpu.md 'LibTorch on a GPU')\n");
        return 2;
    }
    try {
        torch::set_num_threads(s.threads);
        auto test_gen = torch::make_generator<at::CPUGeneratorImpl>(s.seed + 1000);
        const sequences test = make_sequences(1000, s, test_gen);
        torch::manual_seed(static_cast<std::uint64_t>(s.seed));  // the same initial weights for both runs
        transformer sgd_model(s);
        torch::manual_seed(static_cast<std::uint64_t>(s.seed));
        transformer kfac_model(s);
        sgd_model->to(torch::Device(s.device));
        kfac_model->to(torch::Device(s.device));

        std::printf("Reversing sequences of %lld tokens over a vocabulary of %lld: %lld encoder blocks of width %lld, "
                    "%lld heads; batch %d, %d steps, seed %llu\n",
                    static_cast<long long>(s.length), static_cast<long long>(s.vocabulary),
                    static_cast<long long>(s.blocks), static_cast<long long>(s.width), static_cast<long long>(s.heads),
                    s.batch, s.steps, static_cast<unsigned long long>(s.seed));
        std::printf("SGD: lr %g, momentum %g; SGD + K-FAC: lr %g, momentum %g, damping %g, kl_clip %g, "
                    "eigendecompositions every %d steps; both with a cosine learning-rate schedule\n\n",
                    s.lr, s.momentum, s.kfac_lr, s.momentum, s.damping, s.kl_clip, s.inv_update_steps);

        std::vector<report_row> sgd = train(sgd_model, test, s, nullptr);
        std::vector<report_row> kfac_run;
        {
            kfac::options opts;
            const double lr0 = s.kfac_lr;  // kl_clip uses the optimizer's learning rate
            const std::int64_t steps = s.steps;
            opts.lr = [lr0, steps](std::int64_t k) { return cosine_lr(lr0, k, steps); };
            opts.damping = s.damping;
            opts.kl_clip = s.kl_clip;
            opts.inv_update_steps = s.inv_update_steps;
            opts.threads = s.threads;
            opts.skip_layers = s.skip;
            // Created only now: while a tracker lives, every operator on this thread passes
            // through its observer, and the SGD run above should not pay for that.
            kfac::torch::tracker<float> tracker;
            auto precond = kfac_examples::make_kfac(opts, s.device == "cuda");
            // kfac's layer tasks run with one BLAS thread each; a BLAS call on several threads
            // would leave OpenBLAS's workers spinning against LibTorch's (a step took 7.6x SGD's
            // instead of 2x on 2 cores).
            const kfac::KFAC<>::backend_type::serial_blas_scope one_blas_thread;
            const auto registered = kfac::torch::register_modules(*precond, tracker, kfac_model);
            std::printf("%s (on kfac::backend::%s)\n\n", registered.summary().c_str(), precond->backend_name().c_str());
            kfac_run = train(kfac_model, test, s, precond.get());
        }

        std::printf(" step |              SGD                      |           SGD + K-FAC\n");
        std::printf("      | train loss  token acc  seq acc  time  | train loss  token acc  seq acc  time\n");
        const std::size_t rows = std::max(sgd.size(), kfac_run.size());
        for (std::size_t r = 0; r < rows; ++r) {
            std::printf("%5d |", (r < sgd.size() ? sgd : kfac_run)[r].step);
            for (const auto* run : {&sgd, &kfac_run}) {
                if (r < run->size()) {
                    const auto& row = (*run)[r];
                    std::printf("   %6.4f     %5.1f%%   %5.1f%%  %5.1fs |", row.train_loss, 100.0 * row.token_accuracy,
                                100.0 * row.sequence_accuracy, row.seconds);
                } else {
                    std::printf("   %-36s|", "(diverged)");
                }
            }
            std::printf("\n");
        }
        if (kfac_run.empty() || kfac_run.back().step != s.steps) {
            std::fprintf(stderr, "kfac_torch_transformer: K-FAC diverged; lower --kfac-lr or raise --damping\n");
            return 1;
        }
        const double final_accuracy = kfac_run.back().token_accuracy;
        if (s.expect_accuracy && !(final_accuracy >= *s.expect_accuracy)) {
            std::fprintf(stderr, "kfac_torch_transformer: FAILED: K-FAC's final test token accuracy %.4f is below "
                                 "--expect-accuracy %.4f\n",
                         final_accuracy, *s.expect_accuracy);
            return 1;
        }
        return 0;
    } catch (const std::exception& e) {  // kfac::error names the layer and the fix
        std::fprintf(stderr, "kfac_torch_transformer: %s\n", e.what());
        return 1;
    }
}
