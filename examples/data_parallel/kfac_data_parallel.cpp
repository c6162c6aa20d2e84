// SPDX-License-Identifier: Apache-2.0
// kfac_data_parallel: the digits MLP of kfac_digits trained data-parallel with MPI, as
// PyTorch's DistributedDataParallel + kfac-pytorch would train it:
//
//   mpiexec -n 2 ./build/examples/kfac_data_parallel --strategy comm_opt
//
// Every rank holds the whole model and walks the same shuffled batches; each takes its shard
// (a contiguous slice) of every minibatch, runs forward and backward on it, and the gradients
// are summed with MPI_Allreduce. A kfac::KFAC over comm::mpi then preconditions them: with
// KAISA (comm_opt, hybrid_opt, mem_opt) the factors are averaged over the ranks and each
// layer's eigendecompositions are computed on the ranks the grid assigns it; with DP-KFAC each
// layer's owner builds its factors from its own shard. Every rank applies the same update, so
// the replicas stay bit-identical, which --check verifies.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include <mpi.h>

#include <kfac/comm/mpi.hpp>
#include <kfac/kfac.hpp>

#include "cli.hpp"
#include "digits_dataset.hpp"
#include "digits_training.hpp"
#include "eigen_mlp.hpp"

namespace {

using namespace kfac_examples;

constexpr int exit_skip = 77;  // the data set is missing (CTest's SKIP_RETURN_CODE)

using distributed_kfac = kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::mpi>;

/// --strategy: KAISA's three named gradient-worker fractions, or DP-KFAC.
void apply_strategy(const std::string& name, kfac::options& o) {
    if (name == "comm_opt") o.grad_worker_fraction = kfac::comm_opt;
    else if (name == "hybrid_opt") o.grad_worker_fraction = kfac::hybrid_opt;
    else if (name == "mem_opt") o.grad_worker_fraction = kfac::mem_opt;
    else if (name == "dp_kfac") o.strategy = kfac::distribution::dp_kfac;
    else throw cli_error("--strategy must be comm_opt, hybrid_opt, mem_opt or dp_kfac, not '" + name + "'");
}

/// All of the model's gradients in one buffer, summed over the ranks in one MPI_Allreduce.
void allreduce_gradients(mlp& model, std::vector<float>& buffer) {
    std::size_t total = 0;
    model.for_each_gradient_block([&](float*, std::size_t n) { total += n; });
    buffer.resize(total);
    std::size_t offset = 0;
    model.for_each_gradient_block([&](float* p, std::size_t n) {
        std::memcpy(buffer.data() + offset, p, n * sizeof(float));
        offset += n;
    });
    MPI_Allreduce(MPI_IN_PLACE, buffer.data(), static_cast<int>(total), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    offset = 0;
    model.for_each_gradient_block([&](float* p, std::size_t n) {
        std::memcpy(p, buffer.data() + offset, n * sizeof(float));
        offset += n;
    });
}

/// Rank 0's initial weights on every rank, as DistributedDataParallel does at construction
/// (they are equal anyway: every rank draws them from the same seed).
void broadcast_parameters(mlp& model) {
    for (auto& l : model.layers) {
        MPI_Bcast(l.weight.data(), static_cast<int>(l.weight.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
        MPI_Bcast(l.bias.data(), static_cast<int>(l.bias.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
    }
}

/// FNV-1a over the bytes of every parameter: equal on two ranks iff (barring a collision)
/// their weights are bit-identical.
std::uint64_t parameter_checksum(const mlp& model) {
    std::uint64_t h = 1469598103934665603ULL;
    model.for_each_parameter_block([&](const float* p, std::size_t n) {
        const auto* bytes = reinterpret_cast<const unsigned char*>(p);
        for (std::size_t i = 0; i < n * sizeof(float); ++i) h = (h ^ bytes[i]) * 1099511628211ULL;
    });
    return h;
}

bool all_ranks(bool mine) {
    int v = mine ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return v == 1;
}

void usage() {
    std::printf(
        "usage: mpiexec -n W kfac_data_parallel [options]\n"
        "Trains the digits MLP with SGD+momentum+K-FAC, data-parallel over W MPI ranks.\n\n%s"
        "  --strategy S           comm_opt (default), hybrid_opt, mem_opt or dp_kfac\n"
        "  --check                verify that all ranks end with bit-identical weights\n"
        "  --expect-accuracy X    exit 1 unless the final test accuracy is >= X\n"
        "exit status: 0 done, 1 error or check failed, 2 usage, 77 data set not found\n",
        digits_settings_usage);
}

int run(int argc, char** argv, int rank, int world) {
    digits_settings s;
    std::string strategy = "comm_opt";
    bool check = false;
    std::optional<double> expect_accuracy;
    kfac::options opts;
    try {
        cli args(argc, argv, {"help", "check"});
        if (args.flag("help")) {
            if (rank == 0) usage();
            return 0;
        }
        s = read_digits_settings(args);
        strategy = args.text("strategy", strategy);
        check = args.flag("check");
        if (args.text("expect-accuracy")) expect_accuracy = args.number("expect-accuracy", 0.0);
        args.finish();
        opts = digits_kfac_options(s);
        apply_strategy(strategy, opts);
        if (s.batch < world) throw cli_error("--batch must be at least the number of ranks");
    } catch (const cli_error& e) {
        if (rank == 0) std::fprintf(stderr, "kfac_data_parallel: %s\n", e.what());
        return 2;
    }

    const std::filesystem::path data_path = s.data.empty() ? digits::default_digits_path() : s.data;
    digits::dataset all;
    std::string load_error;
    bool missing = false;
    try {
        all = digits::load(data_path);
    } catch (const digits::dataset_missing& e) {
        load_error = e.what();
        missing = true;
    } catch (const digits::dataset_error& e) {
        load_error = e.what();
    }
    if (!all_ranks(load_error.empty())) {
        if (!load_error.empty() && rank == 0) std::fprintf(stderr, "kfac_data_parallel: %s\n", load_error.c_str());
        return all_ranks(!missing) ? 1 : exit_skip;
    }
    const auto [train, test] = digits::train_test_split(all, s.seed);
    const matrix test_x = as_matrix(test.images, digits::pixels);

    random_source rng(s.seed);  // the same stream on every rank: same weights, same batches
    mlp model(s.widths, rng);
    broadcast_parameters(model);

    distributed_kfac precond(opts, kfac::comm::mpi(MPI_COMM_WORLD));
    register_mlp(precond, model);

    if (rank == 0) {
        std::printf("UCI digits: %zu training and %zu test images; MLP %s (ReLU); %d ranks, global batch %d "
                    "(about %d per rank)\n",
                    train.size(), test.size(), model.shape().c_str(), world, s.batch, s.batch / world);
        std::printf("SGD+K-FAC: lr %g, momentum %g; damping %g, kl_clip %g; strategy %s\n\n",
                    static_cast<double>(s.kfac_lr), static_cast<double>(s.kfac_momentum), s.damping, s.kl_clip,
                    strategy.c_str());
        std::printf("epoch  train loss  test acc    time\n");
    }

    std::vector<std::size_t> order = iota_order(train.size());
    const auto batch = static_cast<std::size_t>(s.batch);
    // A last batch with fewer images than ranks would leave a rank without data: dropped.
    std::size_t steps = order.size() / batch;
    if (order.size() % batch >= static_cast<std::size_t>(world)) ++steps;
    matrix xb, grad_logits;
    std::vector<int> yb;
    std::vector<float> buffer;
    double seconds = 0.0, acc = 0.0;
    // The ranks share the machine's cores: BLAS runs on one thread in each for the whole run,
    // the model's own products included (kfac does so during a step by itself). Measured: two
    // ranks on two cores took 9.6-11 s for the 2 epochs with OpenBLAS's pool of two threads in
    // each, spinning against the other rank, and 0.13 s with one.
    std::optional<distributed_kfac::backend_type::serial_blas_scope> one_blas_thread;
    if (world > 1) one_blas_thread.emplace();
    for (int epoch = 1; epoch <= s.epochs; ++epoch) {
        rng.shuffle(order);
        MPI_Barrier(MPI_COMM_WORLD);
        const auto start = std::chrono::steady_clock::now();
        double loss_sum = 0.0;  // this rank's summed per-image losses
        for (std::size_t step = 0; step < steps; ++step) {
            const std::size_t first = step * batch;
            const std::size_t count = std::min(order.size() - first, batch);
            // This rank's contiguous slice of the minibatch.
            const std::size_t lo = count * static_cast<std::size_t>(rank) / static_cast<std::size_t>(world);
            const std::size_t hi = count * static_cast<std::size_t>(rank + 1) / static_cast<std::size_t>(world);
            gather_batch(train.images, train.labels, digits::pixels, order, first + lo, hi - lo, xb, yb);
            const float local_mean = cross_entropy(model.forward(xb), yb, &grad_logits);
            loss_sum += static_cast<double>(local_mean) * static_cast<double>(hi - lo);
            // cross_entropy divides by the shard's size; the loss being minimised is the mean
            // over the whole minibatch, so each rank's share is scaled by shard / batch. Then
            // the sum of the ranks' gradients is the minibatch gradient, and the output
            // gradients K-FAC's G factor sees carry 1/batch exactly as in one process.
            grad_logits *= static_cast<float>(hi - lo) / static_cast<float>(count);
            model.backward(grad_logits);
            allreduce_gradients(model, buffer);
            model.point_views();
            precond.step();
            model.sgd_momentum_update(s.kfac_lr, s.kfac_momentum);
        }
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        MPI_Allreduce(MPI_IN_PLACE, &loss_sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        acc = accuracy(model.forward(test_x), test.labels);  // the same on every rank
        const double loss = loss_sum / static_cast<double>(std::min(order.size(), steps * batch));
        if (rank == 0) {
            std::printf("%5d    %.4f     %5.1f%%  %6.2fs\n", epoch, loss, 100.0 * acc, seconds);
            std::fflush(stdout);
        }
        if (!std::isfinite(loss)) {
            if (rank == 0) std::fprintf(stderr, "kfac_data_parallel: diverged at epoch %d\n", epoch);
            return 1;
        }
    }
    if (rank == 0) {
        std::printf("\nstrategy %s (kfac reports %s), %d ranks: final test accuracy %.1f%%, %.3f s per epoch\n",
                    strategy.c_str(), precond.strategy_name().c_str(), world, 100.0 * acc, seconds / s.epochs);
        std::printf("rank computing each layer's eigendecompositions (A, G):");
        for (std::size_t i = 0; i < model.layers.size(); ++i) {
            const auto w = precond.workers("fc" + std::to_string(i + 1));
            std::printf(" fc%zu (%d, %d)", i + 1, w.a, w.g);
        }
        std::printf("\n");
    }

    bool ok = true;
    if (check) {
        std::uint64_t lo = parameter_checksum(model), hi = lo;
        MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0) {
            if (lo == hi) std::printf("check: the weights are bit-identical on all %d ranks (checksum %016llx)\n",
                                      world, static_cast<unsigned long long>(lo));
            else std::printf("check FAILED: the ranks' weights differ (checksums from %016llx to %016llx)\n",
                             static_cast<unsigned long long>(lo), static_cast<unsigned long long>(hi));
        }
        ok = lo == hi;
    }
    if (expect_accuracy) {
        const bool reached = acc >= *expect_accuracy;
        if (rank == 0)
            std::printf("check%s: final test accuracy %.4f %s %.4f\n", reached ? "" : " FAILED", acc,
                        reached ? ">=" : "<", *expect_accuracy);
        ok = ok && reached;
    }
    return all_ranks(ok) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, world = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    int status = 1;
    try {
        status = run(argc, argv, rank, world);
    } catch (const std::exception& e) {
        // kfac raises its errors on every rank, so all of them get here and none is left
        // waiting in a collective.
        std::fprintf(stderr, "kfac_data_parallel (rank %d): %s\n", rank, e.what());
        status = 1;
    }
    MPI_Finalize();
    return status;
}
