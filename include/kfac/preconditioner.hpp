// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file preconditioner.hpp
/// `kfac::preconditioner<Backend, CommPolicy, ComputeMethod, AssignmentStrategy>`: registers
/// layers through kfac::layer_traits and, at each step(), replaces their weight and bias
/// gradients in place by K-FAC preconditioned ones (golden/README.md is the contract).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <istream>
#include <iterator>
#include <limits>
#include <optional>
#include <ostream>
#include <regex>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/assignment/distribution_plan.hpp"
#include "kfac/assignment/kaisa_grid.hpp"
#include "kfac/assignment/strategies.hpp"
#include "kfac/backend/diagonal_factors.hpp"
#include "kfac/backend/eigenbasis_reuse.hpp"
#include "kfac/backend/unit_wise_factors.hpp"
#include "kfac/config.hpp"
#include "kfac/comm/serial.hpp"
#include "kfac/checkpoint/format.hpp"
#include "kfac/detail/checkpoint_io.hpp"
#include "kfac/detail/compute_impl.hpp"
#include "kfac/detail/configuration_check.hpp"
#include "kfac/detail/group_views.hpp"
#include "kfac/detail/task_parallel.hpp"
#include "kfac/detail/host_staging.hpp"
#include "kfac/detail/layer_checks.hpp"
#include "kfac/detail/layer_record.hpp"
#include "kfac/detail/statistics_views.hpp"
#include "kfac/detail/step_plan.hpp"
#include "kfac/fwd.hpp"
#include "kfac/health.hpp"
#include "kfac/layer_info.hpp"
#include "kfac/layers/any_layer.hpp"
#include "kfac/layers/layer_traits.hpp"
#include "kfac/options.hpp"

namespace kfac {

/// @tparam Backend storage and linear algebra (kfac::backend::cpu_eigen<Scalar>).
/// @tparam CommPolicy collectives (kfac::comm::serial).
/// @tparam ComputeMethod kfac::compute::eigendecomposition or kfac::compute::inverse.
/// @tparam AssignmentStrategy where second-order work runs (kfac::assignment::*).
template <class Backend, class CommPolicy, class ComputeMethod, class AssignmentStrategy>
class preconditioner {
    using method = detail::compute_impl<ComputeMethod, Backend>;

public:
    using backend_type = Backend;
    using compute_method = ComputeMethod;
    using scalar_type = typename Backend::scalar_type;
    using matrix = typename Backend::matrix;

    /// Collective under a CommPolicy with several ranks: every rank constructs its
    /// preconditioner together, and an invalid option on any rank is an error on all.
    /// @throws kfac::error if an option is out of range or a skip pattern is not a regex.
    explicit preconditioner(options opts = {}, CommPolicy comm = {})
        : options_(std::move(opts)), comm_(std::move(comm)) {
        agree_on([&] {
            validate(options_);
            if (!options_.damping.is_schedule()) detail::check_damping_representable<scalar_type>(options_.damping(0));
            check_eigenbasis_reuse_supported();
            auto compile = [](const char* option, const std::string& pattern) {
                try {
                    return std::regex(pattern, std::regex::ECMAScript);
                } catch (const std::regex_error& e) {
                    throw error(std::string("options.") + option + ": '" + pattern +
                                "' is not a valid ECMAScript regular expression (" + e.what() + ")");
                }
            };
            for (const auto& pattern : options_.skip_layers) skip_patterns_.push_back(compile("skip_layers", pattern));
            for (const auto& pattern : options_.reduce_layers) reduce_patterns_.push_back(compile("reduce_layers", pattern));
        });
    }

    /// Registers a layer under a unique name. The preconditioner keeps a pointer to `layer`,
    /// which must outlive it. Register every layer before the first step(). A grouped
    /// convolution of g groups becomes g blocks named "<name>/group0" ... "<name>/group<g-1>"
    /// (a_factor(), layers() and checkpoints use those names).
    /// @return false if options.skip_layers matched the layer (it is then not registered).
    /// @throws kfac::error for a duplicate name, an invalid description, or registration
    ///         after the first step; nothing is registered then.
    template <class Layer>
    bool register_layer(const std::string& name, Layer& layer) {
        auto records = make_records(name, layer, {});
        if (records.empty()) return false;
        for (auto& r : records) layers_.push_back(std::move(r));
        return true;
    }

    /// Registers several layers of one type, all or none: every layer is checked (as
    /// register_layer() checks one, and against the others of the list) before any is
    /// registered.
    /// @return the number of layers registered (options.skip_layers may leave some out).
    /// @throws kfac::error as register_layer(); nothing is registered then.
    template <class Layer>
    std::size_t register_layers(const std::vector<std::pair<std::string, Layer*>>& list) {
        std::vector<layer_record> records;
        records.reserve(list.size());
        std::size_t registered = 0;
        for (const auto& [name, layer] : list) {
            if (layer == nullptr) throw error("layer '" + name + "': register_layers() was given a null layer");
            auto blocks = make_records(name, *layer, records);
            registered += blocks.empty() ? 0 : 1;
            for (auto& r : blocks) records.push_back(std::move(r));
        }
        layers_.reserve(layers_.size() + records.size());
        for (auto& r : records) layers_.push_back(std::move(r));
        return registered;
    }

    /// Folds the current forward/backward pass into the batch statistics. With
    /// accumulation_steps = m, call it after each of the first m − 1 passes of a step; step()
    /// takes the last pass itself. Reads nothing on steps that do not update factors.
    /// Collective under a CommPolicy with several ranks.
    /// @throws kfac::error on a view that disagrees with its layer, when called m times, or
    ///         when the host's adapter throws (raised on every rank); the preconditioner,
    ///         the statistics of earlier passes included, is then as it was before the call.
    void accumulate() {
        setup();
        bool factor_update = false;
        agree_on([&] {
            factor_update = detail::is_factor_update_step(options_, steps_);
            if (!factor_update) return;
            if (passes_ + 1 >= options_.accumulation_steps)
                throw error("accumulate() called " + std::to_string(passes_ + 1) +
                            " times in one step with accumulation_steps = " +
                            std::to_string(options_.accumulation_steps) +
                            "; call it after each of the first accumulation_steps - 1 passes only, "
                            "step() takes the last pass");
            check_statistics();
        });
        if (options_.factor_update_steps.is_schedule())
            check_items_agree({{"options.factor_update_steps at step " + std::to_string(steps_),
                                factor_update ? "a factor update" : "no factor update"}},
                              "the values of the scheduled options", schedule_fix);
        const blas_threads_guard blas_threads(serial_blas_);
        finish_pass(factor_update);
        if (factor_update) {
            for (auto& l : layers_) {
                l.state.captured_rows = total_rows(l);
                l.state.captured_applications = total_applications(l);
                if (l.scratch.applications != 0) applied_in_step_ = true;
            }
            ++passes_;
        }
    }

    /// One preconditioning step, the pipeline of K-FAC:
    ///   plan     read every scheduled option and every view the host's adapter gives, and
    ///            check them (agreed by all ranks, scheduled values included)
    ///   capture  this pass's factor statistics        (factor-update steps)
    ///   end pass tell the host its pass was read      (agreed by all ranks)
    ///   update   running factors, averaged over ranks (factor-update steps)
    ///   decompose and share the second-order data     (inverse-update steps)
    ///   precondition every layer, share the results, agree on which are usable
    ///   clip     one kl_clip scale ν for the whole model
    ///   write    the scaled gradients back into the host's buffers
    ///   commit   the step count and health counters, then report non-finite events.
    /// With several ranks every rank must call it; a failure on any rank is raised on every
    /// rank, so none waits in a collective.
    /// @throws kfac::error on a view that disagrees with its layer, on missing activations
    ///         on a factor-update step, on a scheduled option out of range or differing
    ///         across ranks, or when the host's adapter throws (in any of its members; the
    ///         adapter is asked only before anything changes, and its end_pass() before the
    ///         factors, the second-order data or the host's gradients change): all raised on
    ///         every rank, with the preconditioner and the host's gradients as before the call.
    ///         A device or transport failure later in the step leaves it usable, with the
    ///         step not counted. An exception thrown by the on_non_finite callback propagates
    ///         after the step has completed and the gradients were written.
    void step() {
        setup();
        const detail::step_plan plan = read_plan();
        const blas_threads_guard blas_threads(serial_blas_);
        step_outcome outcome;
        finish_pass(plan.factor_update);
        if (plan.factor_update) update_factors(plan, outcome);
        if (plan.inverse_update) update_second_order(plan, outcome);
        precondition_all(plan, outcome);
        const double scale = kl_clip_scale(plan);
        write_back(scale);
        commit(plan, scale, std::move(outcome));
    }

    /// Saves the state to `path` (kfac/checkpoint/format.hpp): the step count, every layer's
    /// running factors and, unless `o` leaves it out, the second-order data in force, so that
    /// load() continues exactly where this run is. Written atomically (a temporary file, then
    /// a rename). Collective: every rank calls it, rank 0 writes the file.
    /// @throws kfac::error (on every rank) when the file cannot be written, or between
    ///         accumulate() and step(); the preconditioner is unchanged either way.
    void save(const std::filesystem::path& path, const checkpoint::save_options& o = {}) {
        const auto archive = detail::checkpoint_io<preconditioner>::collect(*this, o);
        agree_on([&] {
            if (archive) checkpoint::write_file(path, *archive);
        });
    }
    /// The bytes save() would write: on rank 0; other ranks get an empty string. Collective.
    [[nodiscard]] std::string save_bytes(const checkpoint::save_options& o = {}) {
        const auto archive = detail::checkpoint_io<preconditioner>::collect(*this, o);
        std::string bytes;
        agree_on([&] {
            if (archive) bytes = checkpoint::serialize(*archive);
        });
        return bytes;
    }
    /// Writes the bytes to `out` on rank 0 (other ranks leave theirs untouched). Collective.
    void save(std::ostream& out, const checkpoint::save_options& o = {}) {
        const std::string bytes = save_bytes(o);
        agree_on([&] {
            if (comm_.rank() != 0) return;
            out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
            if (!out) throw error("save(): writing " + std::to_string(bytes.size()) + " bytes to the stream failed");
        });
    }

    /// Sets the state saved by save(), from any world size, strategy or assignment: register
    /// the same layers first. Everything is checked before anything changes (missing, unknown
    /// or re-shaped layers, a corrupt or truncated file, a newer format, changed options);
    /// float and double files load into either precision (double → float rounds). A file
    /// saved without second-order data has it recomputed from its factors, with the damping
    /// it was last computed with. Collective: rank 0 reads the file and sends it to the others.
    /// @throws kfac::error naming the file, the layer, what was expected and found, and the
    ///         fix; the preconditioner is then as it was.
    void load(const std::filesystem::path& path, const checkpoint::load_options& o = {}) {
        std::string bytes;
        agree_on([&] {
            // A folder, a device or a pipe is refused by its type, and every failure is a
            // kfac::error naming the file (kfac/checkpoint/files.hpp), which every rank raises.
            if (comm_.rank() == 0) bytes = checkpoint::read_bytes(path);
        });
        load_from(std::move(bytes), path.string(), o);
    }
    /// load() from bytes save_bytes() returned; read on rank 0 (others may pass nothing).
    void load_bytes(std::string_view bytes, const checkpoint::load_options& o = {}) {
        load_from(comm_.rank() == 0 ? std::string(bytes) : std::string(), "(bytes in memory)", o);
    }
    /// load() from a stream, read to its end on rank 0 (others may pass any stream).
    void load(std::istream& in, const checkpoint::load_options& o = {}) {
        std::string bytes;
        agree_on([&] {
            if (comm_.rank() != 0) return;
            try {  // a stream with exceptions() set, or bytes beyond memory: named as load()'s
                bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
            } catch (const std::exception& e) {
                throw error(std::string("load(): reading the stream failed: ") + e.what());
            }
            if (in.bad()) throw error("load(): reading the stream failed");
        });
        load_from(std::move(bytes), "(stream)", o);
    }

    /// Number of completed step() calls.
    [[nodiscard]] std::int64_t steps() const noexcept { return steps_; }
    /// Registered blocks: one per layer, and one per group of a grouped convolution.
    [[nodiscard]] std::size_t layer_count() const noexcept { return layers_.size(); }
    /// Whether a layer (or a group block, "<name>/group<j>") of that name is registered.
    [[nodiscard]] bool is_registered(const std::string& name) const {
        for (const auto& l : layers_)
            if (l.host.name == name || l.host.registered_name == name) return true;
        return false;
    }
    /// Running A factor of a layer (the identity before its first update); a diagonal one
    /// (an Embedding's) as its a_dim × 1 diagonal.
    [[nodiscard]] const matrix& a_factor(const std::string& name) const { return find(name).state.a_factor; }
    /// Running G factor of a layer.
    [[nodiscard]] const matrix& g_factor(const std::string& name) const { return find(name).state.g_factor; }
    /// ν of the last step (1 when kl_clip is off or did not bind).
    [[nodiscard]] double last_kl_scale() const noexcept { return last_kl_scale_; }
    [[nodiscard]] const health_counters& health() const noexcept { return health_; }
    /// Dense factors this rank has computed second-order data for since construction (not
    /// saved in checkpoints): with options.eigenbasis_reuse_tolerance, how many kept their
    /// previous eigenvectors and how many were decomposed (every one without it).
    struct eigenbasis_count {
        std::int64_t decomposed = 0;
        std::int64_t reused = 0;
    };
    [[nodiscard]] eigenbasis_count eigenbasis_counts() const noexcept { return bases_; }
    /// Called (on the thread that runs step()) for every contained non-finite event.
    void on_non_finite(std::function<void(const non_finite_event&)> callback) {
        on_non_finite_ = std::move(callback);
    }
    [[nodiscard]] const options& get_options() const noexcept { return options_; }
    /// Ranks that compute a layer's A and G second-order data.
    [[nodiscard]] assignment::factor_workers workers(const std::string& name) const {
        const auto plan = placement();
        const auto& p = plan.layers[index_of(name)];
        return {p.a_worker, p.g_worker};
    }
    /// Every registered layer in registration order, with where its work runs: the
    /// placement in force, or the one the first step will use. Not collective.
    /// @throws kfac::error when the options do not fit the world size (as step() would).
    [[nodiscard]] std::vector<layer_info> layers() const {
        const auto plan = placement();
        std::vector<layer_info> out;
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            const auto& d = layers_[i].host.description;
            const auto& p = plan.layers[i];
            out.push_back({layers_[i].host.name, d.kind, d.a_dim(), d.g_dim(), d.bias, p.a_worker, p.g_worker,
                           p.factor_holders, p.grad_workers});
        }
        return out;
    }
    /// Bytes this rank holds for K-FAC, by kind (kfac::memory_report). Not collective.
    [[nodiscard]] memory_report memory_usage() const {
        memory_report m;
        auto bytes = [](const auto& x) { return static_cast<std::size_t>(x.size()) * sizeof(scalar_type); };
        for (const auto& l : layers_) {
            m.factors += bytes(l.state.a_factor) + bytes(l.state.g_factor);
            m.statistics += bytes(l.state.a_sum) + bytes(l.state.g_sum);
            for (const auto& channels : l.scratch.group_channels) m.statistics += channels.size() * sizeof(scalar_type);
            method::for_each_tensor(l.state.second,
                                    [&](const char*, const auto& x, int) { m.second_order += bytes(x); });
            m.gradients += bytes(l.scratch.gamma) + bytes(l.scratch.preconditioned);
        }
        return m;
    }
    /// Name of the distribution in force: comm_opt, hybrid_opt, mem_opt or dp_kfac.
    [[nodiscard]] std::string strategy_name() const {
        if (options_.strategy == distribution::dp_kfac) return "dp_kfac";
        return assignment::kaisa_grid(comm_.size(), options_.grad_worker_fraction).strategy_name();
    }
    [[nodiscard]] const CommPolicy& comm() const noexcept { return comm_; }
    [[nodiscard]] CommPolicy& comm() noexcept { return comm_; }

private:
    using group = typename CommPolicy::group;
    using layer_record = detail::layer_record<Backend, method>;

    /// The checked records of `layer` (none when options.skip_layers matches it), also checked
    /// against `pending`, records about to be registered with it: one record, or one per group
    /// of a grouped convolution. Changes nothing.
    template <class Layer>
    std::vector<layer_record> make_records(const std::string& name, Layer& layer,
                                           const std::vector<layer_record>& pending) const {
        static_assert(detail::check_layer_adapter<Layer>());
        if constexpr (layer_adapter<Layer>) {
            using traits = layer_traits<Layer>;
            static_assert(std::is_same_v<typename traits::scalar_type, scalar_type>,
                          "kfac: the layer's layer_traits<Layer>::scalar_type differs from the "
                          "backend's scalar type; use a double backend (cpu_eigen<double>, cuda<double>) "
                          "for double layers and a float one for float layers.");
            if (steps_ > 0 || started_)
                throw error("layer '" + name + "': register_layer() after the first accumulate() "
                            "or step(); register every layer before training starts");
            const void* object = detail::bind_layer<scalar_type>(layer).layer;
            layer_description d = traits::describe(layer);
            const std::int64_t groups = d.groups() > 1 ? d.groups() : 1;
            const std::string block_prefix = name + "/group";
            auto block_name = [&](std::int64_t j) { return groups == 1 ? name : block_prefix + std::to_string(j); };
            // Taken: the name itself, or (for a grouped layer) any "<name>/group..." record name;
            // one comparison per registered record, however many groups either layer has.
            for (const auto* registered : {&layers_, &pending})
                for (const auto& l : *registered) {
                    const bool taken = l.host.name == name || l.host.registered_name == name ||
                                       (groups > 1 && l.host.name.rfind(block_prefix, 0) == 0);
                    if (taken)
                        throw error("layer '" + name + "' is already registered; give each layer a "
                                    "unique name");
                    // Two registrations of one object would fold its statistics in twice and
                    // precondition its gradient twice.
                    if (l.host.layer == object)
                        throw error("layer '" + name + "': this layer object is already registered as '" +
                                    l.host.registered_name + "'; register each layer object once, under one name");
                }
            if (skipped(name, d.kind)) return {};
            // An Embedding has no positions to share a weight over: its rows are the tokens.
            for (const auto& re : reduce_patterns_)
                if (d.kind != layer_kind::embedding && std::regex_search(name, re)) d.sharing = weight_sharing::reduce;
            detail::check_description(name, d);
            check_backend_supports(name, d);
            std::vector<layer_record> records(static_cast<std::size_t>(d.groups()));
            for (std::int64_t j = 0; j < d.groups(); ++j) {
                auto& r = records[static_cast<std::size_t>(j)];
                r.host = detail::bind_layer<scalar_type>(layer);
                r.host.name = block_name(j);
                r.host.registered_name = name;
                r.host.group = j;
                r.host.description = d;
                const auto g = d.g_factor_dim();
                r.state.a_factor = identity_factor(d);
                r.state.g_factor = Backend::identity(g);
                r.state.a_sum = Backend::zeros(d.a_storage_rows(), d.a_storage_cols());
                r.state.g_sum = Backend::zeros(g, g);
            }
            return records;
        }
        return {};
    }

    /// What this backend and scalar type cannot hold, refused by name before registration.
    static void check_backend_supports(const std::string& name, const layer_description& d) {
        const std::string who = detail::describe_layer(name, d);
        if constexpr (requires { Backend::unsupported_layer(d); }) {
            const std::string why = Backend::unsupported_layer(d);
            if (!why.empty()) throw error(who + ": " + why);
        }
        const bool diagonal = d.a_structure() == factor_structure::diagonal || d.weight_is_in_by_out();
        if (diagonal && !detail::backend_with_diagonal_factors<Backend>)
            throw error(who + ": this backend has no diagonal factors (kfac/backend/diagonal_factors.hpp), which an "
                        "Embedding needs; use kfac::backend::cpu_eigen, or exclude the layer with options.skip_layers");
        if (d.a_structure() == factor_structure::unit_wise && !detail::backend_with_unit_wise_factors<Backend>)
            throw error(who + ": this backend has no unit-wise factors (kfac/backend/unit_wise_factors.hpp), which a " +
                        kind_name(d.kind) + "'s scale and shift need; use kfac::backend::cpu_eigen, or exclude the "
                        "layer with options.skip_layers");
        // Token ids travel as scalars: past 2^digits a float or double no longer holds every integer.
        constexpr std::int64_t exact_ids = std::int64_t{1} << std::numeric_limits<scalar_type>::digits;
        // A group's channels are gathered from the host's views in host memory (group_views.hpp).
        if (d.groups() > 1 && device_backend)
            throw error(who + ": a grouped convolution's blocks read their channels from host memory, which this "
                        "device backend does not; use kfac::backend::cpu_eigen, or exclude the layer with "
                        "options.skip_layers");
        if (d.kind == layer_kind::embedding && d.in > exact_ids)
            throw error(who + ": " + std::to_string(d.in) + " token ids do not all fit exactly in the scalar type "
                        "(its integers are exact up to " + std::to_string(exact_ids) + "); use a double backend");
    }

    /// A running factor before its first update: the identity (a column of ones when diagonal,
    /// identity blocks when unit-wise).
    static matrix identity_factor(const layer_description& d) {
        if (d.a_structure() == factor_structure::diagonal) return Backend::ones(d.a_dim());
        if constexpr (detail::backend_with_unit_wise_factors<Backend>)
            if (d.a_structure() == factor_structure::unit_wise) return Backend::unit_wise_identity(d.g_dim(), d.a_dim());
        return Backend::identity(d.a_dim());
    }

    [[nodiscard]] bool skipped(const std::string& name, layer_kind kind) const {
        const char* lower = kind_name(kind);
        const char* pytorch = pytorch_module_name(kind);
        for (const auto& re : skip_patterns_)
            if (std::regex_search(name, re) || std::regex_search(lower, re) ||
                std::regex_search(pytorch, re))
                return true;
        return false;
    }

    [[nodiscard]] std::size_t index_of(const std::string& name) const {
        for (std::size_t i = 0; i < layers_.size(); ++i)
            if (layers_[i].host.name == name) return i;
        throw error("no layer named '" + name + "' is registered");
    }
    [[nodiscard]] const layer_record& find(const std::string& name) const { return layers_[index_of(name)]; }

    template <class>
    friend struct detail::checkpoint_io;

    void load_from(std::string bytes, const std::string& source, const checkpoint::load_options& o) {
        using io = detail::checkpoint_io<preconditioner>;
        setup();
        bytes = comm_.broadcast_text(bytes, 0);
        typename io::staged staged;
        agree_on([&] { staged = io::stage(*this, bytes, source, o); });
        const bool recompute = staged.recompute;
        io::commit(*this, std::move(staged));
        if (!recompute) return;
        // The file holds no second-order data to use: computed from the loaded factors now,
        // as an inverse update with the damping it was last computed with would.
        detail::step_plan plan;
        plan.step = steps_;
        plan.damping = second_order_damping_;
        step_outcome outcome;
        const blas_threads_guard blas_threads(serial_blas_);
        update_second_order(plan, outcome, /*reuse_bases=*/false);  // no saved eigenvectors to keep: exact
        health_.kept_decompositions += outcome.health.kept_decompositions;
    }

    /// The plan in force after setup(), else the one setup() will make.
    [[nodiscard]] assignment::distribution_plan placement() const { return started_ ? plan_ : distribution(); }

    /// What a step met that is counted and reported only when it completes.
    struct step_outcome {
        health_counters health{};
        std::vector<non_finite_event> events;
        void add(const layer_record& l, non_finite_source source, std::int64_t k, std::int64_t health_counters::*counter) {
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

    /// Runs work that can fail on some ranks only (checks, local computation) and raises the
    /// first failure on every rank, so that no rank goes on into a collective that a failed
    /// rank will never join. Collective; free with one rank.
    template <class Work>
    void agree_on(Work&& work) {
        std::optional<std::string> failure;
        try {
            work();
        } catch (const error& e) {
            failure = strip_prefix(e.what());
        } catch (const std::exception& e) {
            if (comm_.size() == 1) throw;  // alone, the original exception is the best report
            failure = e.what();
        }
        if (auto agreed = comm_.agree(failure)) throw error(*agreed);
    }

    /// Runs backend work of one layer; a backend failure (a CUDA status, say) is rethrown
    /// with the layer named, since the backend itself sees matrices, not layers.
    template <class F>
    static void in_layer(const layer_record& l, F&& f) {
        try {
            f();
        } catch (const error& e) {
            const std::string what = strip_prefix(e.what());
            if (what.rfind("layer '", 0) == 0) throw;
            throw error(detail::describe_layer(l.host.name, l.host.description) + ": " + what);
        }
    }

    static constexpr bool device_backend = detail::device_resident<Backend>;
    static constexpr detail::device_memory_probe device_probe = [] {
        if constexpr (requires(const void* p) { Backend::points_to_device_memory(p); })
            return &Backend::points_to_device_memory;
        else
            return detail::device_memory_probe{nullptr};
    }();

    static std::string strip_prefix(const std::string& what) {
        return what.rfind("kfac: ", 0) == 0 ? what.substr(6) : what;
    }

    /// Every scheduled option this step reads, and every view it will read, checked before
    /// anything changes; every rank reaches the same verdict.
    detail::step_plan read_plan() {
        detail::step_plan plan;
        agree_on([&] {
            plan = detail::read_step_plan<scalar_type>(options_, steps_);
            if (plan.factor_update) {
                if (passes_ + 1 != options_.accumulation_steps)
                    throw error("step() after " + std::to_string(passes_) + " accumulate() call(s) with "
                                "accumulation_steps = " + std::to_string(options_.accumulation_steps) +
                                "; call accumulate() after each of the first accumulation_steps - 1 "
                                "forward/backward passes, and step() after the last");
                check_statistics();
                check_some_layer_applied();
            }
            check_gradients();
        });
        agree_on_scheduled_values(plan);
        agree_on_gradient_presence();
        return plan;
    }

    [[nodiscard]] bool has_schedule() const {
        const options& o = options_;
        return o.damping.is_schedule() || o.factor_decay.is_schedule() || o.lr.is_schedule() ||
               o.kl_clip.is_schedule() || o.factor_update_steps.is_schedule() || o.inv_update_steps.is_schedule();
    }

    /// A schedule is the host's code, and may return another value on some rank (from a
    /// rank-local clock or random state, say): the values this step read must be the same on
    /// every rank, or gradients would drift apart silently and the collectives of a factor
    /// update made by some ranks only would never match. One allgather of a digest; free
    /// without schedules (the constants are in the configuration every rank agreed on).
    void agree_on_scheduled_values(const detail::step_plan& plan) {
        if (!has_schedule()) return;
        using detail::exact_number_text;
        const std::string at = " at step " + std::to_string(plan.step);
        std::vector<detail::config_item> items{
            {"options.factor_update_steps" + at, plan.factor_update ? "a factor update" : "no factor update"},
            {"options.inv_update_steps" + at, plan.inverse_update ? "an inverse update" : "no inverse update"},
            {"options.damping" + at, exact_number_text(plan.damping)},
            {"options.factor_decay" + at, exact_number_text(plan.factor_decay)},
            {"options.kl_clip" + at, plan.kl_clip ? exact_number_text(*plan.kl_clip) : "none"},
            {"options.lr" + at, exact_number_text(plan.lr)}};
        check_items_agree(items, "the values of the scheduled options", schedule_fix);
    }
    static constexpr const char* schedule_fix =
        "A schedule must return the same value on every rank: compute it from the step number and values every "
        "rank shares, not from a rank's own clock or random state";

    /// A layer without a gradient on one rank must have none on every rank (which layers
    /// are preconditioned and shared is the same everywhere). One small allreduce, made only
    /// when some layer's adapter can report a missing gradient. Collective.
    void agree_on_gradient_presence() {
        if (std::none_of(layers_.begin(), layers_.end(), [](const layer_record& l) { return l.host.has_gradient != nullptr; }))
            return;
        const std::size_t n = layers_.size();
        std::vector<std::int64_t> seen(2 * n);  // [i]: some rank has it, [n + i]: some rank lacks it
        for (std::size_t i = 0; i < n; ++i) {
            seen[i] = layers_[i].scratch.active ? 1 : 0;
            seen[n + i] = layers_[i].scratch.active ? 0 : 1;
        }
        comm_.allreduce_max(seen);
        for (std::size_t i = 0; i < n; ++i)
            if (seen[i] != 0 && seen[n + i] != 0)
                throw error(detail::describe_layer(layers_[i].host.name, layers_[i].host.description) +
                            ": has a gradient on some ranks and none on others; every rank must run the same "
                            "layers in its forward pass (or the host must give the unused layer a zero gradient)");
    }

    /// Reads the pass from the host's adapter (scratch.applications, .activations and
    /// .output_gradients: capture_pass() asks the adapter nothing) and checks every view.
    void check_statistics() {
        for (auto& l : layers_)
            in_layer(l, [&] {
                auto& s = l.scratch;
                s.activations.clear();
                s.output_gradients.clear();
                s.applications = l.host.applications_now();
                if (!l.role.holds_factors) return;
                if (s.applications < 0)
                    throw error(detail::describe_layer(l.host.name, l.host.description) + ": the adapter's "
                                "applications() returned " + std::to_string(s.applications) + "; it counts calls of "
                                "the layer in the pass (0 when it was not called)");
                for (std::int64_t i = 0; i < s.applications; ++i) {
                    s.activations.push_back(l.host.activations_of(i));
                    s.output_gradients.push_back(l.host.output_gradients_of(i));
                    detail::check_statistics_views(l.host.name, l.host.description, s.activations.back(),
                                                   s.output_gradients.back(), steps_, device_backend, device_probe);
                }
            });
    }

    /// A factor-update step in which no layer was applied at all has nothing to learn from:
    /// with an adapter that captures calls, that is a capture that saw nothing (the forward
    /// pass ran where it could not see it), never a model that ran no layer.
    void check_some_layer_applied() const {
        if (layers_.empty() || applied_in_step_) return;
        for (const auto& l : layers_)
            if (l.scratch.applications != 0) return;
        throw error("factor-update step " + std::to_string(steps_) + ": no registered layer was applied in any pass "
                    "of the step (every adapter reported 0 applications), so there is nothing to update the factors "
                    "with; run the forward and backward passes before step() (kfac::torch's tracker sees only "
                    "forward passes in training mode, with gradients enabled, on the thread that created it, and "
                    "not while at::enableRecordFunction(false) is in force)");
    }

    /// Marks the layers that have a gradient this step (scratch.active), reads their gradient
    /// views (the record's group rows, into scratch: the step asks the adapter nothing later)
    /// and checks them.
    void check_gradients() {
        for (auto& l : layers_)
            in_layer(l, [&] {
                l.scratch.active = l.host.gradient_present();
                if (!l.scratch.active) return;
                const auto w = l.host.weight_gradient(l.host.layer);
                const auto b = l.host.bias_gradient(l.host.layer);
                detail::check_gradient_views(l.host.name, l.host.description, w, b, device_backend, device_probe);
                l.scratch.weight_gradient = detail::group_rows(w, l.host.group, l.host.description.groups());
                l.scratch.bias_gradient = detail::group_rows(b, l.host.group, l.host.description.groups());
            });
    }

    /// options.eigenbasis_reuse_tolerance keeps eigenvectors: the eigen method's, on a backend
    /// that can measure them (kfac/backend/eigenbasis_reuse.hpp).
    void check_eigenbasis_reuse_supported() const {
        if (options_.eigenbasis_reuse_tolerance == 0.0) return;
        const std::string option = "options.eigenbasis_reuse_tolerance = " + detail::number_text(options_.eigenbasis_reuse_tolerance);
        if (!std::is_same_v<ComputeMethod, compute::eigendecomposition>)
            throw error(option + " needs the eigendecomposition compute method (this preconditioner uses '" +
                        ComputeMethod::name + "', which has no eigenvectors to keep); use kfac::compute::eigendecomposition "
                        "or set the tolerance to 0");
        if (!detail::backend_with_eigenbasis_reuse<Backend>)
            throw error(option + " is not supported by this backend (it lacks rayleigh_quotients, "
                        "kfac/backend/eigenbasis_reuse.hpp); set the tolerance to 0 or use the CPU backend");
    }

    /// What every rank must agree on: the layers in order, then the options that shape the
    /// computation (a schedule is code; only its presence is compared).
    [[nodiscard]] std::vector<detail::config_item> configuration() const {
        // −0 and 0 are one value of every option (the text of −0 would be "-0").
        auto exact_number_text = [](double v) { return detail::exact_number_text(v + 0.0); };
        std::vector<detail::config_item> items;
        for (std::size_t i = 0; i < layers_.size(); ++i)
            items.push_back({"layer #" + std::to_string(i), detail::layer_signature(layers_[i].host.name, layers_[i].host.description)});
        items.push_back({"the scalar type", sizeof(scalar_type) == sizeof(float) ? "float" : "double"});
        // Ranks of different methods or strategies would issue different collectives.
        items.push_back({"the compute method", ComputeMethod::name});
        items.push_back({"the assignment strategy", AssignmentStrategy::name});
        auto number = [&](const char* name, const hyperparameter<double>& h) {
            items.push_back({std::string("options.") + name, h.is_schedule() ? "a schedule" : exact_number_text(h(0))});
        };
        auto count = [&](const char* name, const hyperparameter<std::int64_t>& h) {
            items.push_back({std::string("options.") + name, h.is_schedule() ? "a schedule" : std::to_string(h(0))});
        };
        number("damping", options_.damping);
        number("factor_decay", options_.factor_decay);
        number("lr", options_.lr);
        items.push_back({"options.kl_clip", options_.kl_clip.is_schedule() ? "a schedule"
                                            : options_.kl_clip(0) ? exact_number_text(*options_.kl_clip(0))
                                                                  : "none"});
        count("factor_update_steps", options_.factor_update_steps);
        count("inv_update_steps", options_.inv_update_steps);
        auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
        items.push_back({"options.accumulation_steps", std::to_string(options_.accumulation_steps)});
        items.push_back({"options.compute_eigenvalue_outer_product", flag(options_.compute_eigenvalue_outer_product)});
        items.push_back({"options.eigenbasis_reuse_tolerance", exact_number_text(options_.eigenbasis_reuse_tolerance)});
        items.push_back({"options.conv_patches", options_.conv_patches == conv_patch_mode::reference ? "reference" : "dilated"});
        items.push_back({"options.strategy", options_.strategy == distribution::kaisa ? "kaisa" : "dp_kfac"});
        items.push_back({"options.grad_worker_fraction", exact_number_text(options_.grad_worker_fraction)});
        items.push_back({"options.colocate_factors", flag(options_.colocate_factors)});
        items.push_back({"options.allreduce_bucket_cap_mb", exact_number_text(options_.allreduce_bucket_cap_mb)});
        items.push_back({"options.symmetry_aware", flag(options_.symmetry_aware)});
        return items;
    }

    /// Ranks compare one digest of their configuration; when they differ, rank 0's
    /// configuration travels to every rank, and the first rank that differs names the first
    /// layer or option where it does. Collective.
    void check_configuration_agrees() {
        check_items_agree(configuration(), detail::configuration_subject, detail::configuration_fix);
    }

    /// Ranks compare one digest of `items`; when they differ, rank 0's items travel to every
    /// rank, and the first rank that differs names the first item where it does. `subject`
    /// names the items in the message, `fix` says what to do. Collective.
    void check_items_agree(const std::vector<detail::config_item>& items, const std::string& subject,
                           const std::string& fix) {
        const auto digests = comm_.allgather(detail::configuration_digest(items));
        if (std::all_of(digests.begin(), digests.end(), [&](auto d) { return d == digests[0]; })) return;
        const auto reference = detail::deserialize(comm_.broadcast_text(detail::serialize(items), 0));
        if (auto agreed = comm_.agree(detail::first_difference(reference, items, comm_.rank(), subject, fix)))
            throw error(*agreed);
        throw error("ranks disagree on " + subject + " (their digests differ). " + fix);
    }

    /// Once, at the first accumulate()/step(): checks that all ranks agree, places the
    /// second-order work and builds the communication groups. Collective.
    void setup() {
        if (started_) return;
        int threads = 1;
        agree_on([&] {
            threads = options_.threads > 0 ? options_.threads : detail::default_thread_count(comm_.size());
        });
        if constexpr (device_backend) threads = 1;  // a device backend queues from one host thread
        // Several ranks on one machine already use its cores: unless told otherwise, each rank
        // runs its BLAS single-threaded too. A BLAS thread pool per rank that spins while its
        // rank waits in a collective slowed a 2-rank step on 2 cores 100-fold (scipy-openblas32).
        const bool serial_blas = options_.threads == 0 && comm_.size() > 1 && !detail::thread_count_in_environment();
        check_configuration_agrees();
        const int me = comm_.rank();
        const bool eigen_product = options_.compute_eigenvalue_outer_product &&
                                   std::is_same_v<ComputeMethod, compute::eigendecomposition>;
        agree_on([&] {
            plan_ = distribution();
            if (plan_.kaisa() && !options_.colocate_factors && eigen_product)
                throw error("options.colocate_factors = false with compute_eigenvalue_outer_product: the "
                            "product needs both eigenvalue sets on one rank; set colocate_factors = true or "
                            "compute_eigenvalue_outer_product = false");
        });
        column_group_ = comm_.split(plan_.column_of(me));
        gradient_group_ = plan_.kaisa() ? comm_.split(plan_.row_of(me)) : comm_.world();
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            auto& l = layers_[i];
            l.role = plan_.role(i, me);
            if (l.role.grad_worker && !(l.role.computes_a && l.role.computes_g))
                method::prepare_receive(l.state.second, l.host.description, options_);
        }
        threads_ = threads;
        serial_blas_ = serial_blas;
        started_ = true;
    }

    /// The placement of every layer's work at this world size (a pure function of the
    /// layers and the options; kfac/assignment/distribution_plan.hpp). Strategies cost dense
    /// factors by dimension; a diagonal or unit-wise one of n stored entries counts as the
    /// dense ⌈√n⌉ × ⌈√n⌉ that holds as many (its storage; its O(n) work is smaller still).
    [[nodiscard]] assignment::distribution_plan distribution() const {
        std::vector<std::pair<std::int64_t, std::int64_t>> dims;
        for (const auto& l : layers_) {
            const auto& d = l.host.description;
            auto a = d.a_dim();
            if (d.a_structure() != factor_structure::dense) {
                const auto stored = static_cast<double>(d.a_storage_rows() * d.a_storage_cols());
                a = static_cast<std::int64_t>(std::ceil(std::sqrt(stored)));
            }
            dims.emplace_back(a, d.g_factor_dim());
        }
        return assignment::plan_distribution<AssignmentStrategy>(dims, comm_.size(), options_.strategy,
                                                                 options_.grad_worker_fraction, options_.colocate_factors);
    }

    /// Rows of this step's statistics so far, the pass just captured included.
    scalar_type total_rows(const layer_record& l) const {
        return (passes_ == 0 ? scalar_type(0) : l.state.captured_rows) + l.state.pass_rows;
    }
    /// Applications of the layer in this step so far, the pass just captured included.
    std::int64_t total_applications(const layer_record& l) const {
        return (passes_ == 0 ? 0 : l.state.captured_applications) + l.state.pass_applications;
    }

    /// Folds every application of this pass into a_sum/g_sum (scratch until the step
    /// commits; the first application of the step overwrites them); one task per factor.
    /// A group of a grouped convolution reads its own channels as the groups = 1 layer of its
    /// block (layer_description::group_block()).
    void capture_pass() {
        std::vector<detail::task> tasks;
        for (auto& l : layers_) {
            if (!l.role.holds_factors) continue;
            const std::int64_t n = l.scratch.applications;
            std::vector<tensor_view<const scalar_type>> a(static_cast<std::size_t>(n)), g(a.size());
            std::int64_t rows = 0;
            double a_elements = 0.0, g_elements = 0.0;
            const auto& d = l.host.description;
            const std::int64_t groups = d.groups();
            l.scratch.group_channels.resize(groups > 1 ? 2 * a.size() : 0);
            for (std::size_t i = 0; i < a.size(); ++i) {
                a[i] = detail::statistic_view(d, l.scratch.activations[i]);
                g[i] = detail::statistic_view(d, l.scratch.output_gradients[i]);
                if (groups > 1) {
                    a[i] = detail::gather_group_channels(a[i], l.host.group, groups, l.scratch.group_channels[2 * i]);
                    g[i] = detail::gather_group_channels(g[i], l.host.group, groups, l.scratch.group_channels[2 * i + 1]);
                }
                rows += detail::statistic_rows(d, a[i]);
                a_elements += static_cast<double>(a[i].size());
                g_elements += static_cast<double>(g[i].size());
            }
            l.state.pass_rows = static_cast<scalar_type>(rows);
            l.state.pass_applications = n;
            if (n == 0) continue;
            const std::int64_t folded = passes_ == 0 ? 0 : l.state.captured_applications;
            if (d.a_structure() == factor_structure::unit_wise) {  // one statistic of x̂ and dy together
                tasks.push_back(unit_wise_statistic_task(l, std::move(a), std::move(g), folded, a_elements));
                continue;
            }
            const double n_a = static_cast<double>(d.a_storage_cols()), n_g = static_cast<double>(d.g_dim());
            const layer_description block = d.group_block();
            // Cost ∝ rows of the product × n²: the input elements stand in for rows × n.
            tasks.push_back({a_elements * n_a, [&l, a = std::move(a), block, folded, this] {
                                 in_layer(l, [&] {
                                     for (std::size_t i = 0; i < a.size(); ++i)
                                         Backend::accumulate_a_statistic(l.state.a_sum, block, a[i],
                                                                         options_.conv_patches, first_beta(folded, i),
                                                                         l.scratch.a_ws);
                                 });
                             }});
            tasks.push_back({g_elements * n_g, [&l, g = std::move(g), block, folded] {
                                 in_layer(l, [&] {
                                     for (std::size_t i = 0; i < g.size(); ++i)
                                         Backend::accumulate_g_statistic(l.state.g_sum, block, g[i],
                                                                         first_beta(folded, i), l.scratch.g_ws);
                                 });
                             }});
        }
        agree_on([&] { detail::run_tasks<typename Backend::serial_blas_scope>(tasks, threads_); });
    }

    /// The unit-wise blocks of a normalisation layer from its applications' x̂ and dy views
    /// (its G, the identity, has no statistic).
    detail::task unit_wise_statistic_task(layer_record& l, std::vector<tensor_view<const scalar_type>> a,
                                          std::vector<tensor_view<const scalar_type>> g, std::int64_t folded,
                                          double elements) {
        if constexpr (detail::backend_with_unit_wise_factors<Backend>) {
            return {elements * 3.0, [&l, a = std::move(a), g = std::move(g), folded] {
                        in_layer(l, [&] {
                            for (std::size_t i = 0; i < a.size(); ++i)
                                Backend::accumulate_unit_wise_statistic(l.state.a_sum, l.host.description, a[i], g[i],
                                                                        first_beta(folded, i), l.scratch.a_ws);
                        });
                    }};
        } else {
            return {0.0, [] {}};  // not reached: registration refuses the layer on such a backend
        }
    }

    /// β of an application's statistic: 0 for the step's first (it overwrites the sum left
    /// by the previous step), 1 after.
    static scalar_type first_beta(std::int64_t folded_before, std::size_t i) {
        return folded_before == 0 && i == 0 ? scalar_type(0) : scalar_type(1);
    }

    /// Tells every layer's host that the current pass has been read (traits' end_pass), once
    /// per layer (a grouped convolution's records share their layer).
    void end_pass() {
        for (auto& l : layers_)
            if (l.host.end_pass && l.host.group == 0) in_layer(l, [&] { l.host.end_pass(l.host.layer); });
    }

    /// The last use of the host's pass: its statistics on a factor-update step, then
    /// end_pass(), agreed by every rank. Both come before the factors, the second-order data
    /// or the host's gradients change; if either fails (on any rank), the statistics that
    /// accumulate() folded in before are put back, so a retry sees the step as it was.
    void finish_pass(bool factor_update) {
        std::vector<std::pair<matrix, matrix>> folded;  // a_sum, g_sum before this pass (accumulate() passes only)
        if (factor_update && passes_ > 0)
            for (const auto& l : layers_) folded.emplace_back(l.state.a_sum, l.state.g_sum);
        try {
            if (factor_update) capture_pass();
            agree_on([&] { end_pass(); });
        } catch (...) {
            for (std::size_t i = 0; i < folded.size(); ++i) {
                layers_[i].state.a_sum = std::move(folded[i].first);
                layers_[i].state.g_sum = std::move(folded[i].second);
            }
            throw;
        }
    }

    /// Running averages F ← ξF + (1 − ξ)F̂, F̂ the mean of the step's applications' batch
    /// statistics. Under KAISA with several ranks F̂ is the average of the ranks' batch
    /// statistics weighted by their rows (equal to KAISA's plain average for equal local
    /// batches, and exact for unequal ones), summed in one bucketed allreduce pass that also
    /// carries the weights. A layer applied nowhere in the step keeps its factors as they are.
    void update_factors(const detail::step_plan& plan, step_outcome& outcome) {
        const double decay = plan.factor_decay;
        const auto xi = static_cast<scalar_type>(decay);
        const bool averaged = options_.strategy == distribution::kaisa && comm_.size() > 1;
        std::vector<scalar_type> weights;
        if (averaged) {
            std::vector<allreduce_item<scalar_type>> items;
            for (auto& l : layers_) {
                // Mean over applications, times this rank's rows: Σ_r rows_r · F̂_r is summed.
                const auto rows = total_rows(l);
                const auto applications = total_applications(l);
                if (applications == 0) {  // this rank contributes nothing (the sums are stale)
                    const auto& d = l.host.description;
                    l.state.a_sum = Backend::zeros(d.a_storage_rows(), d.a_storage_cols());
                    l.state.g_sum = Backend::zeros(d.g_factor_dim(), d.g_factor_dim());
                } else {
                    const auto w = rows / static_cast<scalar_type>(applications);
                    scale_a_statistic(l, w);
                    Backend::scale_symmetric(l.state.g_sum, w);
                }
                for (matrix* sum : {&l.state.a_sum, &l.state.g_sum}) {  // a diagonal A or unit-wise blocks are no triangle
                    const auto n = static_cast<std::size_t>(sum->size());
                    const bool triangle = sum->cols() == sum->rows() && !(sum == &l.state.a_sum && unit_wise(l));
                    items.push_back({staging_.stage(sum->data(), n, true, true), n, triangle, sum->rows()});
                }
                weights.push_back(rows);
            }
            items.push_back({weights.data(), weights.size(), false, 0});
            const auto cap = static_cast<std::size_t>(options_.allreduce_bucket_cap_mb * 1024.0 * 1024.0);
            comm_.allreduce_sum(items, cap, options_.symmetry_aware, comm_.world());
            staging_.complete();
        }
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            auto& l = layers_[i];
            if (!l.role.holds_factors) continue;
            const double count = averaged ? static_cast<double>(weights[i]) : static_cast<double>(total_applications(l));
            if (count == 0.0) continue;  // applied on no rank in this step: no data, no decay
            const auto weight = static_cast<scalar_type>((1.0 - decay) / count);
            if (a_statistic_finite(l) && Backend::lower_all_finite(l.state.g_sum)) {
                average_a_factor(l, xi, weight);
                if (l.host.description.g_structure() == factor_structure::dense)  // the identity stays
                    Backend::running_average(l.state.g_factor, l.state.g_sum, xi, weight);
            } else {
                outcome.add(l, non_finite_source::factor_statistics, plan.step, &health_counters::skipped_factor_updates);
            }
        }
    }

    // A dense factor's statistic is the lower triangle of a symmetric matrix (mirrored before
    // use). Unit-wise blocks are no triangle, whatever their shape (C × 3 is square for C = 3):
    // every entry is checked, scaled and averaged as it is.
    static bool unit_wise(const layer_record& l) {
        return l.host.description.a_structure() == factor_structure::unit_wise;
    }
    static bool a_statistic_finite(const layer_record& l) {
        return unit_wise(l) ? Backend::all_finite(l.state.a_sum) : Backend::lower_all_finite(l.state.a_sum);
    }
    static void scale_a_statistic(layer_record& l, scalar_type s) {
        if constexpr (detail::backend_with_unit_wise_factors<Backend>)
            if (unit_wise(l)) return Backend::scale_blocks(l.state.a_sum, s);
        Backend::scale_symmetric(l.state.a_sum, s);
    }
    static void average_a_factor(layer_record& l, scalar_type decay, scalar_type weight) {
        if constexpr (detail::backend_with_unit_wise_factors<Backend>)
            if (unit_wise(l)) return Backend::average_blocks(l.state.a_factor, l.state.a_sum, decay, weight);
        Backend::running_average(l.state.a_factor, l.state.a_sum, decay, weight);
    }

    /// Dense factors this rank decomposed or kept the basis of (eigenbasis_counts()).
    void count_bases(const layer_record& l, const typename method::factor_data& a, const typename method::factor_data& g) {
        if constexpr (requires { a.reused_basis; }) {
            const auto count = [&](bool computes, factor_structure s, const typename method::factor_data& f) {
                if (computes && s == factor_structure::dense) ++(f.reused_basis ? bases_.reused : bases_.decomposed);
            };
            count(l.role.computes_a, l.host.description.a_structure(), a);
            count(l.role.computes_g, l.host.description.g_structure(), g);
        }
    }

    /// `reuse_bases`: options.eigenbasis_reuse_tolerance may keep a factor's previous
    /// eigenvectors (only data this rank computed in an earlier update counts as previous).
    void update_second_order(const detail::step_plan& plan, step_outcome& outcome, bool reuse_bases = true) {
        const double damping = plan.damping;
        second_order_damping_ = damping;
        // Decompose every factor this rank owns as independent tasks, then apply the results
        // and share them in layer order (every rank issues the broadcasts in that order).
        struct result {
            typename method::factor_data a, g;
            bool ok_a = true, ok_g = true;
        };
        std::vector<result> results(layers_.size());
        std::vector<detail::task> tasks;
        const typename method::factor_data none{};
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            auto& l = layers_[i];
            auto& r = results[i];
            const auto& d = l.host.description;
            // Before the first update a receiver's buffers are sized but hold nothing.
            const bool has_previous = reuse_bases && l.state.has_second;
            const auto* previous_a = has_previous ? &l.state.second.a : &none;
            const auto* previous_g = has_previous ? &l.state.second.g : &none;
            const double n_a = static_cast<double>(d.a_dim()), n_g = static_cast<double>(d.g_factor_dim());
            const double a_cost = d.a_structure() == factor_structure::dense
                                      ? n_a * n_a * n_a
                                      : static_cast<double>(d.a_storage_rows() * d.a_storage_cols());
            if (l.role.computes_a)
                tasks.push_back({a_cost, [&l, &r, previous_a, damping, this] {
                                     in_layer(l, [&] {
                                         r.ok_a = method::compute_factor(l.state.a_factor, l.host.description.a_structure(),
                                                                         damping, options_, *previous_a, r.a);
                                     });
                                 }});
            if (l.role.computes_g)
                tasks.push_back({n_g * n_g * n_g, [&l, &r, previous_g, damping, this] {
                                     in_layer(l, [&] {
                                         r.ok_g = method::compute_factor(l.state.g_factor, l.host.description.g_structure(),
                                                                         damping, options_, *previous_g, r.g);
                                     });
                                 }});
        }
        agree_on([&] { detail::run_tasks<typename Backend::serial_blas_scope>(tasks, threads_); });
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            auto& l = layers_[i];
            auto& r = results[i];
            const auto& p = l.role;
            if (p.computes_a || p.computes_g) {
                if (r.ok_a && r.ok_g) {
                    count_bases(l, r.a, r.g);
                    if (p.computes_a) l.state.second.a = std::move(r.a);
                    if (p.computes_g) l.state.second.g = std::move(r.g);
                    if (p.computes_a && p.computes_g) method::finalize_layer(l.state.second, damping, options_);
                    l.state.has_second = true;
                } else {
                    outcome.add(l, non_finite_source::decomposition, plan.step, &health_counters::kept_decompositions);
                    if (!l.state.has_second) {  // nothing to keep: precondition with the identity's data
                        method::identity_data(l.state.second, l.host.description, damping, options_);
                        l.state.has_second = true;
                    }
                }
            }
            if (p.share_second_order) {
                method::for_each_payload(l.state.second, 'A', [&](scalar_type* d, std::size_t n) {
                    comm_.broadcast(staging_.stage(d, n, p.computes_a, !p.computes_a), n, p.a_root, column_group_);
                });
                method::for_each_payload(l.state.second, 'G', [&](scalar_type* d, std::size_t n) {
                    comm_.broadcast(staging_.stage(d, n, p.computes_g, !p.computes_g), n, p.g_root, column_group_);
                });
                l.state.has_second = true;
            }
        }
        comm_.wait();
        staging_.complete();
    }

    /// Pᵀ of every layer into l.scratch.preconditioned (shared from the gradient workers), then the
    /// verdict per layer: a layer whose Γ or P is not finite on any rank is zeroed on every
    /// rank, so ranks never drift apart (a host that forgot to average its gradients, say).
    void precondition_all(const detail::step_plan& plan, step_outcome& outcome) {
        const double damping = plan.damping;
        std::vector<detail::task> tasks;
        for (auto& l : layers_) {
            if (!l.scratch.active) continue;  // no gradient: nothing to precondition or share
            const auto& d = l.host.description;
            const double n_a = static_cast<double>(d.a_dim()), n_g = static_cast<double>(d.g_dim());
            const double a_side = d.a_structure() == factor_structure::diagonal ? 1.0 : n_a;  // a row scaling
            // Unit-wise blocks: an a_dim × a_dim product per channel, no G side.
            const double cost = d.a_structure() == factor_structure::unit_wise ? n_a * n_a * n_g : n_a * n_g * (a_side + n_g);
            tasks.push_back({cost, [&l, damping, this] { in_layer(l, [&] {
                                 load_gradient(l);
                                 if (!l.role.grad_worker)
                                     l.scratch.preconditioned.resize(l.host.description.a_dim(), l.host.description.g_dim());
                                 else if (!Backend::all_finite(l.scratch.gamma))
                                     l.scratch.preconditioned = Backend::zeros(l.host.description.a_dim(), l.host.description.g_dim());
                                 else if (l.state.has_second)
                                     method::precondition(l.state.second, l.scratch.gamma, damping, options_, l.scratch.method_ws,
                                                          l.scratch.preconditioned);
                                 else
                                     l.scratch.preconditioned = l.scratch.gamma;  // no second-order data yet: plain SGD
                             }); }});
        }
        agree_on([&] { detail::run_tasks<typename Backend::serial_blas_scope>(tasks, threads_); });
        for (auto& l : layers_)
            if (l.role.share_gradient && l.scratch.active) {
                const auto n = static_cast<std::size_t>(l.scratch.preconditioned.size());
                comm_.broadcast(staging_.stage(l.scratch.preconditioned.data(), n, l.role.grad_worker, !l.role.grad_worker), n,
                                l.role.grad_root, gradient_group_);
            }
        comm_.wait();
        staging_.complete();
        std::vector<std::int64_t> unusable(layers_.size());
        for (std::size_t i = 0; i < layers_.size(); ++i)
            unusable[i] = layers_[i].scratch.active && !(Backend::all_finite(layers_[i].scratch.gamma) &&
                                                         Backend::all_finite(layers_[i].scratch.preconditioned));
        comm_.allreduce_max(unusable);
        for (std::size_t i = 0; i < layers_.size(); ++i) {
            auto& l = layers_[i];
            l.scratch.usable = unusable[i] == 0;
            if (l.scratch.usable) continue;
            l.scratch.preconditioned = Backend::zeros(l.host.description.a_dim(), l.host.description.g_dim());
            outcome.add(l, non_finite_source::gradient, plan.step, &health_counters::zeroed_gradients);
        }
    }

    /// l.scratch.gamma ← Γᵀ (A_dim × G_dim) from the host's gradient views (read by
    /// check_gradients(): the record's group rows of the layer's).
    static void load_gradient(layer_record& l) {
        const auto w = as_const(l.scratch.weight_gradient);
        if constexpr (detail::backend_with_diagonal_factors<Backend>)
            if (l.host.description.weight_is_in_by_out()) return Backend::load_gradient_transposed(l.scratch.gamma, w);
        Backend::load_gradient(l.scratch.gamma, w, as_const(l.scratch.bias_gradient));
    }
    /// The host's gradient views ← scale · Pᵀ, as load_gradient read them.
    static void store_gradient(layer_record& l, scalar_type scale) {
        const auto& w = l.scratch.weight_gradient;
        if constexpr (detail::backend_with_diagonal_factors<Backend>)
            if (l.host.description.weight_is_in_by_out())
                return Backend::store_gradient_transposed(l.scratch.preconditioned, scale, w);
        Backend::store_gradient(l.scratch.preconditioned, scale, w, l.scratch.bias_gradient);
    }

    /// ν = min(1, √(κ / |η² Σ_layers ⟨P, Γ⟩|)), 1 without kl_clip or when the sum is 0.
    double kl_clip_scale(const detail::step_plan& plan) const {
        if (!plan.kl_clip) return 1.0;
        double vg_sum = 0.0;
        for (const auto& l : layers_)
            if (l.scratch.active && l.scratch.usable) vg_sum += Backend::frobenius_dot(l.scratch.preconditioned, l.scratch.gamma);
        vg_sum *= plan.lr * plan.lr;
        return vg_sum == 0.0 ? 1.0 : std::min(1.0, std::sqrt(*plan.kl_clip / std::abs(vg_sum)));
    }

    void write_back(double scale) {
        for (auto& l : layers_)
            if (l.scratch.active) in_layer(l, [&] {
                store_gradient(l, static_cast<scalar_type>(scale));
            });
    }

    /// The step is done: count it, then tell the host what was contained. The callback runs
    /// last, so whatever it throws, the gradients are written and nothing non-finite is left
    /// in them; every event is delivered and the first exception is rethrown.
    void commit(const detail::step_plan& plan, double scale, step_outcome outcome) {
        if (plan.factor_update) {
            passes_ = 0;
            applied_in_step_ = false;
        }
        last_kl_scale_ = scale;
        health_.skipped_factor_updates += outcome.health.skipped_factor_updates;
        health_.kept_decompositions += outcome.health.kept_decompositions;
        health_.zeroed_gradients += outcome.health.zeroed_gradients;
        ++steps_;
        if (!on_non_finite_) return;
        std::exception_ptr first;
        for (const auto& event : outcome.events) {
            try {
                on_non_finite_(event);
            } catch (...) {
                if (!first) first = std::current_exception();
            }
        }
        if (first) std::rethrow_exception(first);
    }

    options options_;
    CommPolicy comm_;
    std::vector<std::regex> skip_patterns_;
    std::vector<std::regex> reduce_patterns_;  // options.reduce_layers
    std::vector<layer_record> layers_;
    std::int64_t steps_ = 0;
    std::int64_t passes_ = 0;  // forward/backward passes folded into the current statistics
    bool applied_in_step_ = false;  // some layer was applied in a pass accumulate() folded in
    bool started_ = false;
    double last_kl_scale_ = 1.0;
    double second_order_damping_ = 0.0;  // of the last inverse update (checkpoints record it)
    health_counters health_{};
    eigenbasis_count bases_{};
    std::function<void(const non_finite_event&)> on_non_finite_;
    detail::host_staging<Backend> staging_{};  // device data through host memory for comm
    assignment::distribution_plan plan_{};  // where each layer's work runs (from setup())
    group column_group_{};
    group gradient_group_{};
    int threads_ = 1;
    bool serial_blas_ = false;  // the whole step with single-threaded BLAS (several ranks)
};

}  // namespace kfac
