// SPDX-License-Identifier: Apache-2.0
#pragma once
// Test support for the CUDA backend on a GPU: host vectors copied to device memory, one layer's
// buffers for a CPU and a CUDA preconditioner side by side (the CUDA one reading host or device
// views of the same values), and the programs' main().

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include "support/catch_session.hpp"
#include "unit/layer_kinds.hpp"
#include "unit/test_util.hpp"

namespace kfac_test {

/// A host vector's contents in device memory, freed at scope exit.
template <class T>
struct device_copy {
    T* data = nullptr;
    explicit device_copy(const std::vector<T>& v) {
        REQUIRE(cudaMalloc(&data, v.size() * sizeof(T)) == cudaSuccess);
        upload(v);
    }
    /// The host vector's values into the same allocation (as many as it holds).
    void upload(const std::vector<T>& v) {
        REQUIRE(cudaMemcpy(data, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
    }
    device_copy(const device_copy&) = delete;
    device_copy& operator=(const device_copy&) = delete;
    ~device_copy() { cudaFree(data); }
    std::vector<T> to_host(std::size_t n) const {
        std::vector<T> h(n);
        REQUIRE(cudaMemcpy(h.data(), data, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
        return h;
    }
};

/// One layer's buffers for both preconditioners: the CPU one reads host copies, the GPU one
/// host or device views of the same values.
template <class T>
struct twin_layer {
    kfac_test::owned_layer<T> cpu, gpu;
    std::unique_ptr<device_copy<T>> a_dev, g_dev, w_dev, b_dev;

    void make_device_views() {
        a_dev = std::make_unique<device_copy<T>>(gpu.input);
        g_dev = std::make_unique<device_copy<T>>(gpu.grad_output);
        w_dev = std::make_unique<device_copy<T>>(gpu.grad_weight);
        gpu.view.input.data = a_dev->data;
        gpu.view.grad_output.data = g_dev->data;
        gpu.view.grad_weight.data = w_dev->data;
        gpu.view.input.space = gpu.view.grad_output.space = gpu.view.grad_weight.space = kfac::memory_space::device;
        if (gpu.view.description.bias) {
            b_dev = std::make_unique<device_copy<T>>(gpu.grad_bias);
            gpu.view.grad_bias.data = b_dev->data;
            gpu.view.grad_bias.space = kfac::memory_space::device;
        }
    }
    std::vector<T> gpu_weight_gradient() const {
        return w_dev ? w_dev->to_host(gpu.grad_weight.size()) : gpu.grad_weight;
    }
    std::vector<T> gpu_bias_gradient() const { return b_dev ? b_dev->to_host(gpu.grad_bias.size()) : gpu.grad_bias; }
    /// New gradients, the same on both sides (and in the device copies).
    void refill_gradients(std::uint32_t seed) {
        kfac_test::refill_gradients(cpu, seed);
        kfac_test::refill_gradients(gpu, seed);
        if (w_dev) w_dev->upload(gpu.grad_weight);
        if (b_dev) b_dev->upload(gpu.grad_bias);
    }
};

/// main() of a GPU test program: the Catch2 session, or, without a CUDA device, a message and
/// 77, which CTest reports as skipped.
inline int run_gpu_tests(int argc, char** argv) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        (void)cudaGetLastError();
        std::printf("SKIPPED: no CUDA device is present (cudaGetDeviceCount reports none); "
                    "the CUDA backend tests need a GPU\n");
        return 77;
    }
    return run_catch_session(argc, argv);
}

}  // namespace kfac_test
