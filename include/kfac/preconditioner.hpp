// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file preconditioner.hpp
/// `kfac::preconditioner<Backend, CommPolicy, ComputeMethod, AssignmentStrategy>`: registers
/// layers through kfac::layer_traits and, at each step(), replaces their weight and bias
/// gradients in place by K-FAC preconditioned ones (golden/README.md is the contract).
///
/// This class is the API; detail::engine (kfac/detail/engine.hpp) does the work, in the rooms
/// the includes below list in the order of a step, and step() below is the pipeline.
///
/// Threads: one call at a time. step(), accumulate(), save(), load(), registration and
/// curvature() called while another of them is in progress on the same object (from another
/// thread, or from the on_non_finite callback) raise a kfac::error and do nothing; the call in
/// progress completes. The other members read state these calls change: call them when none
/// is in progress. Different preconditioners may step on different threads (over one process
/// group too: kfac/comm/process_group.hpp).

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <istream>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kfac/assignment/strategies.hpp"
#include "kfac/checkpoint/format.hpp"
#include "kfac/config.hpp"
#include "kfac/curvature_report.hpp"
#include "kfac/detail/call_guard.hpp"
#include "kfac/detail/phase_timer.hpp"
#include "kfac/detail/engine.hpp"
#include "kfac/detail/engine_registration.hpp"  // layers in
#include "kfac/detail/engine_setup.hpp"         // options, configuration, placement, reports
#include "kfac/detail/engine_read.hpp"          // plan: scheduled values and the host's views
#include "kfac/detail/engine_loss_scale.hpp"    // overflow vote and skipped steps
#include "kfac/detail/engine_factors.hpp"       // capture, end of pass, running factors
#include "kfac/detail/engine_second_order.hpp"  // decompositions or inverses, shared
#include "kfac/detail/engine_precondition.hpp"  // precondition, kl_clip, write-back, commit
#include "kfac/detail/engine_checkpoint.hpp"    // save and load
#include "kfac/detail/engine_curvature.hpp"     // the curvature report
#include "kfac/fwd.hpp"
#include "kfac/health.hpp"
#include "kfac/layer_info.hpp"
#include "kfac/options.hpp"
#include "kfac/step_times.hpp"

namespace kfac {

/// The K-FAC preconditioner: step() replaces the weight and bias gradients of the registered layers
/// in place by K-FAC preconditioned ones; kfac::KFAC is its alias.
/// @tparam Backend storage and linear algebra (kfac::backend::cpu_eigen<Scalar>).
/// @tparam CommPolicy collectives (kfac::comm::serial).
/// @tparam ComputeMethod kfac::compute::eigendecomposition or kfac::compute::inverse.
/// @tparam AssignmentStrategy where second-order work runs (kfac::assignment::*).
template <class Backend, class CommPolicy, class ComputeMethod, class AssignmentStrategy>
class preconditioner {
    using engine_type = detail::engine<Backend, CommPolicy, ComputeMethod>;
    /// Whether the compute method re-estimates a scaling at factor updates (compute::ekfac):
    /// last_step_times() then counts that in second_order.
    static constexpr bool estimates_scaling = detail::method_estimating_scaling<typename engine_type::method>;

public:
    /// The Backend policy: storage and linear algebra.
    using backend_type = Backend;
    /// The ComputeMethod policy: eigendecompositions or inverses.
    using compute_method = ComputeMethod;
    /// The backend's compute type (float or double), in which factors and gradients are kept.
    using scalar_type = typename Backend::scalar_type;
    /// The backend's matrix type, which a_factor() and g_factor() return.
    using matrix = typename Backend::matrix;
    /// What eigenbasis_counts() returns (kfac/health.hpp).
    using eigenbasis_count = kfac::eigenbasis_count;

    /// Collective under a CommPolicy with several ranks: every rank constructs its
    /// preconditioner together, and an invalid option on any rank is an error on all.
    /// @throws kfac::error if an option is out of range or a skip pattern is not a regex.
    explicit preconditioner(options opts = {}, CommPolicy comm = {})
        : engine_(std::move(opts), std::move(comm), detail::assignment_policy_of<AssignmentStrategy>()) {}

    /// Registers a layer under a unique name. The preconditioner keeps a pointer to `layer`,
    /// which must outlive it. Register every layer before the first step(). A grouped
    /// convolution of g groups becomes g blocks named "<name>/group0" ... "<name>/group<g-1>"
    /// (a_factor(), layers() and checkpoints use those names).
    /// @return false if options.skip_layers matched the layer (it is then not registered).
    /// @throws kfac::error for a duplicate name, an invalid description, or registration
    ///         after the first step; nothing is registered then.
    template <class Layer>
    bool register_layer(const std::string& name, Layer& layer) {
        const auto call = calls_.enter("register_layer()");
        return engine_.register_layer(name, layer);
    }

    /// Registers several layers of one type, all or none: every layer is checked (as
    /// register_layer() checks one, and against the others of the list) before any is
    /// registered.
    /// @return the number of layers registered (options.skip_layers may leave some out).
    /// @throws kfac::error as register_layer(); nothing is registered then.
    template <class Layer>
    std::size_t register_layers(const std::vector<std::pair<std::string, Layer*>>& list) {
        const auto call = calls_.enter("register_layers()");
        return engine_.register_layers(list);
    }

    /// Folds the current forward/backward pass into the batch statistics. With
    /// accumulation_steps = m, call it after each of the first m − 1 passes of a step; step()
    /// takes the last pass itself. Reads nothing on steps that do not update factors.
    /// Collective under a CommPolicy with several ranks.
    /// @throws kfac::error on a view that disagrees with its layer, when called m times, or
    ///         when the host's adapter throws (raised on every rank); the preconditioner,
    ///         the statistics of earlier passes included, is then as it was before the call.
    void accumulate() {
        const auto call = calls_.enter("accumulate()");
        engine_.accumulate();
    }

    /// One preconditioning step, the pipeline of K-FAC:
    ///   plan     read every scheduled option and every view the host's adapter gives, and
    ///            check them (agreed by all ranks, scheduled values included)
    ///   overflow with a loss scale: skip the step if any rank's gradients overflowed
    ///   capture  this pass's factor statistics        (factor-update steps)
    ///   end pass tell the host its pass was read      (agreed by all ranks)
    ///   update   running factors, averaged over ranks (factor-update steps)
    ///   decompose and share the second-order data     (inverse-update steps); under
    ///            compute::ekfac, re-estimate its scaling (factor-update steps)
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
    /// With options.loss_scale, a step that overflowed on any rank stops after the plan
    /// (`overflow` below) and changes nothing: see step_result::skipped.
    step_result step() {
        const auto call = calls_.enter("step()");
        detail::phase_timer timer(last_step_times_);  // a lap as each phase ends (last_step_times())
        engine_.setup();
        const detail::step_plan plan = engine_.read_plan();
        if (engine_.overflowed(plan)) {  // overflow: the loss scale was too large for this step
            engine_.skip();
            timer.lap(step_phase::plan);
            return {plan.step, false, false, true, 1.0};
        }
        timer.lap(step_phase::plan);
        const typename engine_type::blas_threads_guard blas_threads(engine_.serial_blas());
        typename engine_type::step_outcome outcome;
        engine_.finish_pass(plan.factor_update, plan.loss_scale, /*last_pass=*/true);
        timer.lap(step_phase::capture);
        if (plan.factor_update) engine_.update_factors(plan, outcome);
        timer.lap(step_phase::factors, plan.factor_update);
        if (plan.inverse_update) engine_.update_second_order(plan, outcome);
        if (plan.factor_update) engine_.update_scaling(plan, outcome);  // compute::ekfac's S
        timer.lap(step_phase::second_order, plan.inverse_update || (plan.factor_update && estimates_scaling));
        engine_.precondition_all(plan, outcome);
        timer.lap(step_phase::precondition);
        const double scale = engine_.kl_clip_scale(plan);
        timer.lap(step_phase::kl_clip);
        engine_.write_back(plan, scale, outcome);
        timer.lap(step_phase::write_back);
        engine_.commit(plan, scale, std::move(outcome));
        timer.lap(step_phase::commit);
        return {plan.step, plan.factor_update, plan.inverse_update, false, scale};
    }

    /// Saves the state to `path` (kfac/checkpoint/format.hpp): the step count, every layer's
    /// running factors and, unless `o` leaves it out, the second-order data in force, so that
    /// load() continues exactly where this run is. Written atomically (a temporary file, then
    /// a rename). Collective: every rank calls it, rank 0 writes the file.
    /// @throws kfac::error (on every rank) when the file cannot be written, or between
    ///         accumulate() and step(); the preconditioner is unchanged either way.
    void save(const std::filesystem::path& path, const checkpoint::save_options& o = {}) {
        const auto call = calls_.enter("save()");
        engine_.save(path, o);
    }
    /// The bytes save() would write: on rank 0; other ranks get an empty string. Collective.
    [[nodiscard]] std::string save_bytes(const checkpoint::save_options& o = {}) {
        const auto call = calls_.enter("save_bytes()");
        return engine_.save_bytes(o);
    }
    /// Writes the bytes to `out` on rank 0 (other ranks leave theirs untouched). Collective.
    void save(std::ostream& out, const checkpoint::save_options& o = {}) {
        const auto call = calls_.enter("save()");
        engine_.save(out, o);
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
        const auto call = calls_.enter("load()");
        engine_.load(path, o);
    }
    /// load() from bytes save_bytes() returned; read on rank 0 (others may pass nothing).
    void load_bytes(std::string_view bytes, const checkpoint::load_options& o = {}) {
        const auto call = calls_.enter("load_bytes()");
        engine_.load_bytes(bytes, o);
    }
    /// load() from a stream, read to its end on rank 0 (others may pass any stream).
    void load(std::istream& in, const checkpoint::load_options& o = {}) {
        const auto call = calls_.enter("load()");
        engine_.load(in, o);
    }

    /// Number of completed step() calls.
    [[nodiscard]] std::int64_t steps() const noexcept { return engine_.steps(); }
    /// Registered blocks: one per layer, and one per group of a grouped convolution.
    [[nodiscard]] std::size_t layer_count() const noexcept { return engine_.layer_count(); }
    /// Whether a layer (or a group block, "<name>/group<j>") of that name is registered.
    [[nodiscard]] bool is_registered(const std::string& name) const { return engine_.is_registered(name); }
    /// Running A factor of a layer (the identity before its first update); a diagonal one
    /// (an Embedding's) as its a_dim × 1 diagonal. With options.factor_storage, the stored
    /// factor widened: a copy that the next call for the same layer and factor replaces.
    [[nodiscard]] const matrix& a_factor(const std::string& name) const { return engine_.factor(name, true); }
    /// Running G factor of a layer.
    [[nodiscard]] const matrix& g_factor(const std::string& name) const { return engine_.factor(name, false); }
    /// ν of the last step (1 when kl_clip is off or did not bind).
    [[nodiscard]] double last_kl_scale() const noexcept { return engine_.last_kl_scale(); }
    /// Seconds the last step() spent in each of its phases, as the host saw them
    /// (kfac/step_times.hpp); all 0 before the first step. A step that failed leaves what it
    /// measured up to the failure.
    [[nodiscard]] const step_times& last_step_times() const noexcept { return last_step_times_; }
    /// Counts of the non-finite values contained so far (kfac/health.hpp); load() sets them to the
    /// ones the file recorded.
    [[nodiscard]] const health_counters& health() const noexcept { return engine_.health(); }
    /// Dense factors this rank has computed second-order data for since construction (not
    /// saved in checkpoints): with options.eigenbasis_reuse_tolerance, how many kept their
    /// previous eigenvectors and how many were decomposed (every one without it).
    [[nodiscard]] eigenbasis_count eigenbasis_counts() const noexcept { return engine_.eigenbasis_counts(); }
    /// Called (on the thread that runs step()) for every contained non-finite event.
    void on_non_finite(std::function<void(const non_finite_event&)> callback) {
        engine_.on_non_finite(std::move(callback));
    }
    /// The options the preconditioner was constructed with.
    [[nodiscard]] const options& get_options() const noexcept { return engine_.get_options(); }
    /// Ranks that compute a layer's A and G second-order data.
    [[nodiscard]] assignment::factor_workers workers(const std::string& name) const { return engine_.workers(name); }
    /// Every registered layer in registration order, with where its work runs: the
    /// placement in force, or the one the first step will use. Not collective.
    /// @throws kfac::error when the options do not fit the world size (as step() would).
    [[nodiscard]] std::vector<layer_info> layers() const { return engine_.layers(); }
    /// How much of each layer's preconditioner is curvature (kfac/curvature_report.hpp): the
    /// identity start's weight left in the running factors, their eigenvalues, the damping an
    /// inverse update at this step would use and the resulting curvature share. Decomposes the
    /// factors this rank keeps (a diagnostic: call it once an epoch, not every step). Not
    /// collective.
    [[nodiscard]] std::vector<layer_curvature> curvature() const {
        const auto call = calls_.enter("curvature()");
        return engine_.curvature();
    }
    /// Bytes this rank holds for K-FAC, by kind (kfac::memory_report). Not collective.
    [[nodiscard]] memory_report memory_usage() const { return engine_.memory_usage(); }
    /// Name of the distribution in force: comm_opt, hybrid_opt, mem_opt or dp_kfac.
    [[nodiscard]] std::string strategy_name() const { return engine_.strategy_name(); }
    /// The communication policy it was constructed with.
    [[nodiscard]] const CommPolicy& comm() const noexcept { return engine_.comm(); }
    /// The communication policy it was constructed with, for non-const calls.
    [[nodiscard]] CommPolicy& comm() noexcept { return engine_.comm(); }

private:
    engine_type engine_;
    /// The call in progress (kfac/detail/call_guard.hpp): a second one, from another thread, is
    /// refused. mutable: curvature() is const but decomposes the factors a step changes.
    mutable detail::exclusive_calls calls_;
    step_times last_step_times_{};
};

}  // namespace kfac
