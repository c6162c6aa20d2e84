// SPDX-License-Identifier: Apache-2.0
// kfac_fashion_mnist: the flagship. A LibTorch model (a small CNN or a ResNet-8) trained on
// Fashion-MNIST with SGD with momentum, and again from the same initial weights and batch
// order with SGD with momentum on K-FAC preconditioned gradients (kfac/layers/torch.hpp). A
// cosine learning-rate schedule, a progress bar, a per-epoch CSV, a plot of test accuracy
// against epochs and against wall time, and one summary line per optimizer:
//
//   summary optimizer=kfac model=cnn epochs=4 test_accuracy=0.9123 seconds=98.7
//
// The same program under two more names (links the build makes beside it), data-parallel:
// kfac_fashion_mnist_mpi over MPI ranks (when built with MPI, KFAC_EXAMPLE_MPI),
// `mpiexec -n 2 kfac_fashion_mnist_mpi --strategy hybrid_opt`; and kfac_fashion_mnist_gloo over
// a LibTorch Gloo process group (KFAC_EXAMPLE_GLOO), the gradients averaged and K-FAC
// distributed over the same group, its ranks started as torch's launchers start them or by
// mpiexec (examples/common/gloo_world.hpp). The name it is started under picks the transport
// (one program rather than three builds of it: LibTorch's headers make each build long).
// Each rank takes a slice of every minibatch; its loss is the mean over its slice (what
// per-example statistics assume) and its gradients, weighted by the slice's share, sum over
// the ranks to the minibatch's mean loss's, so the gradients and the K-FAC factors averaged
// over the ranks are those of one process (BatchNorm's batch statistics excepted: each rank
// normalizes its own slice).
//
// K-FAC runs with the curvature modes per-example statistics and bias-corrected averaging, and
// a KL clip annealed with the learning rate (--reference: kfac-pytorch's K-FAC); after every
// K-FAC epoch it prints each layer's curvature share and writes the curvature report's CSV.
//
// Checkpoints (--checkpoint DIR, after every epoch; --resume DIR): the model and the
// optimizer through torch::save, K-FAC's state through its checkpoint API (precond.save), and
// the run's progress (epoch, training seconds, the CSV rows so far).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>  // dlsym
#if defined(__GLIBC__)
#include <malloc.h>  // mallopt
#endif

#include <torch/torch.h>

#include <kfac/kfac.hpp>
#include <kfac/layers/torch.hpp>

#ifdef KFAC_EXAMPLE_MPI
#include <mpi.h>

#include <kfac/comm/mpi.hpp>
#endif
#ifdef KFAC_EXAMPLE_GLOO
#include "gloo_world.hpp"
#endif

#include "cli.hpp"
#include "fashion_mnist_dataset.hpp"
#include "kfac_handle.hpp"
#include "mixed_precision.hpp"
#include "models.hpp"
#include "progress_bar.hpp"
#include "run_plot.hpp"

namespace {

using namespace kfac_examples;
namespace fs = std::filesystem;
namespace F = torch::nn::functional;

constexpr int exit_skip = 77;  // the data set is missing (CTest's SKIP_RETURN_CODE)

/// How this process reaches the others: alone, over MPI or over a Gloo process group, by the
/// name it was started under (kfac_fashion_mnist, kfac_fashion_mnist_mpi,
/// kfac_fashion_mnist_gloo; the latter two only in builds with MPI or LibTorch's Gloo).
enum class transport { single, mpi, gloo };

const char* program = "kfac_fashion_mnist";  // the name it was started under, for messages

transport transport_of(const std::string& name) {
#ifdef KFAC_EXAMPLE_MPI
    if (name.ends_with("_mpi")) return transport::mpi;
#endif
#ifdef KFAC_EXAMPLE_GLOO
    if (name.ends_with("_gloo")) return transport::gloo;
#endif
    (void)name;  // (a build with neither)
    return transport::single;
}

using cpu_backend = kfac::backend::cpu_eigen<float>;

// ---------------------------------------------------------------------------------------
// The processes of a run: one, or the MPI ranks or Gloo processes of a data-parallel run.

struct processes {
    int rank = 0, size = 1;
    explicit processes(transport t) : how(t) {
#ifdef KFAC_EXAMPLE_GLOO
        if (how == transport::gloo) {
            world.emplace(join_gloo_world());
            gloo_comm.emplace(world->kfac_comm());
            rank = world->pg->getRank();
            size = world->pg->getSize();
        }
#endif
#ifdef KFAC_EXAMPLE_MPI
        if (how == transport::mpi) {
            MPI_Comm_rank(MPI_COMM_WORLD, &rank);
            MPI_Comm_size(MPI_COMM_WORLD, &size);
            mpi_comm.emplace();
        }
#endif
    }
    [[nodiscard]] bool distributed() const { return how != transport::single; }
    [[nodiscard]] bool leader() const { return rank == 0; }

    void sum(std::vector<double>& v) const {
#ifdef KFAC_EXAMPLE_GLOO
        if (how == transport::gloo)
            sum_tensor(torch::from_blob(v.data(), {static_cast<std::int64_t>(v.size())}, torch::kDouble));
#endif
#ifdef KFAC_EXAMPLE_MPI
        if (how == transport::mpi)
            MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
#endif
        (void)v;
    }
    void sum(float* v, std::size_t n) const {
#ifdef KFAC_EXAMPLE_GLOO
        if (how == transport::gloo) sum_tensor(torch::from_blob(v, {static_cast<std::int64_t>(n)}, torch::kFloat));
#endif
#ifdef KFAC_EXAMPLE_MPI
        if (how == transport::mpi) MPI_Allreduce(MPI_IN_PLACE, v, static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
#endif
        (void)v, (void)n;
    }
    /// The first failure on any rank, on every rank (none waits for a failed one).
    std::optional<std::string> agree(std::optional<std::string> failure) const {
#ifdef KFAC_EXAMPLE_GLOO
        if (how == transport::gloo) return gloo_comm->agree(failure);
#endif
#ifdef KFAC_EXAMPLE_MPI
        if (how == transport::mpi) return mpi_comm->agree(failure);
#endif
        return failure;
    }
    /// A preconditioner on the CPU backend, with the compute method Method, whose policy spans
    /// these processes (over a Gloo world, the same process group as the gradients' averaging).
    template <class Method>
    [[nodiscard]] std::unique_ptr<kfac_handle> cpu_preconditioner(const kfac::options& opts) const {
#ifdef KFAC_EXAMPLE_GLOO
        if (how == transport::gloo)
            return std::make_unique<held_kfac<kfac::KFAC<cpu_backend, kfac::comm::process_group, Method>>>(
                "cpu_eigen<float>", opts, world->kfac_comm());
#endif
#ifdef KFAC_EXAMPLE_MPI
        if (how == transport::mpi)
            return std::make_unique<held_kfac<kfac::KFAC<cpu_backend, kfac::comm::mpi, Method>>>(
                "cpu_eigen<float>", opts, kfac::comm::mpi());
#endif
        return make_cpu_kfac<Method>(opts);
    }

private:
    transport how;
#ifdef KFAC_EXAMPLE_GLOO
    void sum_tensor(const torch::Tensor& t) const {
        std::vector<torch::Tensor> tensors{t};
        world->pg->allreduce(tensors)->wait();
    }
    std::optional<gloo_world> world;
    mutable std::optional<kfac::comm::process_group> gloo_comm;
#endif
#ifdef KFAC_EXAMPLE_MPI
    mutable std::optional<kfac::comm::mpi> mpi_comm;
#endif
};

/// Runs `work` on every rank and raises the first failure on all of them.
template <class Work>
void on_every_rank(const processes& procs, Work&& work) {
    std::optional<std::string> failure;
    try {
        work();
    } catch (const std::exception& e) {
        failure = e.what();
    }
    if (auto agreed = procs.agree(failure)) throw std::runtime_error(*agreed);
}

// ---------------------------------------------------------------------------------------
// Settings.

/// One optimizer's hyper-parameters for one model: the defaults are the winners of the grids
/// in README.md ("How the defaults were tuned").
struct optimizer_settings {
    double lr = 0.0, momentum = 0.9, weight_decay = 5e-4;
    // K-FAC only:
    double damping = 0.0, kl_clip = 0.0, factor_decay = 0.95;
    int factor_update_steps = 10, inv_update_steps = 100;
    double eigenbasis_reuse = 0.0;  // options.eigenbasis_reuse_tolerance (0: exact)
    std::string method = "eigen";   // the compute method: eigen (compute::eigendecomposition) or ekfac
    // The curvature modes (docs/curvature-modes.md); "reference" is kfac-pytorch's.
    std::string statistics = "reference", averaging = "reference", damping_mode = "reference";
    bool relative_damping = false;
    bool kl_clip_cosine = false;  // kl_clip scaled by the square of the learning rate's cosine factor
};

struct settings {
    std::string model = "cnn";
    int epochs = 0;  // 0: the model's default
    std::string optimizers = "both";
    std::uint32_t seed = 1;
    int threads = 0;  // 0: every core
    int batch = 128;
    double warmup_epochs = 0.0;  // linear learning-rate warmup before the cosine (large batches)
    optimizer_settings sgd, kfac;
    fs::path data = fashion_mnist::default_dir();
    fs::path csv = "kfac_fashion_mnist.csv", plot, curvature_csv;
    bool want_plot = true;
    std::optional<fs::path> checkpoint, resume;
    int stop_after = 0;  // 0: run every epoch
    std::size_t train_limit = 0, test_limit = 0;
    std::optional<double> expect_accuracy;
    std::string strategy = "comm_opt";
    bool reference = false;  // --reference: kfac-pytorch's K-FAC, named kfac_reference
    std::string device = "cpu";  // --device cuda: LibTorch on the GPU, K-FAC on backend::cuda
    std::string precision = "fp32";  // --precision bf16 (autocast) | fp16 (CUDA autocast, loss scaling)
};

/// The tuned defaults of each model (README.md, "How the defaults were tuned"): each
/// optimizer's grid winner by the epochs to 90 % test accuracy, then the final accuracy (CNN:
/// seeds 1 and 2 at 5 epochs; ResNet-8: seed 1 at 4 epochs). K-FAC runs with the curvature
/// modes (per-example statistics, bias-corrected averaging) and a KL clip annealed with the
/// learning rate. `reference`: K-FAC as kfac-pytorch computes it (and SGD) with the winners of
/// the earlier grids by final accuracy (examples/fashion_mnist/README.md).
void model_defaults(settings& s, bool reference) {
    if (s.epochs == 0) s.epochs = s.model == "cnn" ? 5 : 4;
    if (reference) {
        // kl_clip 0.001 is kfac-pytorch's default; damping below 0.1 diverged or lagged.
        s.kfac.kl_clip = 0.001;
        s.sgd.lr = s.model == "cnn" ? 0.1 : 0.2;
        s.kfac.lr = s.model == "cnn" ? 0.05 : 0.1;
        s.kfac.damping = s.model == "cnn" ? 0.3 : 0.1;
        return;
    }
    s.kfac.statistics = "per_example";
    s.kfac.averaging = "bias_corrected";
    s.kfac.kl_clip_cosine = true;
    if (s.model == "cnn") {
        s.sgd.lr = 0.03;
        s.sgd.momentum = 0.95;
        s.kfac.lr = 0.05;
        s.kfac.damping = s.kfac.method == "ekfac" ? 0.03 : 0.003;  // EKFAC's own grid's winner
        s.kfac.kl_clip = s.kfac.method == "ekfac" ? 3e-4 : 3e-5;
    } else {
        s.sgd.lr = 0.1;
        s.kfac.lr = 0.1;
        s.kfac.damping = 0.003;
        s.kfac.kl_clip = 3e-5;
    }
}

void usage(bool distributed) {
    std::printf(
        "usage: %s [options]\n"
        "Trains a LibTorch model on Fashion-MNIST with SGD+momentum and with SGD+momentum on K-FAC\n"
        "preconditioned gradients, from the same initial weights and batch order.\n\n"
        "  --model cnn|resnet     the small CNN or ResNet-8 (default cnn)\n"
        "  --epochs N             passes over the 60,000 training images (default: cnn 5, resnet 4)\n"
        "  --optimizer sgd|kfac|both   (default both)\n"
        "  --seed N               initial weights and batch order (default 1)\n"
        "  --threads N            LibTorch's and kfac's threads, 0 for every core (default 0)\n"
        "  --device cpu|cuda      where the model trains; cuda: on the GPU with K-FAC on backend::cuda\n"
        "  --precision fp32|bf16|fp16   bf16: forward under autocast in bfloat16 (CPU or CUDA); fp16: CUDA\n"
        "                         autocast in half with dynamic loss scaling; runs are named *_bf16, *_fp16\n"
        "                         (needs a LibTorch built with CUDA and this program built with nvcc)\n"
        "  --batch N              minibatch size (default 128; under mpiexec the global batch, split over the ranks)\n"
        "  --warmup-epochs X      learning rate rising linearly from 0 over the first X epochs, then the\n"
        "                         cosine from the peak (Goyal et al. 2017's warmup for large batches; default 0)\n"
        "  --lr X, --momentum X, --weight-decay X             SGD's (defaults: the model's)\n"
        "  --kfac-lr X, --kfac-momentum X, --kfac-weight-decay X   the same with K-FAC\n"
        "  --damping X, --kl-clip X (0: none), --factor-decay X\n"
        "  --kl-clip-schedule constant|cosine   cosine: kl_clip × (the learning rate's cosine factor)²\n"
        "  --factor-update-steps N, --inv-update-steps N      (default 10, 100)\n"
        "  --method eigen|ekfac   K-FAC's compute method: eigen (default), or ekfac (eigenvalue-corrected\n"
        "                         K-FAC on the CPU backend, docs/k-fac.md; the run is named ekfac)\n"
        "  --eigenbasis-reuse TAU keep a factor's eigenvectors while they diagonalise it to within TAU\n"
        "  --reference            the defaults of kfac-pytorch's K-FAC (no curvature modes, kl_clip 0.001)\n"
        "                         and SGD tuned for final accuracy (the example's README)\n"
        "  --statistics reference|per_example, --averaging reference|bias_corrected,\n"
        "  --damping-mode reference|factored, --relative-damping   the curvature modes\n"
        "  --curvature-csv PATH   K-FAC's per-epoch curvature report (default: the CSV's path + _curvature)\n"
        "                         (options.eigenbasis_reuse_tolerance; default 0: exact; the run is named kfac_reuse_TAU)\n"
        "  --data DIR             the four *-ubyte.gz files (default %s)\n"
        "  --csv PATH             per-epoch results (default kfac_fashion_mnist.csv)\n"
        "  --plot PATH            the plot (default: the CSV's path with .png); --no-plot for none\n"
        "  --checkpoint DIR       save model, optimizer and K-FAC state there after every epoch\n"
        "  --resume DIR           continue the run saved in DIR (same settings)\n"
        "  --stop-after N         stop after epoch N (to resume later)\n"
        "  --train-limit N, --test-limit N   use only the first N images (tests)\n"
        "  --expect-accuracy X    exit 1 unless every optimizer's final test accuracy is >= X\n"
        "%s"
        "exit status: 0 done, 1 error or expectation not met, 2 usage, 77 data set not found\n",
        program, fashion_mnist::default_dir().c_str(),
        distributed ? "  --strategy S           comm_opt, hybrid_opt, mem_opt or dp_kfac (default comm_opt)\n" : "");
}

settings read_settings(int argc, char** argv, bool& help, bool distributed) {
    cli args(argc, argv, {"help", "no-plot", "relative-damping", "reference"});
    help = args.flag("help");
    settings s;
    s.model = args.text("model", s.model);
    if (s.model != "cnn" && s.model != "resnet") throw cli_error("--model must be cnn or resnet, not '" + s.model + "'");
    s.epochs = static_cast<int>(args.integer("epochs", 0));
    s.reference = args.flag("reference");
    s.kfac.method = args.text("method", s.kfac.method);  // before the defaults, which depend on it
    if (s.kfac.method != "eigen" && s.kfac.method != "ekfac")
        throw cli_error("--method must be eigen or ekfac, not '" + s.kfac.method + "'");
    model_defaults(s, s.reference);
    s.optimizers = args.text("optimizer", s.optimizers);
    if (s.optimizers != "sgd" && s.optimizers != "kfac" && s.optimizers != "both")
        throw cli_error("--optimizer must be sgd, kfac or both, not '" + s.optimizers + "'");
    s.seed = static_cast<std::uint32_t>(args.integer("seed", s.seed));
    s.threads = static_cast<int>(args.integer("threads", s.threads));
    s.device = args.text("device", s.device);
    if (s.device != "cpu" && s.device != "cuda") throw cli_error("--device must be cpu or cuda, not '" + s.device + "'");
    s.precision = args.text("precision", s.precision);
    if (s.precision != "fp32" && s.precision != "bf16" && s.precision != "fp16")
        throw cli_error("--precision must be fp32, bf16 or fp16, not '" + s.precision + "'");
    if (s.precision == "fp16" && s.device != "cuda")
        throw cli_error("--precision fp16 needs --device cuda (LibTorch's CPU autocast computes in bfloat16 only)");
    s.batch = static_cast<int>(args.integer("batch", s.batch));
    s.warmup_epochs = args.number("warmup-epochs", s.warmup_epochs);
    for (auto [prefix, o] : {std::pair{std::string(""), &s.sgd}, std::pair{std::string("kfac-"), &s.kfac}}) {
        o->lr = args.number(prefix + "lr", o->lr);
        o->momentum = args.number(prefix + "momentum", o->momentum);
        o->weight_decay = args.number(prefix + "weight-decay", o->weight_decay);
    }
    s.kfac.damping = args.number("damping", s.kfac.damping);
    s.kfac.kl_clip = args.number("kl-clip", s.kfac.kl_clip);
    s.kfac.factor_decay = args.number("factor-decay", s.kfac.factor_decay);
    s.kfac.factor_update_steps = static_cast<int>(args.integer("factor-update-steps", s.kfac.factor_update_steps));
    s.kfac.inv_update_steps = static_cast<int>(args.integer("inv-update-steps", s.kfac.inv_update_steps));
    s.kfac.eigenbasis_reuse = args.number("eigenbasis-reuse", s.kfac.eigenbasis_reuse);
    if (s.kfac.method == "ekfac" && s.device == "cuda")
        throw cli_error("--method ekfac runs on the CPU backend so far (kfac/compute/ekfac.hpp): use --device cpu");
    s.kfac.statistics = args.text("statistics", s.kfac.statistics);
    s.kfac.averaging = args.text("averaging", s.kfac.averaging);
    s.kfac.damping_mode = args.text("damping-mode", s.kfac.damping_mode);
    if (args.flag("relative-damping")) s.kfac.relative_damping = true;
    if (const auto schedule = args.text("kl-clip-schedule")) {
        if (*schedule != "constant" && *schedule != "cosine")
            throw cli_error("--kl-clip-schedule must be constant or cosine, not '" + *schedule + "'");
        s.kfac.kl_clip_cosine = *schedule == "cosine";
    }
    if (s.kfac.statistics != "reference" && s.kfac.statistics != "per_example")
        throw cli_error("--statistics must be reference or per_example, not '" + s.kfac.statistics + "'");
    if (s.kfac.averaging != "reference" && s.kfac.averaging != "bias_corrected")
        throw cli_error("--averaging must be reference or bias_corrected, not '" + s.kfac.averaging + "'");
    if (s.kfac.damping_mode != "reference" && s.kfac.damping_mode != "factored")
        throw cli_error("--damping-mode must be reference or factored, not '" + s.kfac.damping_mode + "'");
    s.data = args.text("data", s.data.string());
    s.csv = args.text("csv", s.csv.string());
    s.plot = args.text("plot", fs::path(s.csv).replace_extension(".png").string());
    s.want_plot = !args.flag("no-plot");
    {
        fs::path curvature = s.csv;
        curvature.replace_filename(s.csv.stem().string() + "_curvature.csv");
        s.curvature_csv = args.text("curvature-csv", curvature.string());
    }
    if (auto d = args.text("checkpoint")) s.checkpoint = *d;
    if (auto d = args.text("resume")) s.resume = *d;
    s.stop_after = static_cast<int>(args.integer("stop-after", 0));
    s.train_limit = static_cast<std::size_t>(args.integer("train-limit", 0));
    s.test_limit = static_cast<std::size_t>(args.integer("test-limit", 0));
    if (args.text("expect-accuracy")) s.expect_accuracy = args.number("expect-accuracy", 0.0);
    if (distributed) {  // (alone, --strategy is an unknown option)
        s.strategy = args.text("strategy", s.strategy);
        if (s.strategy != "comm_opt" && s.strategy != "hybrid_opt" && s.strategy != "mem_opt" && s.strategy != "dp_kfac")
            throw cli_error("--strategy must be comm_opt, hybrid_opt, mem_opt or dp_kfac, not '" + s.strategy + "'");
    }
    args.finish();
    if (s.epochs < 1 || s.batch < 1 || s.threads < 0 || s.stop_after < 0)
        throw cli_error("--epochs and --batch must be positive, --threads and --stop-after not negative");
    if (s.kfac.kl_clip < 0.0) throw cli_error("--kl-clip must be >= 0 (0: no clipping)");
    if (!(s.warmup_epochs >= 0.0 && s.warmup_epochs < s.epochs))
        throw cli_error("--warmup-epochs must be >= 0 and less than --epochs (" + std::to_string(s.epochs) + ")");
    return s;
}

// ---------------------------------------------------------------------------------------
// Data.

struct tensors {
    torch::Tensor images;  ///< [N, 1, 28, 28] float, standardized
    torch::Tensor labels;  ///< [N] int64
};

struct data {
    tensors train, test;
};

/// Pixels / 255, standardized with the training images' mean and standard deviation.
data prepare(const fashion_mnist::dataset& raw, std::size_t train_limit, std::size_t test_limit) {
    auto convert = [](const fashion_mnist::images& d, std::size_t limit) {
        const auto n = static_cast<std::int64_t>(limit ? std::min(limit, d.size()) : d.size());
        auto pixels = torch::from_blob(const_cast<std::uint8_t*>(d.pixels.data()), {n, 1, 28, 28}, torch::kUInt8)
                          .to(torch::kFloat)
                          .div_(255.0);
        auto labels = torch::from_blob(const_cast<std::uint8_t*>(d.labels.data()), {n}, torch::kUInt8).to(torch::kLong);
        return tensors{pixels, labels};
    };
    data out{convert(raw.train, train_limit), convert(raw.test, test_limit)};
    const double mean = out.train.images.mean().item<double>(), sd = out.train.images.std().item<double>();
    for (auto* t : {&out.train, &out.test}) t->images.sub_(mean).div_(sd);
    return out;
}

/// The order of the training images in `epoch` (1-based), the same for every optimizer and
/// rank, and a function of the seed and the epoch only, so a resumed run sees the same.
std::vector<std::int64_t> batch_order(std::size_t n, std::uint32_t seed, int epoch) {
    std::mt19937 rng(seed * 1000003u + static_cast<std::uint32_t>(epoch));
    std::vector<std::int64_t> order(n);
    for (std::size_t i = 0; i < n; ++i) order[i] = static_cast<std::int64_t>(i);
    for (std::size_t i = n; i > 1; --i) std::swap(order[i - 1], order[rng() % i]);  // written out: std::shuffle is unspecified
    return order;
}

// ---------------------------------------------------------------------------------------
// The run's progress file (--checkpoint): words and numbers, "nan" included.

std::vector<std::string> split_words(const std::string& line) {
    std::istringstream in(line);
    std::vector<std::string> words;
    for (std::string w; in >> w;) words.push_back(w);
    return words;
}

/// `word` as a double ("nan" too: epoch 0 has no training loss); anything else is an error,
/// not a silently shorter history (operator>> stops at "nan").
double parse_number(const std::string& word, const std::string& where) {
    char* end = nullptr;
    const double v = std::strtod(word.c_str(), &end);
    if (word.empty() || end != word.c_str() + word.size())
        throw std::runtime_error(where + ": '" + word + "' is not a number");
    return v;
}

// ---------------------------------------------------------------------------------------
// One optimizer's run.

struct epoch_row {
    int epoch;
    double lr, train_loss, test_loss, test_accuracy, seconds;
};

class run {
public:
    run(std::string name, const settings& s, const optimizer_settings& o, const processes& procs)
        : name_(std::move(name)), settings_(s), o_(o), procs_(procs) {
        torch::manual_seed(s.seed);  // the same initial weights for every optimizer and rank
        model_ = fashion::make_classifier(s.model);
        if (s.device == "cuda") model_.module->to(torch::kCUDA);  // the CPU's initial weights, on the GPU
        optimizer_ = std::make_unique<torch::optim::SGD>(
            model_.module->parameters(),
            torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
        if (s.precision == "fp16") scaler_ = std::make_unique<kfac::torch::grad_scaler>();
    }

    /// Attaches K-FAC: tracks the model's Conv2d/Linear layers; says what it left to SGD.
    void attach_kfac(std::int64_t steps_total) {
        kfac::options opts;
        opts.damping = o_.damping;
        if (o_.kl_clip <= 0.0) {
            opts.kl_clip = std::optional<double>{};
        } else if (o_.kl_clip_cosine) {
            // The trust region follows the learning rate's cosine: a clipped step's size is
            // √(κ / Σ P·Γ), whatever the learning rate, so κ ∝ (η_k/η_0)² anneals it as η_k
            // anneals SGD's step.
            const double kappa = o_.kl_clip, lr0 = o_.lr;
            opts.kl_clip = [kappa, lr0, steps_total, warmup = warmup_steps(steps_total)](std::int64_t k) -> std::optional<double> {
                const double c = scheduled_lr(lr0, k, steps_total, warmup) / lr0;
                return kappa * std::max(c * c, 1e-12);
            };
        } else {
            opts.kl_clip = o_.kl_clip;
        }
        opts.factor_decay = o_.factor_decay;
        opts.factor_update_steps = std::int64_t{o_.factor_update_steps};
        opts.inv_update_steps = std::int64_t{o_.inv_update_steps};
        opts.eigenbasis_reuse_tolerance = o_.eigenbasis_reuse;
        if (o_.statistics == "per_example") opts.statistics = kfac::statistic_scale::per_example;
        if (o_.averaging == "bias_corrected") opts.averaging = kfac::factor_averaging::bias_corrected;
        if (o_.damping_mode == "factored") opts.damping_mode = kfac::damping_form::factored;
        opts.relative_damping = o_.relative_damping;
        opts.threads = settings_.threads;
        if (scaler_) opts.loss_scale = scaler_->loss_scale();  // --precision fp16
        // The BatchNorm layers stay the optimizer's, as kfac-pytorch leaves them: the figures
        // in docs/examples.md are this preconditioner's against the reference's (remove the pattern
        // to give them their unit-wise K-FAC blocks too).
        opts.skip_layers = {"BatchNorm"};
        // kl_clip's η is the optimizer's learning rate, which follows the schedule.
        const double lr0 = o_.lr;
        opts.lr = [lr0, steps_total, warmup = warmup_steps(steps_total)](std::int64_t k) {
            return scheduled_lr(lr0, k, steps_total, warmup);
        };
        if (procs_.distributed()) {
            if (settings_.strategy == "comm_opt") opts.grad_worker_fraction = kfac::comm_opt;
            else if (settings_.strategy == "hybrid_opt") opts.grad_worker_fraction = kfac::hybrid_opt;
            else if (settings_.strategy == "mem_opt") opts.grad_worker_fraction = kfac::mem_opt;
            else opts.strategy = kfac::distribution::dp_kfac;
            precond_ = o_.method == "ekfac" ? procs_.cpu_preconditioner<kfac::compute::ekfac>(opts)
                                            : procs_.cpu_preconditioner<kfac::compute::eigendecomposition>(opts);
        } else if (o_.method == "ekfac") {  // the CPU backend (read_settings refuses --device cuda)
            precond_ = make_cpu_kfac<kfac::compute::ekfac>(opts);
        } else {
            precond_ = make_kfac(opts, settings_.device == "cuda");
        }
        // kfac's layer tasks run on opts.threads threads with one BLAS thread each. A BLAS call
        // on several threads would leave OpenBLAS's workers spinning after the step, taking
        // the cores from LibTorch's next forward pass (an epoch took 2.7× as long).
        one_blas_thread_.emplace();
        tracker_ = std::make_unique<kfac::torch::tracker<float>>();
        const auto report = kfac::torch::register_modules(*precond_, *tracker_, model_.module);
        if (procs_.leader()) std::printf("%s: %s\n", name_.c_str(), report.summary().c_str());
        if (procs_.leader() && settings_.device == "cuda")
            std::printf("%s: preconditioned on the GPU (kfac::backend::%s)\n", name_.c_str(), precond_->backend_name().c_str());
        precond_->on_non_finite([](const kfac::non_finite_event& e) {
            std::fprintf(stderr, "kfac: non-finite values in layer %s at step %lld (contained)\n", e.layer.c_str(),
                         static_cast<long long>(e.step));
        });
    }

    /// The learning rate of step `step` (0-based) of `steps_total`: with W warmup steps, step
    /// k < W trains at lr0·(k+1)/W (Goyal et al. 2017, "Accurate, Large Minibatch SGD": a large
    /// batch's scaled learning rate reached gradually), then the cosine from lr0 to 0 over the
    /// remaining steps. W = 0 is the plain cosine, bit for bit.
    static double scheduled_lr(double lr0, std::int64_t step, std::int64_t steps_total, std::int64_t warmup_steps) {
        if (step < warmup_steps) return lr0 * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
        const double t = std::min(1.0, static_cast<double>(step - warmup_steps) /
                                           static_cast<double>(std::max<std::int64_t>(1, steps_total - warmup_steps)));
        return 0.5 * lr0 * (1.0 + std::cos(3.14159265358979323846 * t));
    }
    /// The warmup's steps: --warmup-epochs of this run's epochs (steps_total / epochs each).
    [[nodiscard]] std::int64_t warmup_steps(std::int64_t steps_total) const {
        return static_cast<std::int64_t>(std::llround(settings_.warmup_epochs * static_cast<double>(steps_total) /
                                                      static_cast<double>(settings_.epochs)));
    }

    /// One epoch over `order`; returns the mean minibatch loss.
    double train_epoch(const tensors& train, const std::vector<std::int64_t>& order, std::int64_t steps_total,
                       progress_bar& bar, int epoch) {
        model_.module->train();
        const auto start = std::chrono::steady_clock::now();
        const auto n = static_cast<std::int64_t>(order.size());
        const std::int64_t batch = settings_.batch;
        const std::int64_t steps = (n + batch - 1) / batch;
        double loss_sum = 0.0;
        for (std::int64_t k = 0; k < steps; ++k) {
            const std::int64_t first = k * batch, count = std::min(batch, n - first);
            // This rank's slice of the minibatch (all of it in one process).
            const std::int64_t lo = first + count * procs_.rank / procs_.size;
            const std::int64_t hi = first + count * (procs_.rank + 1) / procs_.size;
            const auto index = torch::from_blob(const_cast<std::int64_t*>(order.data() + lo), {hi - lo}, torch::kLong)
                                   .to(train.images.device());
            const auto x = train.images.index_select(0, index), y = train.labels.index_select(0, index);
            set_lr(lr_now(steps_total));
            optimizer_->zero_grad();
            // The mean loss of this rank's slice (so that the output gradients K-FAC reads are a
            // mean loss's over the examples it sees, as options.statistics = per_example
            // assumes); the ranks' gradients, weighted by their slices' shares, sum to the
            // minibatch's mean loss's (in one process: the mean loss itself).
            const std::int64_t mine = std::max<std::int64_t>(1, hi - lo);
            at::Tensor logits;
            {
                const mixed_precision::autocast_scope autocast(settings_.precision, settings_.device);
                logits = model_.forward(x);
            }
            auto loss = F::cross_entropy(logits.to(torch::kFloat), y, F::CrossEntropyFuncOptions().reduction(torch::kSum)) /
                        static_cast<double>(mine);
            if (scaler_) scaler_->scale(loss).backward();
            else loss.backward();
            sum_gradients(static_cast<double>(hi - lo) / static_cast<double>(count));
            if (scaler_) scaler_->unscale(*optimizer_);
            // Every tracked .grad() is now preconditioned, unless the loss scale overflowed this
            // step: K-FAC then skipped it, and so does the optimizer (the scaler's verdict).
            const bool skipped = precond_ ? precond_->step().skipped : scaler_ && scaler_->found_inf();
            if (!skipped) optimizer_->step();
            if (scaler_) scaler_->update();
            ++step_;
            std::vector<double> l{loss.item<double>() * static_cast<double>(hi - lo) / static_cast<double>(count)};
            procs_.sum(l);
            loss_sum += l[0];
            if (procs_.leader() && (k % 10 == 0 || k + 1 == steps)) {
                char note[48];
                std::snprintf(note, sizeof note, "loss %.3f", loss_sum / static_cast<double>(k + 1));
                bar.draw(epoch, settings_.epochs, name_, static_cast<std::size_t>(k + 1), static_cast<std::size_t>(steps), note);
            }
        }
        seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        return loss_sum / static_cast<double>(steps);
    }

    /// Test loss and accuracy (evaluation mode; each rank takes a share of the test set).
    std::pair<double, double> evaluate(const tensors& test) {
        average_buffers();
        torch::NoGradGuard no_grad;
        model_.module->eval();
        const std::int64_t n = test.labels.size(0);
        const std::int64_t lo = n * procs_.rank / procs_.size, hi = n * (procs_.rank + 1) / procs_.size;
        std::vector<double> totals{0.0, 0.0};  // loss sum, correct
        for (std::int64_t first = lo; first < hi; first += 500) {
            const std::int64_t last = std::min(hi, first + 500);
            const auto logits = model_.forward(test.images.slice(0, first, last));
            const auto y = test.labels.slice(0, first, last);
            totals[0] += F::cross_entropy(logits, y, F::CrossEntropyFuncOptions().reduction(torch::kSum)).item<double>();
            totals[1] += logits.argmax(1).eq(y).sum().item<double>();
        }
        procs_.sum(totals);
        return {totals[0] / static_cast<double>(n), totals[1] / static_cast<double>(n)};
    }

    /// Saves the model, the optimizer, K-FAC and the progress into `dir` (collective).
    void save(const fs::path& dir) {
        on_every_rank(procs_, [&] {
            if (procs_.leader()) fs::create_directories(dir);
        });
        if (precond_) precond_->save(dir / "kfac.safetensors");  // collective: rank 0 writes
        on_every_rank(procs_, [&] {
            if (!procs_.leader()) return;
            torch::save(model_.module, (dir / "model.pt").string());
            torch::save(*optimizer_, (dir / "optimizer.pt").string());
            std::ofstream out(dir / "progress.txt");
            out << std::setprecision(17);  // every double back exactly (epoch 0's train loss is nan)
            out << "step " << step_ << "\nseconds " << seconds_ << "\n";
            for (const auto& r : rows_)
                out << "row " << r.epoch << ' ' << r.lr << ' ' << r.train_loss << ' ' << r.test_loss << ' '
                    << r.test_accuracy << ' ' << r.seconds << '\n';
            if (!out) throw std::runtime_error("cannot write " + (dir / "progress.txt").string());
        });
    }

    /// Continues from what save() wrote into `dir` (collective).
    void load(const fs::path& dir) {
        on_every_rank(procs_, [&] {
            for (const char* f : {"model.pt", "optimizer.pt", "progress.txt"})
                if (!fs::is_regular_file(dir / f))
                    throw std::runtime_error("--resume " + dir.string() + ": " + f + " is missing (was it saved by " +
                                             "--checkpoint with the same --optimizer?)");
            torch::load(model_.module, (dir / "model.pt").string());
            torch::load(*optimizer_, (dir / "optimizer.pt").string());
            std::ifstream in(dir / "progress.txt");
            rows_.clear();
            std::string line;
            for (int number = 1; std::getline(in, line); ++number) {
                const auto where = "--resume " + dir.string() + ": progress.txt line " + std::to_string(number);
                const auto words = split_words(line);
                if (words.empty()) continue;
                if (words[0] == "step" && words.size() == 2) step_ = static_cast<std::int64_t>(parse_number(words[1], where));
                else if (words[0] == "seconds" && words.size() == 2) seconds_ = parse_number(words[1], where);
                else if (words[0] == "row" && words.size() == 7)
                    rows_.push_back({static_cast<int>(parse_number(words[1], where)), parse_number(words[2], where),
                                     parse_number(words[3], where), parse_number(words[4], where),
                                     parse_number(words[5], where), parse_number(words[6], where)});
                else throw std::runtime_error(where + " is not 'step N', 'seconds X' or 'row' and six numbers: '" + line + "'");
            }
            if (rows_.empty()) throw std::runtime_error("--resume " + dir.string() + ": progress.txt records no epoch");
        });
        if (precond_) precond_->load(dir / "kfac.safetensors");  // collective: rank 0 reads and sends
    }

    void record(const epoch_row& r) { rows_.push_back(r); }
    [[nodiscard]] const std::vector<epoch_row>& rows() const { return rows_; }
    [[nodiscard]] const std::string& name() const { return name_; }
    [[nodiscard]] double seconds() const { return seconds_; }
    [[nodiscard]] std::int64_t step() const { return step_; }
    [[nodiscard]] double lr_now(std::int64_t steps_total) const {
        return scheduled_lr(o_.lr, step_, steps_total, warmup_steps(steps_total));
    }
    [[nodiscard]] const kfac_handle* precond() const { return precond_.get(); }
    /// Training time at which the test accuracy first reached `target`, and the epoch.
    [[nodiscard]] std::optional<std::pair<int, double>> first_reaching(double target) const {
        for (const auto& r : rows_)
            if (r.epoch > 0 && r.test_accuracy >= target) return std::pair{r.epoch, r.seconds};
        return std::nullopt;
    }

private:
    void set_lr(double lr) {
        for (auto& group : optimizer_->param_groups())
            static_cast<torch::optim::SGDOptions&>(group.options()).lr(lr);
    }

    /// Data-parallel: every gradient summed over the ranks, in one buffer and one allreduce.
    /// Every rank's gradients × its `share` of the minibatch, summed over the ranks.
    void sum_gradients(double share) {
        if (procs_.size == 1) return;
        std::vector<torch::Tensor> grads, flat_views;
        for (auto& p : model_.module->parameters())
            if (p.grad().defined()) {
                grads.push_back(p.grad());
                flat_views.push_back(p.grad().reshape({-1}));
            }
        if (grads.empty()) return;
        auto flat = torch::cat(flat_views) * share;
        procs_.sum(flat.data_ptr<float>(), static_cast<std::size_t>(flat.numel()));
        std::int64_t offset = 0;
        for (auto& g : grads) {
            g.copy_(flat.slice(0, offset, offset + g.numel()).view_as(g));
            offset += g.numel();
        }
    }

    /// Data-parallel: BatchNorm's running statistics averaged over the ranks before evaluation.
    void average_buffers() {
        if (procs_.size == 1) return;
        torch::NoGradGuard no_grad;
        for (auto& b : model_.module->buffers()) {
            if (b.scalar_type() != torch::kFloat) continue;  // num_batches_tracked: equal on every rank
            procs_.sum(b.data_ptr<float>(), static_cast<std::size_t>(b.numel()));
            b.div_(procs_.size);
        }
    }

    std::string name_;
    const settings& settings_;
    optimizer_settings o_;
    const processes& procs_;
    fashion::classifier model_;
    std::unique_ptr<torch::optim::SGD> optimizer_;
    std::unique_ptr<kfac::torch::grad_scaler> scaler_;  // --precision fp16 (before precond_: outlives it)
    std::optional<cpu_backend::serial_blas_scope> one_blas_thread_;
    std::unique_ptr<kfac::torch::tracker<float>> tracker_;  // before precond_: destroyed after it
    std::unique_ptr<kfac_handle> precond_;
    std::int64_t step_ = 0;
    double seconds_ = 0.0;
    std::vector<epoch_row> rows_;
};

/// One line per epoch of how much of each layer's preconditioner is curvature
/// (kfac::preconditioner::curvature(), docs/curvature-modes.md), and the CSV rows of it.
void print_curvature(int epoch, const std::string& optimizer, const std::vector<kfac::layer_curvature>& report,
                     std::vector<std::string>& rows) {
    std::printf("          curvature share:");
    for (const auto& c : report) {
        if (!c.held) continue;
        // EKFAC divides by its scaling S + γ: its share is S / (S + γ)'s (K-FAC's, of the same
        // factors, stays in the CSV's curvature_share).
        const double share = std::isnan(c.scaling_share) ? c.curvature_share : c.scaling_share;
        std::printf("  %s %.3g (identity %.2g)", c.name.c_str(), share, c.identity_weight);
        char row[400];
        std::snprintf(row, sizeof row, "%d,%s,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g\n", epoch,
                      c.name.c_str(), c.identity_weight, c.a.mean, c.g.mean, c.mean_product, c.damping, c.damping_a,
                      c.damping_g, c.damping_product, c.curvature_share, c.scaling_share);
        rows.push_back(optimizer + "," + row);
    }
    std::printf("\n");
}

/// LibTorch runs its convolutions on oneDNN's OpenMP threads and its Linear layers through
/// the system BLAS, whose own thread pool then competes with OpenMP's for the same cores. On
/// the 2-core development machine one OpenBLAS thread made a CNN step 1.7× as fast (100
/// steps: 4.7 s → 2.8 s). OpenBLAS reads OPENBLAS_NUM_THREADS only when it is loaded, so a
/// running program sets it through openblas_set_num_threads, found by name: LibTorch's BLAS
/// is whichever library the system provides, and kfac's own (scipy-openblas32) has prefixed
/// names and is unaffected. Nothing happens when the environment chose a count already.
void one_thread_in_torch_blas() {
    if (std::getenv("OPENBLAS_NUM_THREADS") != nullptr) return;
    using setter = void (*)(int);
    if (auto* set = reinterpret_cast<setter>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(1);
}

std::string hms(double seconds) {
    char s[32];
    std::snprintf(s, sizeof s, "%.1fs", seconds);
    return s;
}

int main_body(int argc, char** argv, transport how) {
    processes procs(how);
    settings s;
    try {
        bool help = false;
        s = read_settings(argc, argv, help, procs.distributed());
        if (help) {
            if (procs.leader()) usage(procs.distributed());
            return 0;
        }
    } catch (const cli_error& e) {
        if (procs.leader()) std::fprintf(stderr, "%s: %s\n", program, e.what());
        return 2;
    }
    if (s.device == "cuda") {
        const char* why = nullptr;
        if (!built_with_cuda || procs.distributed())
            why = "was built without nvcc or runs data-parallel: --device cuda needs the CUDA toolkit at "
                  "configure time (kfac::cuda) and one process (kfac_fashion_mnist)";
        else if (!torch::cuda::is_available())
            why = "sees no CUDA device through LibTorch (Debian's LibTorch is CPU-only): build against a LibTorch "
                  "with CUDA, as docs/gpu.md's 'LibTorch on a GPU' says, on a machine with a GPU";
        if (why) {
            if (procs.leader()) std::fprintf(stderr, "%s: --device cuda: this program %s\n", program, why);
            return 2;
        }
    }
    const int threads = s.threads > 0 ? s.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    one_thread_in_torch_blas();
#if defined(__GLIBC__)
    if (s.batch / procs.size > 512) {
        // A large batch's activations are hundreds of MB each (conv1's at 4,096 images: 177 MB),
        // beyond glibc's largest mmap threshold (32 MB): each was mapped fresh and unmapped
        // again every step, and zero-filling its pages took as long as the training (measured:
        // one SGD epoch at batch 4,096 took 16.1 s, 17.8 s of it system time; 7.6 s from the
        // heap). Keep them in the heap and keep the heap.
        mallopt(M_MMAP_MAX, 0);
        mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
    }
#endif
    torch::set_num_threads(std::max(1, threads / procs.size));
    s.threads = std::max(1, threads / procs.size);

    fashion_mnist::dataset raw;
    try {
        raw = fashion_mnist::load(s.data);
    } catch (const fashion_mnist::dataset_missing& e) {
        if (procs.leader()) std::fprintf(stderr, "%s: %s\n", program, e.what());
        return exit_skip;
    }
    data d = prepare(raw, s.train_limit, s.test_limit);
    if (s.device == "cuda")  // the whole data set on the GPU, once (60,000 images: 188 MB)
        for (auto* t : {&d.train, &d.test}) *t = {t->images.to(torch::kCUDA), t->labels.to(torch::kCUDA)};
    const auto n_train = static_cast<std::size_t>(d.train.labels.size(0));
    const std::int64_t steps_per_epoch = (static_cast<std::int64_t>(n_train) + s.batch - 1) / s.batch;
    const std::int64_t steps_total = steps_per_epoch * s.epochs;

    std::vector<std::unique_ptr<run>> runs;
    const std::string suffix = s.precision == "fp32" ? "" : "_" + s.precision;  // sgd_bf16 beside sgd
    if (s.optimizers != "kfac") runs.push_back(std::make_unique<run>("sgd" + suffix, s, s.sgd, procs));
    if (s.optimizers != "sgd") {
        // A run with the approximate refresh is named apart (kfac_reuse_0.05), so its rows plot
        // beside exact ones.
        std::ostringstream name;
        if (s.kfac.eigenbasis_reuse > 0.0) name << "kfac_reuse_" << s.kfac.eigenbasis_reuse;  // 6 significant digits
        else name << (s.kfac.method == "ekfac" ? "ekfac" : "kfac") << (s.reference ? "_reference" : "");
        if (s.precision != "fp32") name << "_" << s.precision;
        runs.push_back(std::make_unique<run>(name.str(), s, s.kfac, procs));
        runs.back()->attach_kfac(steps_total);
    }

    if (procs.leader()) {
        std::printf("Fashion-MNIST (%s): %zu training and %lld test images; %s; batch %d, %d epochs, seed %u, "
                    "%d thread(s)%s\n",
                    s.data.c_str(), n_train, static_cast<long long>(d.test.labels.size(0)),
                    fashion::describe(s.model).c_str(), s.batch, s.epochs, s.seed, s.threads,
                    procs.size > 1 ? (" per rank, " + std::to_string(procs.size) + " ranks, " + s.strategy).c_str() : "");
        char schedule[64] = "cosine schedule";
        if (s.warmup_epochs > 0.0) std::snprintf(schedule, sizeof schedule, "%g warmup epochs, then cosine", s.warmup_epochs);
        std::printf("sgd:  lr %g (%s), momentum %g, weight decay %g\n", s.sgd.lr, schedule, s.sgd.momentum,
                    s.sgd.weight_decay);
        std::printf("kfac: lr %g (%s), momentum %g, weight decay %g; damping %g, kl_clip %g, factor decay "
                    "%g, factors every %d and eigendecompositions every %d steps\n\n",
                    s.kfac.lr, schedule, s.kfac.momentum, s.kfac.weight_decay, s.kfac.damping, s.kfac.kl_clip,
                    s.kfac.factor_decay, s.kfac.factor_update_steps, s.kfac.inv_update_steps);
    }

    int first_epoch = 1;
    for (auto& r : runs) {
        if (s.resume) {
            r->load(*s.resume / r->name());
            first_epoch = r->rows().back().epoch + 1;
            if (procs.leader())
                std::printf("%s: resumed from %s after epoch %d (step %lld)\n", r->name().c_str(),
                            (*s.resume / r->name()).c_str(), first_epoch - 1, static_cast<long long>(r->step()));
        } else {
            const auto [loss, accuracy] = r->evaluate(d.test);
            r->record({0, r->lr_now(steps_total), std::nan(""), loss, accuracy, 0.0});
        }
    }

    progress_bar bar;
    std::vector<std::string> curvature_rows;  // the curvature CSV's rows
    for (int epoch = first_epoch; epoch <= s.epochs; ++epoch) {
        const auto order = batch_order(n_train, s.seed, epoch);
        for (auto& r : runs) {
            const double lr = r->lr_now(steps_total);
            const double train_loss = r->train_epoch(d.train, order, steps_total, bar, epoch);
            const auto [test_loss, accuracy] = r->evaluate(d.test);
            r->record({epoch, lr, train_loss, test_loss, accuracy, r->seconds()});
            if (procs.leader()) {
                bar.clear();
                std::printf("epoch %2d  %-4s  train loss %.4f  test loss %.4f  test accuracy %6.2f%%  %s\n", epoch,
                            r->name().c_str(), train_loss, test_loss, 100.0 * accuracy, hms(r->seconds()).c_str());
                if (r->precond()) print_curvature(epoch, r->name(), r->precond()->curvature(), curvature_rows);
                std::fflush(stdout);
            }
            if (!std::isfinite(train_loss)) {
                if (procs.leader())
                    std::fprintf(stderr, "%s: %s diverged at epoch %d; lower its learning rate\n", program,
                                 r->name().c_str(), epoch);
                return 1;
            }
            if (s.checkpoint) r->save(*s.checkpoint / r->name());
        }
        if (s.stop_after > 0 && epoch >= s.stop_after && epoch < s.epochs) {
            if (procs.leader()) std::printf("stopped after epoch %d (--stop-after)\n", epoch);
            return 0;
        }
    }

    if (!procs.leader()) return 0;
    std::ofstream csv(s.csv);
    csv << "optimizer,model,seed,epoch,lr,train_loss,test_loss,test_accuracy,seconds\n";
    for (const auto& r : runs)
        for (const auto& row : r->rows()) {
            char line[200];
            std::snprintf(line, sizeof line, "%s,%s,%u,%d,%.6g,%.6f,%.6f,%.6f,%.3f\n", r->name().c_str(),
                          s.model.c_str(), s.seed, row.epoch, row.lr, row.train_loss, row.test_loss, row.test_accuracy,
                          row.seconds);
            csv << line;
        }
    csv.close();
    if (!csv) throw std::runtime_error("cannot write " + s.csv.string());
    if (!curvature_rows.empty()) {
        std::ofstream out(s.curvature_csv);
        out << "optimizer,model,seed,epoch,layer,identity_weight,mean_eigenvalue_a,mean_eigenvalue_g,mean_product,"
               "damping,damping_a,damping_g,damping_product,curvature_share,scaling_share\n";
        for (const auto& row : curvature_rows) {  // "optimizer,epoch,..." → "optimizer,model,seed,epoch,..."
            const auto comma = row.find(',');
            out << row.substr(0, comma) << ',' << s.model << ',' << s.seed << row.substr(comma);
        }
        if (!out) throw std::runtime_error("cannot write " + s.curvature_csv.string());
        std::printf("curvature csv: %s\n", s.curvature_csv.c_str());
    }

    std::printf("\n");
    for (const auto& r : runs) {
        std::printf("%-4s:", r->name().c_str());
        for (double target : {0.88, 0.90}) {
            if (const auto hit = r->first_reaching(target))
                std::printf("  %.0f%% at epoch %d (%s)", 100 * target, hit->first, hms(hit->second).c_str());
            else
                std::printf("  %.0f%% not reached", 100 * target);
        }
        if (r->precond())
            std::printf("  [K-FAC: %lld steps, %lld contained non-finite events]", static_cast<long long>(r->precond()->steps()),
                        static_cast<long long>(r->precond()->health().skipped_factor_updates +
                                               r->precond()->health().kept_decompositions +
                                               r->precond()->health().zeroed_gradients));
        if (r->precond() && s.kfac.eigenbasis_reuse > 0.0)
            std::printf("  [eigenbases: %lld reused, %lld decomposed]",
                        static_cast<long long>(r->precond()->eigenbasis_counts().reused),
                        static_cast<long long>(r->precond()->eigenbasis_counts().decomposed));
        std::printf("\n");
    }
    for (const auto& r : runs)
        std::printf("summary optimizer=%s model=%s epochs=%d test_accuracy=%.4f seconds=%.1f\n", r->name().c_str(),
                    s.model.c_str(), s.epochs, r->rows().back().test_accuracy, r->seconds());
    std::printf("csv: %s\n", s.csv.c_str());
    if (s.want_plot) {
#ifdef KFAC_FASHION_MNIST_SOURCE_DIR
        run_plot("plot_fashion_mnist.py", KFAC_FASHION_MNIST_SOURCE_DIR, s.csv, s.plot);
#else
        run_plot("plot_fashion_mnist.py", "", s.csv, s.plot);
#endif
    }
    if (s.expect_accuracy)
        for (const auto& r : runs)
            if (!(r->rows().back().test_accuracy >= *s.expect_accuracy)) {
                std::fprintf(stderr, "%s: FAILED: %s's final test accuracy %.4f is below --expect-accuracy %.4f\n",
                             program, r->name().c_str(), r->rows().back().test_accuracy, *s.expect_accuracy);
                return 1;
            }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    static const std::string name = fs::path(argc > 0 ? argv[0] : "kfac_fashion_mnist").filename().string();
    program = name.c_str();
    const transport how = transport_of(name);
#ifdef KFAC_EXAMPLE_MPI
    if (how == transport::mpi) MPI_Init(&argc, &argv);
#endif
    int status = 1;
    try {
        status = main_body(argc, argv, how);
    } catch (const std::exception& e) {  // kfac::error names the layer and the fix
        std::fprintf(stderr, "%s: %s\n", program, e.what());
    }
#ifdef KFAC_EXAMPLE_MPI
    if (how == transport::mpi) {
        // A rank that failed alone would leave the others waiting: end them all.
        if (status == 1) MPI_Abort(MPI_COMM_WORLD, 1);
        MPI_Finalize();
    }
#endif
    return status;
}
