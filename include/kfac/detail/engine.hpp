// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine.hpp
/// The engine behind kfac::preconditioner (as cuCollections' static_map forwards to its
/// open_addressing_impl): the registered layers, the options and the communicator, and one
/// named member per phase of a step. This header declares them; the phases are defined out
/// of the class, one room each, so that a translation unit which instantiates the engine
/// explicitly compiles them once for every program that declares that instance extern:
///
///   engine_registration.hpp   layers in: checks, skip/reduce filters, records
///   engine_setup.hpp          construction, configuration agreement, placement, reports
///   engine_read.hpp           the plan phase: scheduled values and the host's views, agreed
///   engine_factors.hpp        capture, end of pass, running factor averages
///   engine_second_order.hpp   decompositions or inverses, shared by their owners
///   engine_precondition.hpp   preconditioning, kl_clip, write-back, commit
///   engine_checkpoint.hpp     save and load: the records' state gathered into a
///                             checkpoint::state_dict by the plan, and scattered back
///
/// The assignment strategy is not a template argument of the engine: it reaches the planner
/// as a value (assignment_policy), so one engine serves all three strategies. What depends on
/// a layer's factor structure is its block's (kfac/blocks/block.hpp): no phase branches on it.
///
/// **Collective order.** Every rank issues the same collectives in the same order, or a
/// collective waits forever. A phase's collectives, in the order its member issues them
/// (agree: an agree_on() vote, an allreduce of the first failure; one group is the world unless
/// named):
///
///   setup (once)        agree (threads), configuration digest (allgather; on a difference a
///                       broadcast and an agree), agree (placement), split (column group),
///                       split (gradient group, KAISA)
///   read_plan           agree (options and views), scheduled values' digest (as the
///                       configuration's, when a schedule is set), allreduce_max (which layers
///                       have gradients)
///   finish_pass         agree (statistics, factor-update steps), agree (end_pass)
///   update_factors      allreduce_sum of every statistic and the rows weights, bucketed (KAISA
///                       with several ranks; none otherwise); with options.overlap_factor_allreduce
///                       the same buckets started by finish_pass (after an allreduce_sum of the
///                       rows weights alone, before its agreements) as the statistics come to
///                       exist, and completed here one by one
///   update_second_order agree (decompositions), then per layer in registration order whose data
///                       is shared: broadcasts of the A payloads, then the G payloads (column group)
///   update_scaling      compute::ekfac with several ranks under KAISA on factor-update steps:
///                       the second-order broadcasts completed; with columns of fewer ranks than
///                       the world (HYBRID_OPT, MEM_OPT) an allreduce_max (which layers hold
///                       data), then per such layer in order broadcasts of Q_A and Q_G from its A
///                       and G workers to the world; then an allreduce_sum of every layer's
///                       scaling estimate (times its examples) and the examples, bucketed
///   precondition_all    agree (preconditioning), per layer in order whose gradient is shared:
///                       a broadcast of Pᵀ (gradient group), then allreduce_max (unusable layers)
///   kl_clip_scale, commit: none (every rank holds every Pᵀ)
///   write_back          allreduce_max (layers whose ν·Pᵀ is beyond a gradient view's format),
///                       only when some rank has a gradient view narrower than the compute type
///                       (which precondition_all's vote tells every rank)

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <istream>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kfac/assignment/distribution_plan.hpp"
#include "kfac/assignment/placement_costs.hpp"
#include "kfac/backend/gradient_checks.hpp"
#include "kfac/blocks/kinds.hpp"
#include "kfac/checkpoint/format.hpp"
#include "kfac/checkpoint/state_dict.hpp"
#include "kfac/comm/posted_allreduce.hpp"
#include "kfac/comm/serial.hpp"
#include "kfac/config.hpp"
#include "kfac/detail/compute_impl.hpp"
#include "kfac/detail/checkpoint_io.hpp"
#include "kfac/detail/configuration_check.hpp"
#include "kfac/detail/host_staging.hpp"
#include "kfac/detail/layer_checks.hpp"
#include "kfac/detail/layer_patterns.hpp"
#include "kfac/detail/layer_record.hpp"
#include "kfac/detail/step_plan.hpp"
#include "kfac/detail/task_parallel.hpp"
#include "kfac/curvature_report.hpp"
#include "kfac/health.hpp"
#include "kfac/layer_info.hpp"
#include "kfac/options.hpp"

namespace kfac::detail {

/// An assignment strategy as a value: its name (part of the configuration every rank agrees
/// on) and the planner instantiated for it.
struct assignment_policy {
    const char* name = nullptr;
    assignment::distribution_plan (*plan)(const assignment::block_costs& costs, int world, distribution strategy,
                                          double grad_worker_fraction, bool colocate_factors) = nullptr;
};

template <class AssignmentStrategy>
assignment_policy assignment_policy_of() {
    return {AssignmentStrategy::name, &assignment::plan_distribution<AssignmentStrategy>};
}

/// Whether a compute method re-estimates a scaling at factor updates (compute::ekfac).
template <class Method>
concept method_estimating_scaling = requires { Method::estimates_scaling; };

template <class Backend, class CommPolicy, class ComputeMethod>
class engine {
public:
    using backend_type = Backend;
    using compute_method = ComputeMethod;
    using method = compute_impl<ComputeMethod, Backend>;
    using scalar_type = typename Backend::scalar_type;
    using matrix = typename Backend::matrix;
    using layer_record = detail::layer_record<Backend, method>;

    /// Validates the options and compiles the skip/reduce patterns, agreed by every rank.
    engine(options opts, CommPolicy comm, assignment_policy assignment);

    // ---- registration (engine_registration.hpp) ----
    template <class Layer>
    bool register_layer(const std::string& name, Layer& layer);
    template <class Layer>
    std::size_t register_layers(const std::vector<std::pair<std::string, Layer*>>& list);

    // ---- a step's phases, in the order step() runs them ----
    /// What a step met that is counted and reported only when it completes.
    struct step_outcome {
        health_counters health{};
        std::vector<non_finite_event> events;
        void add(const layer_record& l, non_finite_source source, std::int64_t k,
                 std::int64_t health_counters::*counter) {
            ++(health.*counter);
            events.push_back({l.host.name, source, k});
        }
    };
    /// Single-threaded BLAS for the whole step while `serial` (see setup()).
    struct blas_threads_guard {
        std::optional<typename Backend::serial_blas_scope> scope;
        explicit blas_threads_guard(bool serial) {
            if (serial) scope.emplace();
        }
    };

    /// Once, at the first accumulate()/step(): agreement, placement, groups. Collective.
    void setup();
    /// Every scheduled option and every view the step reads, checked by every rank.
    step_plan read_plan();
    [[nodiscard]] bool serial_blas() const noexcept { return serial_blas_; }
    /// This pass's statistics (factor-update steps; G divided by loss_scale²), then the
    /// host's end_pass(), agreed. On the step's last pass (step()) with
    /// options.overlap_factor_allreduce under KAISA on several ranks, the factor allreduce
    /// starts as the statistics are computed, each bucket as soon as its layers' exist
    /// (update_factors() completes it).
    void finish_pass(bool factor_update, double loss_scale = 1.0, bool last_pass = false);
    /// accumulate(): the pass folded into the step's statistics.
    void accumulate();
    /// Running averages of the factors, averaged over ranks.
    void update_factors(const step_plan& plan, step_outcome& outcome);
    /// Second-order data of the factors this rank owns, shared with the others: with
    /// options.overlap_communication the broadcasts are left travelling (precondition_all()
    /// or finish_second_order_broadcasts() completes them).
    void update_second_order(const step_plan& plan, step_outcome& outcome);
    /// Waits for the second-order broadcasts update_second_order() left travelling, if any.
    void finish_second_order_broadcasts();
    /// Under a method that re-estimates a scaling at factor updates (compute::ekfac), each
    /// layer's from the pass's rows in the bases now in force (after update_second_order()),
    /// averaged over the ranks' examples; nothing under the others.
    void update_scaling(const step_plan& plan, step_outcome& outcome);
    /// Pᵀ of every layer, shared from the gradient workers; unusable layers zeroed.
    void precondition_all(const step_plan& plan, step_outcome& outcome);
    /// ν = min(1, √(κ / |η² Σ_layers ⟨P, Γ⟩|)), 1 without kl_clip or when the sum is 0.
    /// Clears a backend's prefetched decompositions when it goes (engine_second_order.hpp).
    struct prefetch_guard {
        void (*clear)() noexcept = nullptr;
        prefetch_guard() = default;
        explicit prefetch_guard(void (*c)() noexcept) : clear(c) {}
        prefetch_guard(prefetch_guard&& o) noexcept : clear(std::exchange(o.clear, nullptr)) {}
        prefetch_guard(const prefetch_guard&) = delete;
        prefetch_guard& operator=(const prefetch_guard&) = delete;
        prefetch_guard& operator=(prefetch_guard&&) = delete;
        ~prefetch_guard() {
            if (clear) clear();
        }
    };
    prefetch_guard prefetch_decompositions();
    [[nodiscard]] double kl_clip_scale(const step_plan& plan) const;
    /// The host's gradient buffers ← ν · Pᵀ, each rounded once to its view's format; a layer
    /// whose values would round to ±Inf in a narrower view is zeroed instead (agreed by the
    /// ranks), counted and reported as a non-finite preconditioned gradient.
    void write_back(const step_plan& plan, double scale, step_outcome& outcome);
    /// Counts the step and the health counters, then reports the non-finite events.
    void commit(const step_plan& plan, double scale, step_outcome outcome);

    // ---- loss scaling (engine_loss_scale.hpp) ----
    /// With options.loss_scale: whether any rank's gradients or statistics of this step hold
    /// an inf or a NaN (the same answer on every rank). Collective when loss scaling is on.
    [[nodiscard]] bool overflowed(const step_plan& plan);
    /// The overflowed step, skipped: the host's pass is read (end_pass), the statistics of
    /// the step's passes dropped, and nothing else changes but health().skipped_steps.
    void skip();

    // ---- checkpoints (engine_checkpoint.hpp) ----
    /// Every layer's state gathered onto rank 0 by the plan (std::nullopt on the other ranks),
    /// after a finished step. Collective.
    [[nodiscard]] std::optional<checkpoint::state_dict> gather_state(const checkpoint::save_options& o);
    void save(const std::filesystem::path& path, const checkpoint::save_options& o);
    [[nodiscard]] std::string save_bytes(const checkpoint::save_options& o);
    void save(std::ostream& out, const checkpoint::save_options& o);
    void load(const std::filesystem::path& path, const checkpoint::load_options& o);
    void load_bytes(std::string_view bytes, const checkpoint::load_options& o);
    void load(std::istream& in, const checkpoint::load_options& o);

    // ---- reports (engine_setup.hpp) ----
    [[nodiscard]] std::int64_t steps() const noexcept { return steps_; }
    [[nodiscard]] std::size_t layer_count() const noexcept { return layers_.size(); }
    [[nodiscard]] bool is_registered(const std::string& name) const;
    [[nodiscard]] const layer_record& find(const std::string& name) const { return layers_[index_of(name)]; }
    /// A layer's running A (a: true) or G factor: the state's matrix, or with
    /// options.factor_storage its widened copy, kept until the next call for that layer.
    /// @throws kfac::error on a rank that does not keep the layer's factors (DP-KFAC's
    ///         non-owners), naming the rank that does.
    [[nodiscard]] const matrix& factor(const std::string& name, bool a) const {
        const std::size_t i = index_of(name);
        const layer_record& l = layers_[i];
        if (!l.role.holds_factors) throw_factor_not_held(i, a);
        if (!storage_.packs()) return a ? l.state.a_factor : l.state.g_factor;
        auto& copy = a ? l.scratch.widened_a : l.scratch.widened_g;
        copy = storage_.value(l.state, a);
        return copy;
    }
    [[nodiscard]] double last_kl_scale() const noexcept { return last_kl_scale_; }
    [[nodiscard]] const health_counters& health() const noexcept { return health_; }
    [[nodiscard]] eigenbasis_count eigenbasis_counts() const noexcept { return bases_; }
    void on_non_finite(std::function<void(const non_finite_event&)> callback) { on_non_finite_ = std::move(callback); }
    [[nodiscard]] const options& get_options() const noexcept { return options_; }
    [[nodiscard]] assignment::factor_workers workers(const std::string& name) const;
    [[nodiscard]] std::vector<layer_info> layers() const;
    [[nodiscard]] memory_report memory_usage() const;
    /// The curvature report of every layer on this rank (engine_curvature.hpp).
    [[nodiscard]] std::vector<layer_curvature> curvature() const;
    [[nodiscard]] std::string strategy_name() const;
    [[nodiscard]] const std::vector<layer_record>& records() const noexcept { return layers_; }
    /// What every rank agrees on (kfac/detail/configuration_check.hpp): the options by name, the
    /// layers, the scalar type and the compute method.
    [[nodiscard]] std::vector<config_item> configuration() const;
    [[nodiscard]] const CommPolicy& comm() const noexcept { return comm_; }
    [[nodiscard]] CommPolicy& comm() noexcept { return comm_; }

private:
    using group = typename CommPolicy::group;

    // registration (engine_registration.hpp)
    template <class Layer>
    std::vector<layer_record> make_records(const std::string& name, Layer& layer,
                                           const std::vector<layer_record>& pending) const;
    static void check_backend_supports(const std::string& name, const layer_description& d);
    /// The block of d's kind. Not a template: make_records, a member template that every
    /// program registering layers instantiates, reaches the blocks through it, so that the
    /// blocks' code is compiled with the engine (once, where the engine is instantiated
    /// explicitly) and not in every such program.
    static const blocks::block<Backend, method>& block_of(const layer_description& d);
    // The option filters (kfac/detail/layer_patterns.hpp), behind members that are not
    // templates for the same reason: std::regex is compiled with the engine only.
    [[nodiscard]] bool skipped(const std::string& name, layer_kind kind) const;
    [[nodiscard]] bool reduces(const std::string& name, layer_kind kind) const;
    [[nodiscard]] std::size_t index_of(const std::string& name) const;
    /// factor()'s error on a rank whose role keeps no factors of layer i.
    [[noreturn]] void throw_factor_not_held(std::size_t i, bool a) const;

    // configuration and placement (engine_setup.hpp)
    void check_method_supported() const;
    void check_eigenbasis_reuse_supported() const;
    void check_damping_supported() const;
    void check_configuration_agrees();
    void check_items_agree(const std::vector<config_item>& items, const std::string& subject, const std::string& fix);
    [[nodiscard]] assignment::distribution_plan distribution() const;
    [[nodiscard]] assignment::distribution_plan placement() const;

    // the plan phase (engine_read.hpp)
    [[nodiscard]] bool has_schedule() const;
    void agree_on_scheduled_values(const step_plan& plan);
    void agree_on_gradient_presence();
    void check_statistics();
    void check_some_layer_applied() const;
    void check_gradients();
    static constexpr const char* schedule_fix =
        "A schedule must return the same value on every rank: compute it from the step number and values every "
        "rank shares, not from a rank's own clock or random state";

    // statistics and factors (engine_factors.hpp)
    [[nodiscard]] scalar_type total_rows(const layer_record& l) const;
    [[nodiscard]] std::int64_t total_applications(const layer_record& l) const;
    void capture_pass(bool post_factor_sums);
    /// capture_pass() with the factor allreduce started as it goes (finish_pass()): each layer's
    /// tasks, then its statistics scaled and added to factor_sums_.
    void capture_and_post(std::vector<std::vector<detail::task>>& layer_tasks);
    void end_pass();
    /// Whether the factors are averaged over the ranks' statistics (KAISA on several ranks).
    [[nodiscard]] bool averages_factors_over_ranks() const;
    /// Whether the factor allreduce is started during the capture (options.overlap_factor_allreduce
    /// when averaging over ranks, with the statistics sent where they are).
    [[nodiscard]] bool posts_factor_sums_early() const;
    /// options.allreduce_bucket_cap_mb in bytes.
    [[nodiscard]] std::size_t factor_bucket_cap_bytes() const;
    /// Layer l's statistics made what the ranks sum (its mean over applications times its rows;
    /// zeros when it was applied nowhere on this rank), `add` given each as an item; its rows.
    template <class Add>
    scalar_type weighted_statistics(layer_record& l, Add&& add);

    /// Layer i's running factors updated from its statistics (summed over `count` rows or
    /// applications); skipped when it holds none or none came in this step.
    void average_layer(std::size_t i, const step_plan& plan, step_outcome& outcome, double count);
    /// update_factors() with options.overlap_factor_allreduce: the allreduce capture_and_post()
    /// started completed, each layer averaged, and on an inverse-update step decomposed, as soon
    /// as its buckets land.
    void update_factors_overlapped(const step_plan& plan, step_outcome& outcome,
                                   comm::posted_allreduce<scalar_type>& sums);

    // second-order data
    void count_bases(const layer_record& l, const typename method::factor_data& a,
                     const typename method::factor_data& g);
    /// One layer's decompositions in an inverse update.
    struct second_order_result {
        typename method::factor_data a, g;
        bool ok_a = true, ok_g = true;
        damping_terms terms{};  // where this update's damping goes (kfac/detail/damping_terms.hpp)
        bool computed = false;  // its tasks have run
    };
    /// Appends layer i's decomposition tasks (the factors this rank computes), writing into
    /// second_order_results_[i]; widens its factors (released after the update).
    void add_decomposition_tasks(std::size_t i, double damping, std::vector<detail::task>& tasks);
    /// Runs layer i's decompositions now (overlapped with the factor allreduce); a failure is
    /// kept for update_second_order()'s agreement, where every rank meets it.
    void decompose_early(std::size_t i, double damping);
    /// Forgets decompositions started early and releases the factors they widened (a step
    /// that failed before update_second_order()).
    void abandon_early_decompositions() noexcept;

    // checkpoints
    /// save() and load() between steps only (not after a step's accumulate() calls), agreed.
    void check_between_steps(const char* call) const;
    void load_from(std::string bytes, const std::string& source, const checkpoint::load_options& o);
    /// One tensor of the state onto rank 0 from `source` (a broadcast when that is another rank).
    template <class Storage>
    void gather_tensor(const Storage& x, std::int64_t rows, std::int64_t cols, int source, bool writer,
                       std::vector<checkpoint::tensor>& tensors, std::string name, int tensor_rank);
    /// Every layer's W from a rank that holds its factors, on rank 0. Collective.
    [[nodiscard]] std::vector<double> gather_statistics_weights();
    /// Sets a state that load() checked on every rank: nothing here can fail but a device copy.
    void adopt_state(staged_state<Backend, method>&& s);

    /// Runs work that can fail on some ranks only (checks, local computation) and raises the
    /// first failure on every rank, so that no rank goes on into a collective that a failed
    /// rank will never join. Collective; free with one rank.
    /// The rank whose failure is raised keeps the layer its error names (error::layer()).
    template <class Work>
    void agree_on(Work&& work) {
        std::optional<std::string> failure;
        std::string layer;
        try {
            work();
        } catch (const error& e) {
            failure = e.message();
            layer = e.layer();
        } catch (const std::exception& e) {
            if (comm_.size() == 1) throw;  // alone, the original exception is the best report
            failure = e.what();
        }
        if (auto agreed = comm_.agree(failure)) {
            if (!layer.empty() && agreed == failure) throw error(*agreed, layer);
            throw error(*agreed);
        }
    }

    /// Runs backend work of one layer; a backend failure (a CUDA status, say) is rethrown
    /// with the layer named, since the backend itself sees matrices, not layers. An error
    /// that already names its layer (error::layer()) passes as it is.
    template <class F>
    static void in_layer(const layer_record& l, F&& f) {
        try {
            f();
        } catch (const error& e) {
            if (!e.layer().empty()) throw;
            throw layer_error(named(l), e.message());
        }
    }
    /// A task of one layer's work, its failures named as in_layer() names them.
    static task layer_task(const layer_record& l, task t) {
        return {t.cost, [&l, run = std::move(t.run)] { in_layer(l, run); }};
    }
    /// A record as its errors name it (kfac/detail/layer_checks.hpp).
    static named_layer named(const layer_record& l) {
        return {l.host.name, describe_layer(l.host.name, l.host.description)};
    }

    static constexpr bool device_backend = device_resident<Backend>;
    static constexpr bool batched_gradient_checks = backend_with_gradient_checks<Backend>;
    static constexpr device_memory_probe device_probe = [] {
        if constexpr (requires(const void* p) { Backend::points_to_device_memory(p); })
            return &Backend::points_to_device_memory;
        else
            return device_memory_probe{nullptr};
    }();

    options options_;
    CommPolicy comm_;
    assignment_policy assignment_;
    layer_patterns skip_filter_;    // options.skip_layers
    layer_patterns reduce_filter_;  // options.reduce_layers
    std::vector<layer_record> layers_;
    std::int64_t steps_ = 0;
    std::int64_t passes_ = 0;       // forward/backward passes folded into the current statistics
    bool applied_in_step_ = false;  // some layer was applied in a pass accumulate() folded in
    bool started_ = false;
    double last_kl_scale_ = 1.0;
    double pass_loss_scale_ = 1.0;  // options.loss_scale as read for the pass being captured
    /// ⟨P, Γ⟩ per layer from the last batched gradient checks (backend_with_gradient_checks).
    std::vector<double> gradient_dots_;
    /// Some rank's gradient views of this step are narrower than the compute type (learned in
    /// precondition_all's vote): write_back() then checks what it writes into them.
    bool narrow_gradient_views_ = false;
    double second_order_damping_ = 0.0;  // of the last inverse update (checkpoints record it)
    /// update_second_order() left its broadcasts travelling (options.overlap_communication):
    /// precondition_all() waits for them before the first layer that receives.
    bool second_order_in_flight_ = false;
    /// The inverse update's results, filled early by update_factors() when it overlaps the
    /// decompositions with its allreduce (empty otherwise), and the first failure of those.
    std::vector<second_order_result> second_order_results_;
    std::exception_ptr early_decomposition_failure_;
    /// The factor allreduce capture_and_post() started, for update_factors(); the rows' sums
    /// (summed before it started) and this rank's rows, its last item. Declared after comm_:
    /// destroyed first, it waits for its buckets while the policy exists.
    std::unique_ptr<comm::posted_allreduce<scalar_type>> factor_sums_;
    std::vector<scalar_type> factor_rows_sum_;
    std::vector<scalar_type> factor_rows_;
    health_counters health_{};
    factor_storage<Backend> storage_{};  // options.factor_storage
    eigenbasis_count bases_{};
    std::function<void(const non_finite_event&)> on_non_finite_;
    host_staging<Backend> staging_{};       // device data through host memory for comm
    assignment::distribution_plan plan_{};  // where each layer's work runs (from setup())
    group column_group_{};
    group gradient_group_{};
    int threads_ = 1;
    bool serial_blas_ = false;  // the whole step with single-threaded BLAS (several ranks)
};

}  // namespace kfac::detail
