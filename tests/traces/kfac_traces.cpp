// SPDX-License-Identifier: Apache-2.0
// kfac_traces: step traces that a refactor of the preconditioner must reproduce bit for bit.
//
// One model holds every layer kind (Linear expand and reduce, Conv2d stride 1 and 2, grouped,
// depthwise, Conv1d, Embedding, LayerNorm, BatchNorm). Each configuration trains it for 12
// steps on seeded data, with a non-finite batch statistic at step 4 and a non-finite gradient
// at step 9, and prints one line per step: digests (64-bit FNV-1a) of the gradients written
// back, of save_bytes(), of layers(), and the health counters, eigenbasis_counts() and
// memory_usage(); under MPI also the communication counters of every rank.
//
//   kfac_traces                        every single-process configuration
//   kfac_traces --world-configurations the distributed set (under mpiexec -n W)
//   kfac_traces --save DIR             also saves the checkpointed configurations after step 5
//                                      (DIR/<configuration>.safetensors)
//   kfac_traces --resume DIR           the checkpointed configurations only: load each file,
//                                      print the digest of save_bytes() right after the load,
//                                      then steps 6 to 11
//
// The lines depend on the floating-point order of the BLAS in use, so they are compared
// between two builds on one machine (record before a change, replay after), or against the
// stored fixture by the Eigen-only build (tests/traces/CMakeLists.txt), whose order is fixed.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <Eigen/Core>

#include <kfac/detail/digest.hpp>
#include <kfac/kfac.hpp>
#if KFAC_TRACES_WITH_MPI
#include <mpi.h>

#include <kfac/comm/mpi.hpp>
#endif

#include "unit/test_util.hpp"

namespace {

using kfac_test::owned_layer;
using kfac_test::random_vector;

struct configuration {
    std::string name;
    bool use_float = false;
    bool eigen = true;
    std::int64_t accumulation = 1;
    bool kl_clip = true;
    bool outer_product = true;
    bool reuse = false;
    // Distributed only.
    kfac::distribution strategy = kfac::distribution::kaisa;
    double fraction = 1.0;
};

std::uint64_t digest_bytes(const void* p, std::size_t n) {
    return kfac::detail::digest().add_bytes(p, n).value();
}

template <class T>
std::uint64_t digest_vector(const std::vector<T>& v) {
    return digest_bytes(v.data(), v.size() * sizeof(T));
}

/// The model: every layer kind once (Linear twice, Conv2d four times), small enough that a
/// configuration's 12 steps take milliseconds.
template <class T>
std::vector<owned_layer<T>> make_model() {
    std::vector<owned_layer<T>> ls;
    auto linear = [&](kfac::weight_sharing s) {
        owned_layer<T> l;
        l.view.description = kfac::with_sharing(kfac::linear_description(6, 4, true), s);
        l.input_shape = {2, 3, 6};
        l.output_shape = {2, 3, 4};
        l.grad_weight.resize(24);
        l.grad_bias.resize(4);
        ls.push_back(std::move(l));
    };
    linear(kfac::weight_sharing::expand);
    linear(kfac::weight_sharing::reduce);
    auto conv = [&](std::int64_t c_in, std::int64_t c_out, std::int64_t stride, std::int64_t groups, bool bias) {
        kfac::conv2d_geometry g;
        g.kernel = {3, 3};
        g.stride = {stride, stride};
        g.padding = {1, 1};
        g.groups = groups;
        owned_layer<T> l;
        l.view.description = kfac::conv2d_description(c_in, c_out, g, bias);
        const std::int64_t o = kfac::conv_output_extent(5, 3, stride, 1, 1);
        l.input_shape = {2, c_in, 5, 5};
        l.output_shape = {2, c_out, o, o};
        l.grad_weight.resize(static_cast<std::size_t>(c_out * (c_in / groups) * 9));
        l.grad_bias.resize(static_cast<std::size_t>(c_out));
        ls.push_back(std::move(l));
    };
    conv(3, 4, 1, 1, true);   // stride 1 (the shifted-patch statistic)
    conv(3, 4, 2, 1, false);  // stride 2 (im2col)
    conv(4, 6, 1, 2, true);   // grouped
    conv(4, 4, 1, 4, true);   // depthwise
    {
        kfac::conv1d_geometry g;
        g.kernel = 3;
        g.padding = 1;
        owned_layer<T> l;
        l.view.description = kfac::conv1d_description(3, 4, g, true);
        l.input_shape = {2, 3, 6};
        l.output_shape = {2, 4, 6};
        l.grad_weight.resize(36);
        l.grad_bias.resize(4);
        ls.push_back(std::move(l));
    }
    {
        owned_layer<T> l;
        l.view.description = kfac::embedding_description(7, 4);
        l.input_shape = {2, 5};
        l.output_shape = {2, 5, 4};
        l.grad_weight.resize(28);
        ls.push_back(std::move(l));
    }
    {
        owned_layer<T> l;
        l.view.description = kfac::layer_norm_description(5, true);
        l.input_shape = l.output_shape = {3, 4, 5};
        l.grad_weight.resize(5);
        l.grad_bias.resize(5);
        ls.push_back(std::move(l));
    }
    {
        owned_layer<T> l;
        l.view.description = kfac::batch_norm_description(3, true);
        l.input_shape = l.output_shape = {4, 3, 2, 2};
        l.grad_weight.resize(3);
        l.grad_bias.resize(3);
        ls.push_back(std::move(l));
    }
    for (auto& l : ls) {
        auto count = [](const std::vector<std::int64_t>& s) {
            std::int64_t n = 1;
            for (auto e : s) n *= e;
            return static_cast<std::size_t>(n);
        };
        l.input.resize(count(l.input_shape));
        l.grad_output.resize(count(l.output_shape));
        l.bind();
        // A Conv1d's weight is [C_out, C_in / groups, k].
        const auto& d = l.view.description;
        if (d.kind == kfac::layer_kind::conv1d)
            l.view.grad_weight = kfac::tensor_view<T>(l.grad_weight.data(), {d.out, d.per_group(d.in), d.conv.kernel[1]});
    }
    return ls;
}

/// Fresh seeded data for pass `pass` of step `step` (every rank draws its own batch).
template <class T>
void fill(std::vector<owned_layer<T>>& ls, std::int64_t step, std::int64_t pass, int rank) {
    for (std::size_t i = 0; i < ls.size(); ++i) {
        auto& l = ls[i];
        const auto seed = static_cast<std::uint32_t>(1000003u * static_cast<std::uint32_t>(rank) + 7919u * i +
                                                     101u * static_cast<std::uint32_t>(step) +
                                                     13u * static_cast<std::uint32_t>(pass));
        auto refill = [](std::vector<T>& v, std::uint32_t s, double scale) {
            const auto r = random_vector<T>(v.size(), s, scale);
            std::copy(r.begin(), r.end(), v.begin());
        };
        if (l.view.description.kind == kfac::layer_kind::embedding) {
            const auto u = random_vector<double>(l.input.size(), seed);
            for (std::size_t k = 0; k < u.size(); ++k)
                l.input[k] = static_cast<T>(std::clamp<std::int64_t>(static_cast<std::int64_t>((u[k] + 2.0) * 1.75), 0, 6));
        } else {
            refill(l.input, seed, 1.0);
        }
        refill(l.grad_output, seed + 1, 0.5);
        refill(l.grad_weight, seed + 2, 0.1);
        refill(l.grad_bias, seed + 3, 0.1);
    }
    // A non-finite batch statistic (step 4: the update is skipped) and a non-finite gradient
    // (step 9: the layer's gradient is zeroed), on the first Linear layer of rank 0.
    if (rank == 0 && pass == 0 && step == 4) ls[0].input[1] = std::numeric_limits<T>::quiet_NaN();
    if (rank == 0 && step == 9) ls[0].grad_weight[2] = std::numeric_limits<T>::infinity();
}

kfac::options options_of(const configuration& c) {
    kfac::options o;
    o.damping = 0.003;
    o.factor_decay = 0.9;
    o.kl_clip = c.kl_clip ? std::optional<double>(0.01) : std::nullopt;
    o.lr = 0.2;
    o.inv_update_steps = std::int64_t{2};
    o.accumulation_steps = c.accumulation;
    o.compute_eigenvalue_outer_product = c.outer_product;
    o.eigenbasis_reuse_tolerance = c.reuse ? 0.2 : 0.0;
    o.threads = 1;
    o.strategy = c.strategy;
    o.grad_worker_fraction = c.fraction;
    o.colocate_factors = true;
    return o;
}

std::string hex(std::uint64_t v) {
    char b[17];
    std::snprintf(b, sizeof b, "%016" PRIx64, v);
    return b;
}

/// One line per step on this rank: what the step wrote and what the preconditioner reports.
/// What a run does besides stepping: save after step 5, or start from a saved file.
struct checkpointing {
    std::optional<std::filesystem::path> save_to, resume_from;
};

template <class T, class Comm, class Method>
std::vector<std::string> run(const configuration& c, Comm comm, int rank, const checkpointing& k) {
    kfac::KFAC<kfac::backend::cpu_eigen<T>, Comm, Method> p(options_of(c), std::move(comm));
    auto model = make_model<T>();
    static const char* const names[] = {"fc_expand", "fc_reduce", "conv_s1", "conv_s2", "conv_grouped",
                                        "conv_depthwise", "conv1d", "embedding", "layer_norm", "batch_norm"};
    for (std::size_t i = 0; i < model.size(); ++i) p.register_layer(names[i], model[i].view);
    std::vector<std::string> lines;
    std::int64_t first = 0;
    if (k.resume_from) {
        p.load(*k.resume_from);
        const std::string state = p.save_bytes();
        lines.push_back(c.name + " loaded steps=" + std::to_string(p.steps()) + " state=" +
                        hex(digest_bytes(state.data(), state.size())));
        first = p.steps();
    }
    for (std::int64_t step = first; step < 12; ++step) {
        for (std::int64_t pass = 0; pass < c.accumulation; ++pass) {
            fill(model, step, pass, rank);
            if (pass + 1 < c.accumulation) p.accumulate();
        }
        p.step();
        kfac::detail::digest grads;
        for (const auto& l : model) {
            grads.add(digest_vector(l.grad_weight));
            grads.add(digest_vector(l.grad_bias));
        }
        const std::string state = p.save_bytes();
        kfac::detail::digest layers;
        for (const auto& info : p.layers()) {
            layers.add(info.name).add(static_cast<int>(info.kind)).add(info.a_dim).add(info.g_dim).add(info.bias);
            layers.add(info.a_worker).add(info.g_worker);
            for (int r : info.factor_holders) layers.add(r);
            layers.add(-1);
            for (int r : info.grad_workers) layers.add(r);
        }
        const auto h = p.health();
        const auto b = p.eigenbasis_counts();
        const auto m = p.memory_usage();
        const auto& sent = p.comm().counters();
        char line[512];
        std::snprintf(line, sizeof line,
                      "%s step=%" PRId64 " grads=%s state=%s layers=%s health=%" PRId64 ",%" PRId64 ",%" PRId64
                      " bases=%" PRId64 ",%" PRId64 " memory=%zu,%zu,%zu,%zu kl=%a comm=%" PRId64 ",%" PRId64
                      ",%" PRId64 ",%" PRId64 ",%" PRId64,
                      c.name.c_str(), step, hex(grads.value()).c_str(), hex(digest_bytes(state.data(), state.size())).c_str(),
                      hex(layers.value()).c_str(), h.skipped_factor_updates, h.kept_decompositions, h.zeroed_gradients,
                      b.decomposed, b.reused, m.factors, m.statistics, m.second_order, m.gradients, p.last_kl_scale(),
                      sent.allreduce_calls, sent.allreduce_bytes, sent.broadcast_calls, sent.broadcast_bytes, sent.control_calls);
        lines.emplace_back(line);
        if (k.save_to && step == 5) p.save(*k.save_to);
    }
    return lines;
}

template <class Comm>
std::vector<std::string> run_configuration(const configuration& c, Comm comm, int rank, const checkpointing& k) {
    if (c.use_float)
        return c.eigen ? run<float, Comm, kfac::compute::eigendecomposition>(c, std::move(comm), rank, k)
                       : run<float, Comm, kfac::compute::inverse>(c, std::move(comm), rank, k);
    return c.eigen ? run<double, Comm, kfac::compute::eigendecomposition>(c, std::move(comm), rank, k)
                   : run<double, Comm, kfac::compute::inverse>(c, std::move(comm), rank, k);
}

/// The configurations whose state after step 5 is kept as a fixture: both scalar types, each
/// compute method and eigen variant, accumulation 2 (a checkpoint between steps of
/// accumulated passes), kl_clip on.
bool checkpointed(const configuration& c) {
    return c.accumulation == 2 && c.kl_clip;
}

/// One process: float/double x eigen (outer product on/off x eigenbasis reuse on/off) and
/// inverse x accumulation 1/2 x kl_clip on/off.
std::vector<configuration> serial_configurations() {
    std::vector<configuration> out;
    for (bool f : {false, true})
        for (std::int64_t acc : {1, 2})
            for (bool clip : {true, false}) {
                auto base = [&](std::string method) {
                    configuration c;
                    c.use_float = f;
                    c.accumulation = acc;
                    c.kl_clip = clip;
                    c.name = std::string(f ? "float" : "double") + "." + method + ".acc" + std::to_string(acc) +
                             (clip ? ".clip" : ".noclip");
                    return c;
                };
                for (bool outer : {true, false})
                    for (bool reuse : {false, true}) {
                        auto c = base(std::string("eigen") + (outer ? ".outer" : ".noouter") + (reuse ? ".reuse" : ""));
                        c.outer_product = outer;
                        c.reuse = reuse;
                        out.push_back(c);
                    }
                auto c = base("inverse");
                c.eigen = false;
                out.push_back(c);
            }
    return out;
}

/// Several processes: every KAISA strategy and DP-KFAC, both methods, double.
std::vector<configuration> world_configurations() {
    std::vector<configuration> out;
    const std::pair<const char*, double> fractions[] = {{"comm_opt", 1.0}, {"hybrid_opt", 0.5}, {"mem_opt", 0.0}};
    for (bool eigen : {true, false}) {
        const std::string method = eigen ? "eigen" : "inverse";
        for (const auto& [name, f] : fractions) {
            configuration c;
            c.eigen = eigen;
            c.fraction = f;
            c.name = "double." + method + "." + name;
            out.push_back(c);
        }
        configuration d;
        d.eigen = eigen;
        d.strategy = kfac::distribution::dp_kfac;
        d.name = "double." + method + ".dp_kfac";
        out.push_back(d);
    }
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    // Eigen blocks its matrix products by the cache sizes it detects; fixed sizes make the
    // Eigen-only build's floating-point order the same on every machine.
    Eigen::setCpuCacheSizes(32 * 1024, 512 * 1024, 8 * 1024 * 1024);
    bool world = false;
    checkpointing mode;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--world-configurations") world = true;
        else if ((arg == "--save" || arg == "--resume") && i + 1 < argc)
            (arg == "--save" ? mode.save_to : mode.resume_from) = std::filesystem::path(argv[++i]);
        else {
            std::fprintf(stderr, "kfac_traces: unknown argument '%s'\n"
                                 "usage: kfac_traces [--world-configurations] [--save DIR | --resume DIR]\n", argv[i]);
            return 2;
        }
    }
    int rank = 0;
#if KFAC_TRACES_WITH_MPI
    MPI_Init(&argc, &argv);
    int size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
#endif
    int status = 0;
    try {
        for (const auto& c : world ? world_configurations() : serial_configurations()) {
            checkpointing k;
            if (checkpointed(c) && mode.save_to) k.save_to = *mode.save_to / (c.name + ".safetensors");
            if (mode.resume_from) {
                if (!checkpointed(c)) continue;
                k.resume_from = *mode.resume_from / (c.name + ".safetensors");
            }
            if (!world) {
                for (const auto& line : run_configuration(c, kfac::comm::serial{}, rank, k))
                    if (rank == 0) std::printf("%s\n", line.c_str());
                continue;
            }
#if KFAC_TRACES_WITH_MPI
            const auto mine = run_configuration(c, kfac::comm::mpi(MPI_COMM_WORLD), rank, k);
            // Every rank's line, in rank order, printed by rank 0.
            for (const auto& line : mine) {
                std::vector<char> buffer(512, '\0');
                std::memcpy(buffer.data(), line.data(), std::min<std::size_t>(line.size(), 511));
                std::vector<char> all(rank == 0 ? buffer.size() * static_cast<std::size_t>(size) : 0);
                MPI_Gather(buffer.data(), 512, MPI_CHAR, all.data(), 512, MPI_CHAR, 0, MPI_COMM_WORLD);
                for (int r = 0; rank == 0 && r < size; ++r)
                    std::printf("rank%d %s\n", r, all.data() + static_cast<std::size_t>(r) * 512);
            }
#else
            throw kfac::error("--world-configurations: this kfac_traces was built without MPI");
#endif
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kfac_traces: %s\n", e.what());
        status = 1;
    }
#if KFAC_TRACES_WITH_MPI
    MPI_Finalize();
#endif
    return status;
}
