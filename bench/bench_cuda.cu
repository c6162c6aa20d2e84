// SPDX-License-Identifier: Apache-2.0
/// @file bench_cuda.cu
/// The CUDA backend on a GPU (a plain CLI; JSON lines on stdout):
///
///   bench_cuda --model bench/models/resnet32_cifar10.txt [--model ...] [--batch B]
///              [--iterations N] [--eigen-sizes 64,128,...] [--double] [--linear-only]
///
/// * eigensolver sweep: backend::cuda<T>::symmetric_eigen and damped_inverse on Wishart
///   matrices X Xᵀ/n + 1e-3 I of each size (median of N, after one warm-up; --eigen-sizes ''
///   skips it);
/// * K-FAC steps per model: update step (factor statistics, decompositions,
///   preconditioning) and non-update step, eigendecomposition and inverse methods, with the
///   layers' buffers in device memory (device views, as a GPU framework hands them over),
///   and what one step of each kind costs in host synchronisations and host↔device copies
///   (backend::cuda<T>::transfers()); the eigen method once more with small factors decomposed
///   one by one ("batched": false; cuda<T>::batch_small_factors); EKFAC on the model's Linear
///   and Conv2d layers (the kinds it preconditions; float only). --linear-only keeps the
///   Linear and Conv2d layers, the ones kfac-pytorch preconditions (bench/side_by_side_gpu.py).
/// Options as kfac-pytorch's defaults where the side-by-side compares them: damping 0.003,
/// factor_decay 0.95, kl_clip 0.001, lr 0.1, compute_eigenvalue_outer_product.
/// Times are wall-clock around the call after cudaDeviceSynchronize on both sides. Without a
/// GPU it says so and exits 77. bench/torch_eigh.py times torch.linalg.eigh on the same sizes.

#include <algorithm>
#include <chrono>
#include <memory>
#include <type_traits>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <kfac/backend/cuda.cuh>
#include <kfac/kfac.hpp>

#include "model_file.hpp"

namespace {

template <class T>
struct device_array {
    T* data = nullptr;
    std::size_t size = 0;
    device_array(std::size_t n, std::mt19937& gen, double scale) : device_array(normal(n, gen, scale)) {}
    explicit device_array(const std::vector<T>& h) : size(h.size()) {
        kfac::backend::cuda_detail::check(cudaMalloc(&data, size * sizeof(T)), "cudaMalloc");
        kfac::backend::cuda_detail::check(cudaMemcpy(data, h.data(), size * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
    }
    static std::vector<T> normal(std::size_t n, std::mt19937& gen, double scale) {
        std::normal_distribution<double> dist(0.0, scale);
        std::vector<T> h(n);
        for (auto& x : h) x = static_cast<T>(dist(gen));
        return h;
    }
    device_array(const device_array&) = delete;
    device_array& operator=(const device_array&) = delete;
    ~device_array() { cudaFree(data); }
};

template <class F>
double median_ms(int iterations, F&& f) {
    f();  // warm-up: allocations, handles, first decompositions
    std::vector<double> t;
    for (int i = 0; i < iterations; ++i) {
        cudaDeviceSynchronize();
        const auto t0 = std::chrono::steady_clock::now();
        f();
        cudaDeviceSynchronize();
        t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

template <class T>
void eigensolver_sweep(const std::vector<std::int64_t>& sizes, int iterations) {
    using gpu = kfac::backend::cuda<T>;
    for (const auto n : sizes) {
        std::mt19937 gen(7);
        std::normal_distribution<double> dist(0.0, 1.0);
        typename gpu::host_matrix x(n, n);
        for (std::int64_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<T>(dist(gen));
        typename gpu::host_matrix m = x * x.transpose() / static_cast<T>(n);
        m.diagonal().array() += T(1e-3);
        const auto md = gpu::from_host(m);
        typename gpu::matrix q, inv;
        typename gpu::vector lambda;
        const double eig = median_ms(iterations, [&] { gpu::symmetric_eigen(md, q, lambda); });
        const double inverse = median_ms(iterations, [&] { gpu::damped_inverse(md, T(1e-3), inv); });
        std::printf("{\"bench\": \"eigensolver\", \"dtype\": \"%s\", \"n\": %lld, \"syevd_ms\": %.4f, \"inverse_ms\": %.4f}\n",
                    sizeof(T) == 4 ? "float32" : "float64", static_cast<long long>(n), eig, inverse);
        std::fflush(stdout);
    }
}

template <class T, class Method>
void kfac_steps(const kfac_bench::model& m, const std::string& name, std::int64_t batch, int iterations,
                bool batched = true) {
    std::mt19937 gen(1234);
    std::vector<kfac::layer_view<T>> views(m.layers.size());
    std::vector<std::unique_ptr<device_array<T>>> keep;
    for (std::size_t i = 0; i < m.layers.size(); ++i) {
        const auto& l = m.layers[i];
        const auto& d = l.description;
        auto& v = views[i];
        v.description = d;
        auto add = [&](std::size_t n, double scale) {
            keep.push_back(std::make_unique<device_array<T>>(n, gen, scale));
            return keep.back()->data;
        };
        const auto dev = kfac::memory_space::device;
        if (d.kind == kfac::layer_kind::embedding) {  // ids [batch, rows], uniform over the vocabulary
            const auto rows = l.rows_per_sample;
            std::uniform_int_distribution<std::int64_t> token(0, d.in - 1);
            std::vector<T> ids(static_cast<std::size_t>(batch * rows));
            for (auto& id : ids) id = static_cast<T>(token(gen));
            keep.push_back(std::make_unique<device_array<T>>(ids));
            v.input = {keep.back()->data, {batch, rows}, dev};
            v.grad_output = {add(static_cast<std::size_t>(batch * rows * d.out), 1.0 / batch), {batch, rows, d.out}, dev};
            v.grad_weight = {add(static_cast<std::size_t>(d.in * d.out), 0.01), {d.in, d.out}, dev};
        } else if (d.kind == kfac::layer_kind::layer_norm) {  // x̂ and dy [batch·rows, C]
            const auto rows = batch * l.rows_per_sample;
            v.input = {add(static_cast<std::size_t>(rows * d.out), 1.0), {rows, d.out}, dev};
            v.grad_output = {add(static_cast<std::size_t>(rows * d.out), 1.0 / batch), {rows, d.out}, dev};
            v.grad_weight = {add(static_cast<std::size_t>(d.out), 0.01), {d.out}, dev};
        } else if (d.kind == kfac::layer_kind::conv2d) {
            const auto ho = kfac::conv_output_extent(l.height, d.conv.kernel[0], d.conv.stride[0], d.conv.padding[0], 1);
            const auto wo = kfac::conv_output_extent(l.width, d.conv.kernel[1], d.conv.stride[1], d.conv.padding[1], 1);
            v.input = {add(static_cast<std::size_t>(batch * d.in * l.height * l.width), 1.0), {batch, d.in, l.height, l.width}, dev};
            v.grad_output = {add(static_cast<std::size_t>(batch * d.out * ho * wo), 1.0 / batch), {batch, d.out, ho, wo}, dev};
            v.grad_weight = {add(static_cast<std::size_t>(d.out * d.weight_columns()), 0.01), {d.out, d.per_group(d.in), d.conv.kernel[0], d.conv.kernel[1]}, dev};
        } else {
            const auto rows = batch * l.rows_per_sample;
            v.input = {add(static_cast<std::size_t>(rows * d.in), 1.0), {rows, d.in}, dev};
            v.grad_output = {add(static_cast<std::size_t>(rows * d.out), 1.0 / batch), {rows, d.out}, dev};
            v.grad_weight = {add(static_cast<std::size_t>(d.out * d.in), 0.01), {d.out, d.in}, dev};
        }
        if (d.bias) v.grad_bias = {add(static_cast<std::size_t>(d.out), 0.01), {d.out}, dev};
    }
    for (bool update : {true, false}) {
        kfac::options o;
        o.damping = 0.003;
        o.factor_decay = 0.95;
        o.kl_clip = 0.001;
        o.lr = 0.1;
        o.compute_eigenvalue_outer_product = true;
        if (!update) o.factor_update_steps = o.inv_update_steps = std::int64_t{1000000};
        kfac::backend::cuda<T>::batch_small_factors(batched);
        kfac::KFAC<kfac::backend::cuda<T>, kfac::comm::serial, Method> p(o);
        for (std::size_t i = 0; i < views.size(); ++i) p.register_layer(m.layers[i].name, views[i]);
        // Preconditioning rewrites the gradients in place; their scale does not change the work.
        const double ms = median_ms(iterations, [&] { p.step(); });
        const auto before = kfac::backend::cuda<T>::transfers();
        p.step();  // one more of the same kind, counted
        const auto cost = kfac::backend::cuda<T>::transfers() - before;
        // The counted step's phases as the host saw them (preconditioner::last_step_times()).
        std::string phases;
        for (std::size_t i = 0; i < kfac::step_phase_count; ++i) {
            char entry[64];
            std::snprintf(entry, sizeof entry, "%s\"%s\": %.3f", i ? ", " : "",
                          kfac::step_phase_name(static_cast<kfac::step_phase>(i)), p.last_step_times().seconds[i] * 1e3);
            phases += entry;
        }
        std::printf("{\"bench\": \"kfac_step\", \"model\": \"%s\", \"dtype\": \"%s\", \"method\": \"%s\", \"batch\": %lld, "
                    "\"layers\": %zu, \"batched\": %s, \"step\": \"%s\", \"ms\": %.3f, \"synchronizations\": %lld, "
                    "\"device_to_host\": %lld, \"host_to_device\": %lld, \"phases_ms\": {%s}}\n",
                    name.c_str(), sizeof(T) == 4 ? "float32" : "float64",
                    std::is_same_v<Method, kfac::compute::eigendecomposition> ? "eigen" : Method::name,
                    static_cast<long long>(batch), views.size(), batched ? "true" : "false", update ? "update" : "non_update", ms,
                    static_cast<long long>(cost.synchronizations), static_cast<long long>(cost.device_to_host),
                    static_cast<long long>(cost.host_to_device), phases.c_str());
        std::fflush(stdout);
    }
}

/// The model's Linear and Conv2d layers: what kfac-pytorch preconditions.
kfac_bench::model linear_and_conv_only(kfac_bench::model m) {
    std::erase_if(m.layers, [](const kfac_bench::model_layer& l) {
        return l.description.kind != kfac::layer_kind::linear && l.description.kind != kfac::layer_kind::conv2d;
    });
    return m;
}

template <class T>
int run(const std::vector<std::string>& models, std::int64_t batch, int iterations, const std::vector<std::int64_t>& sizes,
        bool linear_only) {
    eigensolver_sweep<T>(sizes, iterations);
    for (const auto& path : models) {
        auto m = kfac_bench::read_model(path);
        if (linear_only) m = linear_and_conv_only(std::move(m));
        const std::string name = path.substr(path.find_last_of('/') + 1);
        kfac_steps<T, kfac::compute::eigendecomposition>(m, name, batch ? batch : m.batch, iterations);
        // Small factors decomposed one by one: the other way of issue 28's measurement.
        kfac_steps<T, kfac::compute::eigendecomposition>(m, name, batch ? batch : m.batch, iterations, false);
        kfac_steps<T, kfac::compute::inverse>(m, name, batch ? batch : m.batch, iterations);
        // EKFAC (its scaling re-estimated at every factor update) on the layers it preconditions,
        // in float (an instantiation in double would cost every build ~10 s of nvcc for a
        // figure no check reads).
        if constexpr (std::is_same_v<T, float>)
            kfac_steps<T, kfac::compute::ekfac>(linear_and_conv_only(m), name, batch ? batch : m.batch, iterations);
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<std::string> models;
    std::int64_t batch = 0;
    int iterations = 5;
    bool use_double = false, linear_only = false;
    std::vector<std::int64_t> sizes = {64, 128, 256, 577, 1024, 2048, 4608};
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
        if (arg == "--model") models.push_back(value());
        else if (arg == "--batch") batch = std::stoll(value());
        else if (arg == "--iterations") iterations = std::stoi(value());
        else if (arg == "--double") use_double = true;
        else if (arg == "--linear-only") linear_only = true;
        else if (arg == "--eigen-sizes") {
            sizes.clear();
            std::stringstream s(value());
            for (std::string item; std::getline(s, item, ',');)
                if (!item.empty()) sizes.push_back(std::stoll(item));
        } else {
            std::fprintf(stderr, "bench_cuda: unknown argument '%s'\n", arg.c_str());
            return 2;
        }
    }
    if (kfac::backend::cuda_device_count() == 0) {
        std::printf("SKIPPED: no CUDA device is present; bench_cuda needs a GPU\n");
        return 77;
    }
    try {
        return use_double ? run<double>(models, batch, iterations, sizes, linear_only)
                          : run<float>(models, batch, iterations, sizes, linear_only);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_cuda: %s\n", e.what());
        return 1;
    }
}
