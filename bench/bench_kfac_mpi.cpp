// SPDX-License-Identifier: Apache-2.0
/// @file bench_kfac_mpi.cpp
/// K-FAC step time under MPI for every distribution strategy valid at the world size:
///
///   mpiexec -n W bench_kfac_mpi --model bench/models/resnet32_cifar10.txt
///           [--batch B (global, split evenly)] [--method eigen|inverse] [--iterations N]
///           [--bucket-cap-mb X (options.allreduce_bucket_cap_mb; default the library's)]
///
/// For each strategy: the median over N steps of the slowest rank's time (MPI_Wtime between
/// barriers) for an update step (factor_update_steps = inv_update_steps = 1) and for a
/// non-update step. float32, random activations and gradients of each layer's shapes. Rank 0
/// prints one JSON object per line; kfac_schedule_study --measured reads them. A first line
/// ("calibration") measures the machine at this world size for the study's cost model.
///
/// With --overlap, one line per KAISA strategy: the update step with
/// options.overlap_communication and options.overlap_factor_allreduce both off and both on,
/// interleaved, and for each the time the ranks
/// waited for the factor allreduce's buckets (overlapped with the averaging and the
/// decompositions of the layers already landed) and for the second-order broadcasts
/// (overlapped with preconditioning; comm_opt and hybrid_opt), and the fraction of each wait
/// hidden.
///
/// With --waits, one line instead: the time of a round of a step's control traffic (a little
/// work on each rank, an agreement and a broadcast of one number) through comm::mpi, which
/// waits by testing and yielding the processor, and through MPICH's blocking MPI_Allreduce and
/// MPI_Bcast, which poll without yielding: at more ranks than cores the ratio shows what the
/// yield is worth (docs/development.md, "Compile time").

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <kfac/comm/mpi.hpp>
#include <kfac/kfac.hpp>

#include "model_file.hpp"

namespace {

struct layer_buffers {
    kfac::layer_view<float> view;
    std::vector<float> input, grad_output, grad_weight, grad_bias, saved_weight, saved_bias;
};

std::vector<layer_buffers> make_buffers(const kfac_bench::model& m, std::int64_t local_batch, unsigned seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, std::size_t n, float scale) {
        v.resize(n);
        for (auto& x : v) x = scale * dist(gen);
    };
    std::vector<layer_buffers> out(m.layers.size());
    for (std::size_t i = 0; i < m.layers.size(); ++i) {
        const auto& l = m.layers[i];
        const auto& d = l.description;
        auto& b = out[i];
        b.view.description = d;
        const float g_scale = 1.0f / static_cast<float>(local_batch);
        if (d.kind == kfac::layer_kind::conv2d) {
            const auto ho = kfac::conv_output_extent(l.height, d.conv.kernel[0], d.conv.stride[0], d.conv.padding[0], 1);
            const auto wo = kfac::conv_output_extent(l.width, d.conv.kernel[1], d.conv.stride[1], d.conv.padding[1], 1);
            fill(b.input, static_cast<std::size_t>(local_batch * d.in * l.height * l.width), 1.0f);
            fill(b.grad_output, static_cast<std::size_t>(local_batch * d.out * ho * wo), g_scale);
            b.view.input = kfac::tensor_view<const float>(b.input.data(), {local_batch, d.in, l.height, l.width});
            b.view.grad_output = kfac::tensor_view<const float>(b.grad_output.data(), {local_batch, d.out, ho, wo});
        } else {
            const auto rows = local_batch * l.rows_per_sample;
            fill(b.input, static_cast<std::size_t>(rows * d.in), 1.0f);
            fill(b.grad_output, static_cast<std::size_t>(rows * d.out), g_scale);
            b.view.input = kfac::tensor_view<const float>(b.input.data(), {rows, d.in});
            b.view.grad_output = kfac::tensor_view<const float>(b.grad_output.data(), {rows, d.out});
        }
        fill(b.saved_weight, static_cast<std::size_t>(d.out * d.weight_columns()), 0.01f);
        fill(b.saved_bias, static_cast<std::size_t>(d.bias ? d.out : 0), 0.01f);
        // Gradients are data-parallel averages: the same on every rank.
        b.grad_weight = b.saved_weight;
        b.grad_bias = b.saved_bias;
        if (d.kind == kfac::layer_kind::conv2d)
            b.view.grad_weight = kfac::tensor_view<float>(b.grad_weight.data(), {d.out, d.per_group(d.in), d.conv.kernel[0], d.conv.kernel[1]});
        else
            b.view.grad_weight = kfac::tensor_view<float>(b.grad_weight.data(), {d.out, d.in});
        b.view.grad_bias = d.bias ? kfac::tensor_view<float>(b.grad_bias.data(), {d.out}) : kfac::tensor_view<float>{};
    }
    return out;
}

/// The gradients as make_buffers left them: every step starts from the same ones.
void restore_gradients(std::vector<layer_buffers>& buffers) {
    for (auto& b : buffers) {
        std::copy(b.saved_weight.begin(), b.saved_weight.end(), b.grad_weight.begin());
        std::copy(b.saved_bias.begin(), b.saved_bias.end(), b.grad_bias.begin());
    }
}

template <class Method>
double median_step_ms(const kfac_bench::model& m, std::int64_t local_batch, kfac::options o, int iterations,
                      bool update) {
    auto buffers = make_buffers(m, local_batch, 1234);
    if (!update) o.factor_update_steps = o.inv_update_steps = std::int64_t{1000000};
    kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::mpi, Method> p(o, kfac::comm::mpi(MPI_COMM_WORLD));
    for (std::size_t i = 0; i < buffers.size(); ++i) p.register_layer(m.layers[i].name, buffers[i].view);
    restore_gradients(buffers);
    p.step();  // warm-up: allocations, first decompositions
    std::vector<double> times;
    for (int it = 0; it < iterations; ++it) {
        restore_gradients(buffers);
        MPI_Barrier(MPI_COMM_WORLD);
        const double t0 = MPI_Wtime();
        p.step();
        double mine = MPI_Wtime() - t0, slowest = 0.0;
        MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        times.push_back(slowest * 1e3);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}

/// The update step with both overlaps off and on, interleaved step by step on
/// the same data (the machine's drift falls on both): the slowest rank's median step time of
/// each and the mean over ranks of the time spent waiting per step for the second-order
/// broadcasts (comm_counters::broadcast_wait_seconds) and for the factor allreduce's buckets
/// (allreduce_wait_seconds). A hidden fraction is the share of a wait that overlapping took
/// away.
struct overlap_row {
    double off_ms = 0, on_ms = 0, off_wait_ms = 0, on_wait_ms = 0, off_allreduce_ms = 0, on_allreduce_ms = 0;
};

template <class Method>
overlap_row measure_overlap(const kfac_bench::model& m, std::int64_t local_batch, kfac::options o, int iterations) {
    using preconditioner = kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::mpi, Method>;
    auto buffers = make_buffers(m, local_batch, 1234);
    kfac::options off = o, on = o;
    off.overlap_communication = false;
    off.overlap_factor_allreduce = false;
    on.overlap_communication = true;
    on.overlap_factor_allreduce = true;
    preconditioner p_off(off, kfac::comm::mpi(MPI_COMM_WORLD)), p_on(on, kfac::comm::mpi(MPI_COMM_WORLD));
    for (std::size_t i = 0; i < buffers.size(); ++i) {
        p_off.register_layer(m.layers[i].name, buffers[i].view);
        p_on.register_layer(m.layers[i].name, buffers[i].view);
    }
    int world = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    std::vector<double> times[2];
    double waits[2] = {0, 0}, allreduce_waits[2] = {0, 0};
    for (int it = -1; it < iterations; ++it) {  // it = -1: warm-up, not counted
        for (int k = 0; k < 2; ++k) {
            preconditioner& p = k == 0 ? p_off : p_on;
            restore_gradients(buffers);
            const auto before = p.comm().counters();
            MPI_Barrier(MPI_COMM_WORLD);
            const double t0 = MPI_Wtime();
            p.step();
            const auto& after = p.comm().counters();
            double mine[3] = {MPI_Wtime() - t0, after.broadcast_wait_seconds - before.broadcast_wait_seconds,
                              after.allreduce_wait_seconds - before.allreduce_wait_seconds};
            double slowest = 0, wait_sums[2] = {0, 0};
            MPI_Allreduce(&mine[0], &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            MPI_Allreduce(&mine[1], wait_sums, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
            if (it < 0) continue;
            times[k].push_back(slowest * 1e3);
            waits[k] += wait_sums[0] / world * 1e3;
            allreduce_waits[k] += wait_sums[1] / world * 1e3;
        }
    }
    for (auto& t : times) std::sort(t.begin(), t.end());
    return {times[0][times[0].size() / 2], times[1][times[1].size() / 2], waits[0] / iterations,
            waits[1] / iterations, allreduce_waits[0] / iterations, allreduce_waits[1] / iterations};
}

/// What this machine does to W ranks, measured with every rank busy at once (no K-FAC
/// step involved): the time of a fixed single-threaded SYRK (its ratio to W = 1 is the
/// compute slowdown of sharing the cores) and of a GEMM of a preconditioning shape (a
/// 576 × 576 eigenbasis times a 576 × 64 gradient), the per-message time of a batch of
/// small non-blocking broadcasts, and the bandwidth of a large allreduce. Measured in the
/// same run as the steps, so the study's rates describe the machine as the steps saw it.
struct machine_calibration {
    double kernel_ms = 0, gemm_ms = 0, message_s = 0, allreduce_bytes_per_s = 0, broadcast_bytes_per_s = 0;
    double empty_step_ms = 0;  ///< a K-FAC step of a 4 × 4 Linear layer: the per-step fixed cost
};

template <class F>
double slowest_median_s(F&& f, int reps) {
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double t0 = MPI_Wtime();
        f();
        double mine = MPI_Wtime() - t0, slowest = 0;
        MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        t.push_back(slowest);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

machine_calibration calibrate(int world) {
    using backend = kfac::backend::cpu_eigen<float>;
    machine_calibration c;
    const std::int64_t n = 288, rows = 8192;
    std::vector<float> x(static_cast<std::size_t>(n * rows), 0.5f);
    backend::matrix sum(n, n);
    {
        const backend::serial_blas_scope one_thread;
        c.kernel_ms = 1e3 * slowest_median_s([&] { backend::gram_of_cols(sum.data(), n, x.data(), n, rows, rows, 1.0f, 0.0f); }, 5);
        const backend::matrix q = backend::matrix::Random(576, 576), gamma = backend::matrix::Random(576, 64);
        backend::matrix out;
        c.gemm_ms = 1e3 * slowest_median_s([&] { backend::multiply(q, true, gamma, false, out); }, 9);
    }
    // The per-step fixed cost (checks, the agreement collective, task start-up, the ranks
    // meeting again after a step) as one non-update step of a model with one tiny layer.
    kfac_bench::model tiny;
    kfac_bench::model_layer layer;
    layer.name = "tiny";
    layer.description = kfac::linear_description(4, 4, true);
    tiny.layers.push_back(layer);
    c.empty_step_ms = median_step_ms<kfac::compute::eigendecomposition>(tiny, 4, kfac::options{}, 9, false);
    if (world == 1) return c;
    constexpr int messages = 32;
    std::vector<float> small(static_cast<std::size_t>(256 * messages));
    std::vector<MPI_Request> req(messages);
    c.message_s = slowest_median_s([&] {
        for (int m = 0; m < messages; ++m)
            MPI_Ibcast(small.data() + 256 * m, 256, MPI_FLOAT, m % world, MPI_COMM_WORLD, &req[static_cast<std::size_t>(m)]);
        MPI_Waitall(messages, req.data(), MPI_STATUSES_IGNORE);
    }, 9) / messages;
    std::vector<float> big(static_cast<std::size_t>(4) << 20, 1.0f);  // 16 MiB
    const double t = slowest_median_s([&] {
        MPI_Allreduce(MPI_IN_PLACE, big.data(), static_cast<int>(big.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }, 5);
    c.allreduce_bytes_per_s = static_cast<double>(big.size() * sizeof(float)) / t;
    // Large non-blocking broadcasts, as the second-order data and preconditioned gradients
    // travel: 32 messages of 128 KiB from rotating roots, then one wait.
    std::vector<float> payload(static_cast<std::size_t>(32) << 15);
    const double tb = slowest_median_s([&] {
        for (int m = 0; m < messages; ++m)
            MPI_Ibcast(payload.data() + (std::size_t{1} << 15) * static_cast<std::size_t>(m), 1 << 15, MPI_FLOAT,
                       m % world, MPI_COMM_WORLD, &req[static_cast<std::size_t>(m)]);
        MPI_Waitall(messages, req.data(), MPI_STATUSES_IGNORE);
    }, 5);
    c.broadcast_bytes_per_s = static_cast<double>(payload.size() * sizeof(float)) / tb;
    return c;
}

/// Microseconds per round of control traffic, through comm::mpi and through blocking MPI calls.
void print_waits(int world) {
    constexpr int rounds = 200;
    std::vector<float> work(4096, 1.0f);
    auto compute = [&] {  // about 10 µs of arithmetic, so that ranks arrive one after another
        for (int k = 0; k < 8; ++k)
            for (auto& x : work) x = x * 0.999f + 0.001f;
    };
    kfac::comm::mpi comm;
    float value = 1.0f;
    const double library = slowest_median_s([&] {
        for (int r = 0; r < rounds; ++r) {
            compute();
            (void)comm.agree(std::nullopt);
            comm.broadcast(&value, 1, r % world, comm.world());
            comm.wait();
        }
    }, 3);
    const double blocking = slowest_median_s([&] {
        for (int r = 0; r < rounds; ++r) {
            compute();
            int mine = world, first = world;
            MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
            MPI_Bcast(&value, 1, MPI_FLOAT, r % world, MPI_COMM_WORLD);
        }
    }, 3);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0)
        std::printf("{\"waits\": true, \"world\": %d, \"library_round_us\": %.2f, \"blocking_round_us\": %.2f, "
                    "\"blocking_over_library\": %.2f, \"work_checksum\": %.3f}\n",
                    world, 1e6 * library / rounds, 1e6 * blocking / rounds, blocking / library, work[0]);
}

}  // namespace

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, world = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    std::string model_path, method = "eigen";
    std::int64_t batch = 0;
    int iterations = 3;
    bool overlap = false;
    double bucket_cap_mb = kfac::options{}.allreduce_bucket_cap_mb;
    if (argc > 1 && std::string(argv[1]) == "--waits") {
        print_waits(world);
        MPI_Finalize();
        return 0;
    }
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--overlap") {
            overlap = true;
            continue;
        }
        if (i + 1 >= argc) break;
        const std::string value = argv[++i];
        if (arg == "--model") model_path = value;
        else if (arg == "--batch") batch = std::stoll(value);
        else if (arg == "--method") method = value;
        else if (arg == "--iterations") iterations = std::stoi(value);
        else if (arg == "--bucket-cap-mb") bucket_cap_mb = std::stod(value);
    }
    int status = 0;
    try {
        if (model_path.empty())
            throw kfac::error("usage: bench_kfac_mpi --model FILE [--batch B] [--method eigen|inverse] [--iterations N] "
                              "[--overlap] [--bucket-cap-mb X]");
        const auto m = kfac_bench::read_model(model_path);
        if (batch == 0) batch = m.batch;
        const std::int64_t local_batch = std::max<std::int64_t>(1, batch / world);
        const auto machine = overlap ? machine_calibration{} : calibrate(world);
        if (rank == 0 && !overlap)
            std::printf("{\"calibration\": true, \"world\": %d, \"kernel_ms\": %.4f, \"gemm_ms\": %.4f, "
                        "\"message_s\": %.4e, \"allreduce_bytes_per_s\": %.4e, \"broadcast_bytes_per_s\": %.4e, "
                        "\"empty_step_ms\": %.4f}\n",
                        world, machine.kernel_ms, machine.gemm_ms, machine.message_s, machine.allreduce_bytes_per_s,
                        machine.broadcast_bytes_per_s, machine.empty_step_ms);
        struct strategy {
            const char* name;
            kfac::distribution kind;
            double fraction;
        };
        for (const strategy s : {strategy{"comm_opt", kfac::distribution::kaisa, kfac::comm_opt},
                                 strategy{"hybrid_opt", kfac::distribution::kaisa, kfac::hybrid_opt},
                                 strategy{"mem_opt", kfac::distribution::kaisa, kfac::mem_opt},
                                 strategy{"dp_kfac", kfac::distribution::dp_kfac, 1.0}}) {
            // Skip fractions invalid at this size, and those that coincide with another strategy.
            if (s.kind == kfac::distribution::kaisa &&
                (!kfac::assignment::kaisa_grid::valid(world, s.fraction) ||
                 kfac::assignment::kaisa_grid(world, s.fraction).strategy_name() != std::string(s.name)))
                continue;
            kfac::options o;
            o.strategy = s.kind;
            o.grad_worker_fraction = s.fraction;
            o.damping = 0.003;
            o.allreduce_bucket_cap_mb = bucket_cap_mb;
            const bool eigen = method == "eigen";
            if (overlap) {
                // KAISA's strategies average factors (DP-KFAC sends each to its owner only).
                if (s.kind != kfac::distribution::kaisa) continue;
                const overlap_row r = eigen ? measure_overlap<kfac::compute::eigendecomposition>(m, local_batch, o, iterations)
                                            : measure_overlap<kfac::compute::inverse>(m, local_batch, o, iterations);
                if (rank == 0)
                    std::printf("{\"overlap\": true, \"model\": \"%s\", \"world\": %d, \"strategy\": \"%s\", "
                                "\"method\": \"%s\", \"global_batch\": %lld, \"update_ms_off\": %.3f, "
                                "\"update_ms_on\": %.3f, \"on_over_off\": %.3f, \"broadcast_wait_ms_off\": %.3f, "
                                "\"broadcast_wait_ms_on\": %.3f, \"hidden_fraction\": %.3f, "
                                "\"allreduce_wait_ms_off\": %.3f, \"allreduce_wait_ms_on\": %.3f, "
                                "\"allreduce_hidden_fraction\": %.3f}\n",
                                model_path.substr(model_path.find_last_of('/') + 1).c_str(), world, s.name,
                                method.c_str(), static_cast<long long>(batch), r.off_ms, r.on_ms, r.on_ms / r.off_ms,
                                r.off_wait_ms, r.on_wait_ms,
                                r.off_wait_ms > 0 ? 1.0 - r.on_wait_ms / r.off_wait_ms : 0.0, r.off_allreduce_ms,
                                r.on_allreduce_ms,
                                r.off_allreduce_ms > 0 ? 1.0 - r.on_allreduce_ms / r.off_allreduce_ms : 0.0);
                std::fflush(stdout);
                continue;
            }
            const double update = eigen ? median_step_ms<kfac::compute::eigendecomposition>(m, local_batch, o, iterations, true)
                                        : median_step_ms<kfac::compute::inverse>(m, local_batch, o, iterations, true);
            const double plain = eigen ? median_step_ms<kfac::compute::eigendecomposition>(m, local_batch, o, iterations, false)
                                       : median_step_ms<kfac::compute::inverse>(m, local_batch, o, iterations, false);
            if (rank == 0)
                std::printf("{\"model\": \"%s\", \"world\": %d, \"strategy\": \"%s\", \"method\": \"%s\", "
                            "\"global_batch\": %lld, \"threads\": %d, \"update_ms\": %.3f, \"non_update_ms\": %.3f}\n",
                            model_path.substr(model_path.find_last_of('/') + 1).c_str(), world, s.name,
                            method.c_str(), static_cast<long long>(batch), kfac::detail::default_thread_count(world),
                            update, plain);
            std::fflush(stdout);
        }
    } catch (const std::exception& e) {
        if (rank == 0) std::fprintf(stderr, "bench_kfac_mpi: %s\n", e.what());
        status = 1;
    }
    MPI_Finalize();
    return status;
}
