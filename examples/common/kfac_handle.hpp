// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kfac_handle.hpp
/// The examples' preconditioner behind one type, whichever backend it runs on: the CPU
/// backend, or backend::cuda in a translation unit of its own (kfac_handle_cuda.cu, compiled by
/// nvcc), since LibTorch's headers do not compile under nvcc in C++20. The LibTorch side sees
/// only this class; the tracked layers cross the seam as kfac::any_layer<float>.
///
/// ```
///   std::unique_ptr<kfac_examples::kfac_handle> p = kfac_examples::make_kfac(opts, on_gpu);
///   kfac::torch::register_modules(*p, tracker, model);   // as with a kfac::KFAC
/// ```

#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <kfac/kfac.hpp>

namespace kfac_examples {

/// What the examples call on a preconditioner (kfac::KFAC's members of the same names).
class kfac_handle {
public:
    virtual ~kfac_handle() = default;

    [[nodiscard]] virtual const kfac::options& get_options() const = 0;
    [[nodiscard]] virtual bool is_registered(const std::string& name) const = 0;
    virtual void on_non_finite(std::function<void(const kfac::non_finite_event&)> callback) = 0;
    virtual kfac::step_result step() = 0;
    virtual void save(const std::filesystem::path& path) = 0;
    virtual void load(const std::filesystem::path& path) = 0;
    [[nodiscard]] virtual std::int64_t steps() const = 0;
    [[nodiscard]] virtual kfac::health_counters health() const = 0;
    [[nodiscard]] virtual kfac::eigenbasis_count eigenbasis_counts() const = 0;
    [[nodiscard]] virtual std::vector<kfac::layer_curvature> curvature() const = 0;
    /// The backend's name, for the examples' summaries.
    [[nodiscard]] virtual std::string backend_name() const = 0;

    /// kfac::KFAC::register_layers for any adapted layer type (kfac::torch::register_modules
    /// calls it): the layers are kept as kfac::any_layer, which refer to them.
    template <class Layer>
    std::size_t register_layers(const std::vector<std::pair<std::string, Layer*>>& list) {
        std::vector<std::pair<std::string, kfac::any_layer<float>*>> erased;
        const std::size_t kept = erased_.size();
        for (const auto& [name, layer] : list) {
            erased_.emplace_back(*layer);
            erased.emplace_back(name, &erased_.back());
        }
        try {
            return register_erased(erased);
        } catch (...) {
            while (erased_.size() > kept) erased_.pop_back();  // all or none, as the preconditioner's own registration
            throw;
        }
    }

protected:
    virtual std::size_t register_erased(const std::vector<std::pair<std::string, kfac::any_layer<float>*>>& list) = 0;

private:
    std::deque<kfac::any_layer<float>> erased_;  // stable addresses: the preconditioner keeps them
};

/// kfac_handle over a kfac::KFAC instance P (constructed from the arguments given).
template <class P>
class held_kfac final : public kfac_handle {
public:
    template <class... Args>
    explicit held_kfac(std::string backend, Args&&... args) : backend_(std::move(backend)), p_(std::forward<Args>(args)...) {}

    [[nodiscard]] const kfac::options& get_options() const override { return p_.get_options(); }
    [[nodiscard]] bool is_registered(const std::string& name) const override { return p_.is_registered(name); }
    void on_non_finite(std::function<void(const kfac::non_finite_event&)> callback) override {
        p_.on_non_finite(std::move(callback));
    }
    kfac::step_result step() override { return p_.step(); }
    void save(const std::filesystem::path& path) override { p_.save(path); }
    void load(const std::filesystem::path& path) override { p_.load(path); }
    [[nodiscard]] std::int64_t steps() const override { return p_.steps(); }
    [[nodiscard]] kfac::health_counters health() const override { return p_.health(); }
    [[nodiscard]] kfac::eigenbasis_count eigenbasis_counts() const override { return p_.eigenbasis_counts(); }
    [[nodiscard]] std::vector<kfac::layer_curvature> curvature() const override { return p_.curvature(); }
    [[nodiscard]] std::string backend_name() const override { return backend_; }

protected:
    std::size_t register_erased(const std::vector<std::pair<std::string, kfac::any_layer<float>*>>& list) override {
        return p_.register_layers(list);
    }

private:
    std::string backend_;
    P p_;
};

/// A preconditioner on the CPU backend, with the compute method Method.
template <class Method = kfac::compute::eigendecomposition>
std::unique_ptr<kfac_handle> make_cpu_kfac(const kfac::options& opts) {
    return std::make_unique<held_kfac<kfac::KFAC<kfac::backend::cpu_eigen<float>, kfac::comm::serial, Method>>>(
        "cpu_eigen<float>", opts);
}

/// A preconditioner on backend::cuda<float> (kfac_handle_cuda.cu; programs built with nvcc
/// define KFAC_EXAMPLE_CUDA and link it).
std::unique_ptr<kfac_handle> make_cuda_kfac(const kfac::options& opts);

/// Whether this program can precondition on a GPU (it links kfac_handle_cuda.cu).
#ifdef KFAC_EXAMPLE_CUDA
inline constexpr bool built_with_cuda = true;
#else
inline constexpr bool built_with_cuda = false;
#endif

/// A preconditioner on the GPU or on the CPU; on the GPU only in a program built with nvcc
/// (the programs refuse --device cuda by name before they get here otherwise).
inline std::unique_ptr<kfac_handle> make_kfac(const kfac::options& opts, bool on_gpu) {
#ifdef KFAC_EXAMPLE_CUDA
    if (on_gpu) return make_cuda_kfac(opts);
#else
    if (on_gpu) throw kfac::error("kfac_examples::make_kfac: a GPU preconditioner in a program built without nvcc");
#endif
    return make_cpu_kfac(opts);
}

}  // namespace kfac_examples
