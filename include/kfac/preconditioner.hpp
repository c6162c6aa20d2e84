// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file preconditioner.hpp
/// `kfac::preconditioner<Backend, CommPolicy, ComputeMethod, AssignmentStrategy>`: registers
/// layers through kfac::layer_traits and, at each step(), replaces their weight and bias
/// gradients in place by K-FAC preconditioned ones (golden/README.md is the contract).

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <regex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/assignment/strategies.hpp"
#include "kfac/config.hpp"
#include "kfac/detail/compute_impl.hpp"
#include "kfac/detail/layer_checks.hpp"
#include "kfac/fwd.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/options.hpp"

namespace kfac {

/// Something non-finite the preconditioner met and contained (see preconditioner::health).
struct non_finite_event {
    std::string layer;
    non_finite_source source;
    std::int64_t step;
};

/// Counters of contained non-finite values. Nothing non-finite ever reaches the gradients
/// the preconditioner writes: a bad factor statistic is not folded into the running factor,
/// a failed decomposition keeps the previous one, and a layer whose gradient (or
/// preconditioned gradient) is not finite gets a zero gradient for that step.
struct health_counters {
    std::int64_t skipped_factor_updates = 0;  ///< batch statistics with NaN/Inf, not applied
    std::int64_t kept_decompositions = 0;     ///< decompositions that failed; previous kept
    std::int64_t zeroed_gradients = 0;        ///< layers whose gradient was zeroed for a step
};

/// @tparam Backend storage and linear algebra (kfac::backend::cpu_eigen<Scalar>).
/// @tparam CommPolicy collectives (kfac::comm::serial).
/// @tparam ComputeMethod kfac::compute::eigendecomposition or kfac::compute::inverse.
/// @tparam AssignmentStrategy where second-order work runs (kfac::assignment::*).
template <class Backend, class CommPolicy, class ComputeMethod, class AssignmentStrategy>
class preconditioner {
    using method = detail::compute_impl<ComputeMethod, Backend>;

public:
    using backend_type = Backend;
    using scalar_type = typename Backend::scalar_type;
    using matrix = typename Backend::matrix;

    /// @throws kfac::error if an option is out of range or a skip pattern is not a regex.
    explicit preconditioner(options opts = {}, CommPolicy comm = {})
        : options_(std::move(opts)), comm_(std::move(comm)) {
        validate(options_);
        for (const auto& pattern : options_.skip_layers) {
            try {
                skip_patterns_.emplace_back(pattern, std::regex::ECMAScript);
            } catch (const std::regex_error& e) {
                throw error("options.skip_layers: '" + pattern +
                            "' is not a valid ECMAScript regular expression (" + e.what() + ")");
            }
        }
    }

    /// Registers a layer under a unique name. The preconditioner keeps a pointer to `layer`,
    /// which must outlive it. Register every layer before the first step().
    /// @return false if options.skip_layers matched the layer (it is then not registered).
    /// @throws kfac::error for a duplicate name, an invalid description, or registration
    ///         after the first step.
    template <class Layer>
    bool register_layer(const std::string& name, Layer& layer) {
        static_assert(detail::check_layer_adapter<Layer>());
        if constexpr (layer_adapter<Layer>) {
            using traits = layer_traits<Layer>;
            static_assert(std::is_same_v<typename traits::scalar_type, scalar_type>,
                          "kfac: the layer's layer_traits<Layer>::scalar_type differs from the "
                          "backend's scalar type; use kfac::backend::cpu_eigen<double> for double "
                          "layers and cpu_eigen<float> for float ones.");
            if (steps_ > 0 || started_)
                throw error("layer '" + name + "': register_layer() after the first accumulate() "
                            "or step(); register every layer before training starts");
            for (const auto& l : layers_)
                if (l.name == name)
                    throw error("layer '" + name + "' is already registered; give each layer a "
                                "unique name");
            const layer_description d = traits::describe(layer);
            if (skipped(name, d.kind)) return false;
            detail::check_description(name, d);
            layer_record r;
            r.name = name;
            r.description = d;
            r.layer = static_cast<void*>(&layer);
            r.activations = [](const void* p) {
                return tensor_view<const scalar_type>(traits::activations(*static_cast<const Layer*>(p)));
            };
            r.output_gradients = [](const void* p) {
                return tensor_view<const scalar_type>(traits::output_gradients(*static_cast<const Layer*>(p)));
            };
            r.weight_gradient = [](void* p) {
                return tensor_view<scalar_type>(traits::weight_gradient(*static_cast<Layer*>(p)));
            };
            r.bias_gradient = [](void* p) {
                return tensor_view<scalar_type>(traits::bias_gradient(*static_cast<Layer*>(p)));
            };
            const auto a = d.a_dim(), g = d.g_dim();
            r.a_factor = Backend::identity(a);
            r.g_factor = Backend::identity(g);
            r.a_sum = Backend::zeros(a, a);
            r.g_sum = Backend::zeros(g, g);
            layers_.push_back(std::move(r));
            return true;
        }
        return false;
    }

    /// Folds the current forward/backward pass into the batch statistics. With
    /// accumulation_steps = m, call it after each of the first m − 1 passes of a step; step()
    /// takes the last pass itself. Does nothing on steps that do not update factors.
    /// @throws kfac::error on a view that disagrees with its layer, or when called m times.
    void accumulate() {
        started_ = true;
        const std::int64_t k = steps_;
        if (!is_factor_update_step(k)) return;
        if (passes_ + 1 >= options_.accumulation_steps)
            throw error("accumulate() called " + std::to_string(passes_ + 1) +
                        " times in one step with accumulation_steps = " +
                        std::to_string(options_.accumulation_steps) +
                        "; call it after each of the first accumulation_steps - 1 passes only, "
                        "step() takes the last pass");
        capture_pass();
    }

    /// One preconditioning step: factor update (if due), second-order update (if due),
    /// preconditioning of every layer, kl_clip scaling, and the gradients written back.
    /// @throws kfac::error on a view that disagrees with its layer, on missing activations
    ///         on a factor-update step, or on a scheduled option out of range.
    void step() {
        started_ = true;
        const std::int64_t k = steps_;
        if (is_factor_update_step(k)) {
            capture_pass();
            if (passes_ != options_.accumulation_steps)
                throw error("step() after " + std::to_string(passes_) + " pass(es) with "
                            "accumulation_steps = " + std::to_string(options_.accumulation_steps) +
                            "; call accumulate() after each of the first accumulation_steps - 1 "
                            "forward/backward passes");
            update_factors(k);
        }
        const double damping = read_damping(k);
        if (k % read_interval(options_.inv_update_steps, k, "inv_update_steps") == 0)
            update_second_order(k, damping);
        precondition_all(k, damping);
        ++steps_;
    }

    /// Number of completed step() calls.
    [[nodiscard]] std::int64_t steps() const noexcept { return steps_; }
    [[nodiscard]] std::size_t layer_count() const noexcept { return layers_.size(); }
    [[nodiscard]] bool is_registered(const std::string& name) const {
        for (const auto& l : layers_)
            if (l.name == name) return true;
        return false;
    }
    /// Running A factor of a layer (the identity before its first update).
    [[nodiscard]] const matrix& a_factor(const std::string& name) const { return find(name).a_factor; }
    /// Running G factor of a layer.
    [[nodiscard]] const matrix& g_factor(const std::string& name) const { return find(name).g_factor; }
    /// ν of the last step (1 when kl_clip is off or did not bind).
    [[nodiscard]] double last_kl_scale() const noexcept { return last_kl_scale_; }
    [[nodiscard]] const health_counters& health() const noexcept { return health_; }
    /// Called (on the thread that runs step()) for every contained non-finite event.
    void on_non_finite(std::function<void(const non_finite_event&)> callback) {
        on_non_finite_ = std::move(callback);
    }
    [[nodiscard]] const options& get_options() const noexcept { return options_; }
    [[nodiscard]] const CommPolicy& comm() const noexcept { return comm_; }

private:
    struct layer_record {
        std::string name;
        layer_description description;
        void* layer = nullptr;
        tensor_view<const scalar_type> (*activations)(const void*) = nullptr;
        tensor_view<const scalar_type> (*output_gradients)(const void*) = nullptr;
        tensor_view<scalar_type> (*weight_gradient)(void*) = nullptr;
        tensor_view<scalar_type> (*bias_gradient)(void*) = nullptr;

        matrix a_factor, g_factor;  // running averages
        matrix a_sum, g_sum;        // this step's batch statistics (lower triangles)
        typename Backend::workspace backend_ws{};
        typename method::layer_data second{};
        bool has_second = false;
        typename method::workspace method_ws{};
        matrix gamma, preconditioned;
        bool usable = true;  // false: this step's gradient is zeroed
    };

    [[nodiscard]] bool skipped(const std::string& name, layer_kind kind) const {
        const char* lower = kind_name(kind);
        const char* pytorch = kind == layer_kind::linear ? "Linear" : "Conv2d";
        for (const auto& re : skip_patterns_)
            if (std::regex_search(name, re) || std::regex_search(lower, re) ||
                std::regex_search(pytorch, re))
                return true;
        return false;
    }

    [[nodiscard]] const layer_record& find(const std::string& name) const {
        for (const auto& l : layers_)
            if (l.name == name) return l;
        throw error("no layer named '" + name + "' is registered");
    }

    std::int64_t read_interval(const hyperparameter<std::int64_t>& h, std::int64_t k,
                               const char* what) const {
        const std::int64_t v = h(k);
        if (v <= 0)
            throw error(std::string("options.") + what + " evaluated to " + std::to_string(v) +
                        " at step " + std::to_string(k) + "; it must be a positive number of steps");
        return v;
    }

    bool is_factor_update_step(std::int64_t k) const {
        return k % read_interval(options_.factor_update_steps, k, "factor_update_steps") == 0;
    }

    double read_damping(std::int64_t k) const {
        const double d = options_.damping(k);
        if (!(d > 0.0))
            throw error("options.damping evaluated to " + std::to_string(d) + " at step " +
                        std::to_string(k) + "; damping must be > 0");
        return d;
    }

    void report(const layer_record& l, non_finite_source source, std::int64_t k) {
        if (on_non_finite_) on_non_finite_(non_finite_event{l.name, source, k});
    }

    void capture_pass() {
        const scalar_type beta = passes_ == 0 ? scalar_type(0) : scalar_type(1);
        for (auto& l : layers_) {
            const auto a = l.activations(l.layer);
            const auto g = l.output_gradients(l.layer);
            detail::check_statistics_views(l.name, l.description, a, g, steps_);
            Backend::accumulate_a_statistic(l.a_sum, l.description, a, options_.conv_patches,
                                             beta, l.backend_ws);
            Backend::accumulate_g_statistic(l.g_sum, l.description, g, beta, l.backend_ws);
        }
        ++passes_;
    }

    void update_factors(std::int64_t k) {
        const double decay = options_.factor_decay(k);
        if (!(decay >= 0.0 && decay < 1.0))
            throw error("options.factor_decay evaluated to " + std::to_string(decay) +
                        " at step " + std::to_string(k) + "; it must lie in [0, 1)");
        const auto xi = static_cast<scalar_type>(decay);
        const auto weight = static_cast<scalar_type>((1.0 - decay) / static_cast<double>(passes_));
        std::vector<matrix*> factors;
        for (auto& l : layers_) {
            if (Backend::lower_all_finite(l.a_sum) && Backend::lower_all_finite(l.g_sum)) {
                Backend::running_average(l.a_factor, l.a_sum, xi, weight);
                Backend::running_average(l.g_factor, l.g_sum, xi, weight);
            } else {
                ++health_.skipped_factor_updates;
                report(l, non_finite_source::factor_statistics, k);
            }
            factors.push_back(&l.a_factor);
            factors.push_back(&l.g_factor);
        }
        comm_.allreduce_average(factors);
        passes_ = 0;
    }

    void update_second_order(std::int64_t k, double damping) {
        for (auto& l : layers_) {
            typename method::layer_data next;
            if (method::compute_factor(l.a_factor, damping, next.a) &&
                method::compute_factor(l.g_factor, damping, next.g)) {
                method::finalize_layer(next, damping, options_);
                l.second = std::move(next);
                l.has_second = true;
            } else {
                ++health_.kept_decompositions;
                report(l, non_finite_source::decomposition, k);
            }
        }
    }

    void precondition_all(std::int64_t k, double damping) {
        const std::optional<double> kl_clip = options_.kl_clip(k);
        if (kl_clip && !(*kl_clip > 0.0))
            throw error("options.kl_clip evaluated to " + std::to_string(*kl_clip) + " at step " +
                        std::to_string(k) + "; it must be > 0 or std::nullopt");
        double vg_sum = 0.0;
        for (auto& l : layers_) {
            const auto w = l.weight_gradient(l.layer);
            const auto b = l.bias_gradient(l.layer);
            detail::check_gradient_views(l.name, l.description, w, b);
            Backend::load_gradient(l.gamma, as_const(w), as_const(b));
            l.usable = Backend::all_finite(l.gamma);
            if (l.usable) {
                if (l.has_second)
                    method::precondition(l.second, l.gamma, damping, options_, l.method_ws,
                                         l.preconditioned);
                else
                    l.preconditioned = l.gamma;  // no usable second-order data yet: plain SGD
                l.usable = Backend::all_finite(l.preconditioned);
            }
            if (!l.usable) {
                l.preconditioned = Backend::zeros(l.description.g_dim(), l.description.a_dim());
                ++health_.zeroed_gradients;
                report(l, non_finite_source::gradient, k);
                continue;
            }
            if (kl_clip) vg_sum += Backend::frobenius_dot(l.preconditioned, l.gamma);
        }
        double scale = 1.0;
        if (kl_clip) {
            const double lr = options_.lr(k);
            if (!(lr >= 0.0))
                throw error("options.lr evaluated to " + std::to_string(lr) + " at step " +
                            std::to_string(k) + "; it must be >= 0");
            vg_sum *= lr * lr;
            if (vg_sum != 0.0) scale = std::min(1.0, std::sqrt(*kl_clip / std::abs(vg_sum)));
        }
        last_kl_scale_ = scale;
        for (auto& l : layers_) {
            const auto w = l.weight_gradient(l.layer);
            const auto b = l.bias_gradient(l.layer);
            Backend::store_gradient(l.preconditioned, static_cast<scalar_type>(scale), w, b);
        }
    }

    options options_;
    CommPolicy comm_;
    std::vector<std::regex> skip_patterns_;
    std::vector<layer_record> layers_;
    std::int64_t steps_ = 0;
    std::int64_t passes_ = 0;  // forward/backward passes folded into the current statistics
    bool started_ = false;
    double last_kl_scale_ = 1.0;
    health_counters health_{};
    std::function<void(const non_finite_event&)> on_non_finite_;
};

}  // namespace kfac
