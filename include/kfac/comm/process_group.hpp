// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file process_group.hpp
/// The communication policy over a LibTorch `c10d::ProcessGroup` (CMake target kfac::c10d):
/// the Gloo or NCCL process group a data-parallel LibTorch program already has. The contract
/// is documented in kfac/comm/serial.hpp; the guarantees are those of kfac::comm::mpi.
///
/// The world's collectives run on the caller's process group, in the order every rank issues
/// them: the host must not run its own collectives on that group from another thread while a
/// kfac call is in progress (DDP's gradient allreduce has completed when the optimizer step
/// runs). KAISA's groups of some ranks are new process groups that `make_group` builds over
/// the caller's store under the prefix "kfac/<policy>/<split>/<color>/", as
/// torch.distributed.new_group builds its groups; kfac/comm/process_group_gloo.hpp makes Gloo
/// ones with the world's devices and timeout.
///
/// Several policies over one process group, in preconditioners that step at the same time on
/// different threads: a process group matches collectives by the order each rank issues them,
/// so two preconditioners' collectives interleaved differently on two ranks would meet the
/// wrong peers (Gloo aborts on the sizes, or sums unrelated data of the same size), and neither
/// a lock nor refusing the second caller can make every rank pick the same order. So the first
/// policy alive over a process group in this process uses it, and each policy constructed while
/// another is alive builds a world of its own over the store (`make_group` under
/// "kfac/world/<n>/", n counting such worlds in the order they are built): their collectives
/// never meet. Its constructor is then collective: every rank constructs its policies over the
/// group in the same order, as torch.distributed.new_group requires of its callers.
///
/// No hang: every wait is bounded by `timeout`; a collective that does not complete in time,
/// or fails (a peer died, a connection closed), raises a kfac::error naming this rank and the
/// phase of the step it belonged to. The ranks still running reach the same error in the same
/// phase when their own wait runs out.
///
/// Payloads are host memory by default: a device backend's data goes through kfac's host
/// staging (kfac/detail/host_staging.hpp), as with a MPI that is not CUDA-aware. Given a
/// `payload_device`, payloads are that device's memory and travel as its tensors
/// (kfac/comm/process_group_payloads.hpp): ProcessGroupNCCL with kfac's CUDA backend
/// (kfac/comm/process_group_nccl.hpp), which then stages nothing. Control values (agreement,
/// digests, votes) go through that device too, as NCCL takes device tensors only.
///
/// LibTorch 2 splits a process group from its backends: ProcessGroupGloo and ProcessGroupNCCL
/// are c10d::Backend there, and c10d::ProcessGroup in LibTorch 1.13. The policy calls the
/// collectives of `c10d_collectives`, whichever that is, and takes a LibTorch 2
/// c10d::ProcessGroup too (its backend for the payloads' device).

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/comm/buckets.hpp"
#include "kfac/comm/process_group_payloads.hpp"
#include "kfac/comm/serial.hpp"
#include "kfac/config.hpp"

namespace kfac::comm {

namespace detail {
/// LibTorch 2: a c10d::ProcessGroup holds one c10d::Backend per device type.
template <class ProcessGroup>
concept holds_backends = requires(ProcessGroup& pg) { pg.getBackend(c10::DeviceType::CPU); };

/// A policy's place among the policies alive over one caller's process group in this process
/// (see the file comment): the first uses the group; a later one is given the number of the
/// world it builds of its own, counted per group and never reused (a prefix store's keys
/// outlive its group). Released when the policy goes.
class world_membership {
public:
    explicit world_membership(const void* world) : world_(world) {
        const std::lock_guard<std::mutex> lock(mutex());
        entry& e = entries()[world_];
        if (e.alive++ > 0) own_world_ = e.built++;
    }
    world_membership(const world_membership&) = delete;
    world_membership& operator=(const world_membership&) = delete;
    ~world_membership() {
        const std::lock_guard<std::mutex> lock(mutex());
        --entries()[world_].alive;
    }
    /// The number of the world this policy builds, or nothing when it uses the caller's.
    [[nodiscard]] std::optional<std::int64_t> own_world() const noexcept { return own_world_; }

private:
    struct entry {
        int alive = 0;
        std::int64_t built = 0;
    };
    static std::mutex& mutex() {
        static std::mutex m;
        return m;
    }
    static std::map<const void*, entry>& entries() {
        static std::map<const void*, entry> e;
        return e;
    }
    const void* world_;
    std::optional<std::int64_t> own_world_;
};
}  // namespace detail

/// What the policy runs collectives on: c10d::Backend in LibTorch 2 (ProcessGroupGloo and
/// ProcessGroupNCCL derive from it), c10d::ProcessGroup in LibTorch 1.13 (they derive from it).
using c10d_collectives = std::conditional_t<detail::holds_backends<::c10d::ProcessGroup>, ::c10d::Backend,
                                            ::c10d::ProcessGroup>;

/// Builds the process group of `size` ranks in which this rank is `rank`, over `store` (a
/// prefix store that only the group's members use).
using group_factory = std::function<c10::intrusive_ptr<c10d_collectives>(
    const c10::intrusive_ptr<::c10d::Store>& store, int rank, int size)>;

/// c10d transport. Move-only; copies of the caller's process group and store are shared.
class process_group {
public:
    /// A group of ranks: its process group (none for a group of one rank).
    struct group {
        c10::intrusive_ptr<c10d_collectives> pg;  ///< null for a group of one rank
        int size = 1;                             ///< its number of ranks
    };

    /// @param world the caller's process group over every rank
    /// @param store the store it was built over; KAISA's groups rendezvous through it
    /// @param make_group builds those groups (kfac::comm::gloo_groups for Gloo)
    /// @param timeout the longest any collective may take before it is an error, at most
    ///        longest_timeout
    /// @param payload_device none: payloads are host memory; a device: they are that device's
    ///        memory (kfac's CUDA backend over NCCL: c10::Device(c10::kCUDA, index))
    process_group(c10::intrusive_ptr<c10d_collectives> world, c10::intrusive_ptr<::c10d::Store> store,
                  group_factory make_group, std::chrono::milliseconds timeout = std::chrono::minutes(5),
                  std::optional<c10::Device> payload_device = std::nullopt) {
        if (!world) throw error("kfac::comm::process_group: the process group is null");
        if (!store) throw error("kfac::comm::process_group: the store is null; pass the store the process group "
                                "was built over (KAISA's groups of some ranks rendezvous through it)");
        if (!make_group) throw error("kfac::comm::process_group: no group factory; for Gloo pass "
                                     "kfac::comm::gloo_groups(options) (kfac/comm/process_group_gloo.hpp)");
        if (timeout.count() <= 0)
            throw error("kfac::comm::process_group: the timeout must be positive, not " +
                        std::to_string(timeout.count()) + " ms");
        if (timeout > longest_timeout)
            throw error("kfac::comm::process_group: the timeout must be at most 24 hours (" +
                        std::to_string(longest_timeout.count()) + " ms), not " + std::to_string(timeout.count()) +
                        " ms: each wait's deadline is now + timeout, which a longer one overflows (every wait then "
                        "fails at once), and a collective that takes a day means a rank is gone");
        state_ = std::make_unique<state>();
        state_->world = {world, world->getSize()};
        state_->rank = world->getRank();
        state_->store = std::move(store);
        state_->make_group = std::move(make_group);
        state_->timeout = timeout;
        if (payload_device) state_->device_payloads.emplace(*payload_device);
        state_->membership = std::make_unique<detail::world_membership>(world.get());
        if (const auto own = state_->membership->own_world(); own && state_->world.size > 1) {
            auto own_store =
                c10::make_intrusive<::c10d::PrefixStore>("kfac/world/" + std::to_string(*own) + "/", state_->store);
            try {
                state_->world.pg = state_->make_group(own_store, state_->rank, state_->world.size);
                state_->own_world = true;
            } catch (const std::exception& e) {
                throw error("kfac::comm::process_group: rank " + std::to_string(state_->rank) +
                            " could not build this policy's own world, which it builds because another policy is "
                            "alive over the same process group (every rank must construct its policies over the "
                            "group in the same order): " + message_of(e));
            }
        }
    }

    /// The longest timeout a policy takes.
    static constexpr std::chrono::milliseconds longest_timeout = std::chrono::hours(24);

    /// Whether this policy's world collectives run on a group of its own (another policy was
    /// alive over the same process group when it was constructed; see the file comment).
    [[nodiscard]] bool has_own_world() const noexcept { return state_->own_world; }

    /// LibTorch 2: over `world`'s backend for the payloads' device type (the CPU's when none).
    template <class ProcessGroup>
        requires(detail::holds_backends<ProcessGroup> && std::is_base_of_v<::c10d::ProcessGroup, ProcessGroup>)
    process_group(c10::intrusive_ptr<ProcessGroup> world, c10::intrusive_ptr<::c10d::Store> store,
                  group_factory make_group, std::chrono::milliseconds timeout = std::chrono::minutes(5),
                  std::optional<c10::Device> payload_device = std::nullopt)
        : process_group(backend_of(world, payload_device), std::move(store), std::move(make_group), timeout,
                        payload_device) {}

    /// Whether payloads are a device's memory, not the host's (then a device backend hands its
    /// buffers over without staging them).
    [[nodiscard]] bool reads_device_memory() const noexcept {
        return state_->device_payloads && !state_->device_payloads->device().is_cpu();
    }

    [[nodiscard]] int rank() const noexcept { return state_->rank; }                ///< this rank in the world
    [[nodiscard]] int size() const noexcept { return state_->world.size; }          ///< the world's size
    [[nodiscard]] group world() const noexcept { return state_->world; }            ///< the group of all ranks
    [[nodiscard]] int group_size(const group& g) const noexcept { return g.size; }  ///< the ranks of `g`

    /// Names the phase of the step that the next data collectives belong to, for errors.
    void phase(const char* name) noexcept { state_->phase = name; }

    /// Collective over the world: ranks with the same color form a group, ordered by rank.
    group split(int color) {
        const std::vector<std::uint64_t> colors =
            allgather(static_cast<std::uint64_t>(static_cast<std::int64_t>(color)), "the allgather that forms KAISA's groups");
        int group_rank = 0, group_size = 0;
        for (int r = 0; r < size(); ++r) {
            if (colors[static_cast<std::size_t>(r)] != colors[static_cast<std::size_t>(rank())]) continue;
            if (r < rank()) ++group_rank;
            ++group_size;
        }
        const int split_index = state_->splits++;
        if (group_size == 1) return {c10::intrusive_ptr<c10d_collectives>(), 1};
        if (group_size == size()) return state_->world;  // every rank, in the same order
        if (state_->id < 0) {
            // A number no other policy over this store has: rank 0 draws it from the store and
            // tells the others, so two policies' groups never share a prefix.
            std::int64_t id = rank() == 0 ? state_->store->add("kfac/policies", 1) : 0;
            control_broadcast(&id, 1, 0, "the broadcast that numbers kfac's groups");
            state_->id = id;
        }
        const std::string prefix = "kfac/" + std::to_string(state_->id) + "/" + std::to_string(split_index) + "/" +
                                   std::to_string(color) + "/";
        auto store = c10::make_intrusive<::c10d::PrefixStore>(prefix, state_->store);
        try {
            return {state_->make_group(store, group_rank, group_size), group_size};
        } catch (const std::exception& e) {
            throw error("kfac::comm::process_group: rank " + std::to_string(rank()) + " could not build its group of " +
                        std::to_string(group_size) + " ranks (color " + std::to_string(color) + "): " + e.what());
        }
    }

    /// Sums each item over the ranks of `g`, in buckets of at most `cap_bytes` (0: one per item),
    /// symmetric items as their lower triangle when `pack_symmetric`. Blocking.
    /// @throws kfac::error when the collective fails or outlasts the timeout.
    template <class T>
    void allreduce_sum(const std::vector<allreduce_item<T>>& items, std::size_t cap_bytes, bool pack_symmetric,
                       const group& g) {
        allreduce_sum_each(items, cap_bytes, pack_symmetric, g, {});
    }

    /// The same allreduce with its buckets completed in order: after each, its items are
    /// unpacked and `landed` (when given) runs while the later buckets travel (Gloo's and
    /// NCCL's own threads move them). If `landed` throws, the remaining buckets are still
    /// completed before the exception propagates, so no collective is left pending.
    template <class T>
    void allreduce_sum_each(const std::vector<allreduce_item<T>>& items, std::size_t cap_bytes, bool pack_symmetric,
                            const group& g, const bucket_landed& landed) {
        if (detail::landed_without_sending(items, g.size, landed)) return;
        const std::vector<detail::bucket> buckets = detail::plan_buckets(items, cap_bytes, pack_symmetric);
        if (state_->device_payloads) return allreduce_on_device(items, buckets, pack_symmetric, g, landed);
        auto& buffer = bucket_storage<T>(g.pg.get());
        buffer.resize(detail::total_count(buckets));
        std::vector<c10::intrusive_ptr<::c10d::Work>> works;
        // Each bucket starts as soon as it is packed and travels while the next is packed.
        for (const auto& b : buckets) {
            detail::pack_bucket(items, b, pack_symmetric, buffer.data());
            std::vector<at::Tensor> tensors{detail::host_tensor(buffer.data() + b.offset, b.count)};
            works.push_back(start("an allreduce", [&] { return g.pg->allreduce(tensors); }));
            ++state_->counters.allreduce_calls;
            state_->counters.allreduce_bytes += static_cast<std::int64_t>(b.count * sizeof(T));
        }
        complete_in_order(works, buckets, landed, [&](const detail::bucket& b, std::size_t) {
            detail::unpack_bucket(items, b, pack_symmetric, buffer.data());
        });
    }

    /// Starts a broadcast of `count` values from group rank `root`; complete at wait().
    template <class T>
    void broadcast(T* data, std::size_t count, int root, const group& g) {
        if (g.size <= 1 || count == 0) return;
        start_broadcast(payload_tensor(data, count), count * sizeof(T), root, g);
    }

    /// A broadcast of values in host memory whatever the payloads' memory (checkpoints): through
    /// a copy on the payloads' device when that is not the host, copied back at wait().
    template <class T>
    void broadcast_host(T* data, std::size_t count, int root, const group& g) {
        if (!reads_device_memory()) return broadcast(data, count, root, g);
        if (g.size <= 1 || count == 0) return;
        at::Tensor on_device = control_tensor(data, count);
        state_->copy_back.push_back({on_device, detail::host_tensor(data, count)});
        start_broadcast(std::move(on_device), count * sizeof(T), root, g);
    }

    /// Completes the broadcasts started since the last wait().
    /// @throws kfac::error when one fails or outlasts the timeout.
    void wait() {
        if (state_->pending.empty()) return;
        auto works = std::move(state_->pending);
        state_->pending.clear();
        const auto start = std::chrono::steady_clock::now();
        const auto stream = on_payload_stream();
        auto copy_back = std::move(state_->copy_back);
        state_->copy_back.clear();
        complete(works, "a broadcast");
        for (auto& [device, host] : copy_back) host.copy_(device);
        state_->counters.broadcast_wait_seconds +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }

    /// Every rank learns whether any failed; all get the lowest failing rank's message.
    std::optional<std::string> agree(const std::optional<std::string>& local_error) {
        const int world = size();
        if (world == 1) return local_error;
        std::int64_t first = local_error ? rank() : world;
        control_reduce(&first, 1, ::c10d::ReduceOp::MIN, "the allreduce of the failure agreement");
        if (first == world) return std::nullopt;
        std::string message =
            broadcast_text(rank() == first ? *local_error : std::string(), static_cast<int>(first),
                           "the broadcast of the failure agreement's message");
        return "rank " + std::to_string(first) + ": " + message;
    }

    /// Every rank's `value`, in rank order.
    std::vector<std::uint64_t> allgather(std::uint64_t value) {
        return allgather(value, "the allgather of configuration digests");
    }

    /// Rank `root`'s `text`, on every rank (the others' argument is ignored).
    std::string broadcast_text(const std::string& text, int root) {
        return broadcast_text(text, root, "the broadcast of a configuration or checkpoint");
    }

    /// values ← their element-wise maximum over all ranks.
    void allreduce_max(std::vector<std::int64_t>& values) {
        if (size() == 1 || values.empty()) return;
        control_reduce(values.data(), values.size(), ::c10d::ReduceOp::MAX, "the allreduce of a vote");
    }

    /// What this rank's policy has sent and waited for so far.
    [[nodiscard]] const comm_counters& counters() const noexcept { return state_->counters; }

private:
    std::vector<std::uint64_t> allgather(std::uint64_t value, const char* what) {
        std::vector<std::uint64_t> out(static_cast<std::size_t>(size()), value);
        if (size() == 1) return out;
        std::vector<std::int64_t> values(out.size());
        std::int64_t mine = static_cast<std::int64_t>(value);
        std::vector<at::Tensor> in{control_tensor(&mine, 1)};
        std::vector<std::vector<at::Tensor>> gathered(1);
        for (auto& v : values) gathered[0].push_back(control_tensor(&v, 1));
        run_control(what, [&] { return state_->world.pg->allgather(gathered, in); });
        for (std::size_t r = 0; r < values.size(); ++r) received(gathered[0][r], &values[r], 1);
        for (std::size_t r = 0; r < out.size(); ++r) out[r] = static_cast<std::uint64_t>(values[r]);
        return out;
    }

    struct state {
        int rank = 0;
        std::int64_t id = -1;  // drawn at the first split that needs a group
        int splits = 0;
        group world{};
        c10::intrusive_ptr<::c10d::Store> store;
        group_factory make_group;
        std::chrono::milliseconds timeout{};
        const char* phase = "a collective";
        std::vector<c10::intrusive_ptr<::c10d::Work>> pending;
        std::map<const c10d_collectives*, std::vector<float>> float_buckets;
        std::map<const c10d_collectives*, std::vector<double>> double_buckets;
        std::optional<detail::device_buckets> device_payloads;  // payloads in a device's memory
        std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // broadcast_host's (device, host)
        comm_counters counters{};
        std::unique_ptr<detail::world_membership> membership;  // among the policies over the caller's group
        bool own_world = false;  // `world` is a group of this policy's own, not the caller's
    };

    /// LibTorch 2: the backend of `world` that serves the payloads' device type.
    template <class ProcessGroup>
    static c10::intrusive_ptr<c10d_collectives> backend_of(const c10::intrusive_ptr<ProcessGroup>& world,
                                                           const std::optional<c10::Device>& payload_device) {
        if (!world) throw error("kfac::comm::process_group: the process group is null");
        const c10::DeviceType type = payload_device ? payload_device->type() : c10::DeviceType::CPU;
        try {
            return world->getBackend(type);
        } catch (const std::exception& e) {
            throw error("kfac::comm::process_group: the process group has no backend for " +
                        c10::DeviceTypeName(type) + " payloads (" + message_of(e) +
                        "); give the backend itself, or name the payloads' device");
        }
    }

    /// Starts a broadcast of `tensor` (`bytes` of payload) from group rank `root`, completed at
    /// wait().
    void start_broadcast(at::Tensor tensor, std::size_t bytes, int root, const group& g) {
        std::vector<at::Tensor> tensors{std::move(tensor)};
        ::c10d::BroadcastOptions o;
        o.rootRank = root;
        const auto stream = on_payload_stream();
        state_->pending.push_back(start("a broadcast", [&] { return g.pg->broadcast(tensors, o); }));
        ++state_->counters.broadcast_calls;
        state_->counters.broadcast_bytes += static_cast<std::int64_t>(bytes);
    }

    /// Bucketed allreduce of payloads in a device's memory: each bucket packed there, reduced
    /// in place, and unpacked once every bucket has completed.
    template <class T>
    void allreduce_on_device(const std::vector<allreduce_item<T>>& items, const std::vector<detail::bucket>& buckets,
                             bool pack_symmetric, const group& g, const bucket_landed& landed) {
        auto& device = *state_->device_payloads;
        const auto stream = device.on_default_stream();
        std::vector<at::Tensor> packed;
        std::vector<c10::intrusive_ptr<::c10d::Work>> works;
        for (const auto& b : buckets) {
            packed.push_back(device.pack(items, b, pack_symmetric));
            std::vector<at::Tensor> tensors{packed.back()};
            works.push_back(start("an allreduce", [&] { return g.pg->allreduce(tensors); }));
            ++state_->counters.allreduce_calls;
            state_->counters.allreduce_bytes += static_cast<std::int64_t>(b.count * sizeof(T));
        }
        complete_in_order(works, buckets, landed, [&](const detail::bucket& b, std::size_t i) {
            device.unpack(items, b, pack_symmetric, packed[i]);
        });
    }

    /// Waits for each bucket's work in order (at most the timeout each), unpacks it and calls
    /// `landed`; a failure of `landed` is raised once every bucket has completed.
    template <class Unpack>
    void complete_in_order(std::vector<c10::intrusive_ptr<::c10d::Work>>& works,
                           const std::vector<detail::bucket>& buckets, const bucket_landed& landed, Unpack&& unpack) {
        detail::landing_calls calls(landed);
        for (std::size_t i = 0; i < buckets.size(); ++i) {
            std::vector<c10::intrusive_ptr<::c10d::Work>> one{std::move(works[i])};
            const auto start = std::chrono::steady_clock::now();
            complete(one, "an allreduce");
            state_->counters.allreduce_wait_seconds +=
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            unpack(buckets[i], i);
            calls.after(buckets[i]);
        }
        works.clear();
        calls.finish();
    }

    /// A payload as a tensor over its memory (host or the payloads' device).
    template <class T>
    at::Tensor payload_tensor(T* data, std::size_t count) const {
        return state_->device_payloads ? detail::memory_tensor(data, count, state_->device_payloads->device())
                                       : detail::host_tensor(data, count);
    }

    /// The payloads' device's default stream while the result lives (none for host payloads).
    [[nodiscard]] c10::OptionalStreamGuard on_payload_stream() const {
        c10::optional<c10::Stream> stream;
        if (state_->device_payloads) stream = c10::Stream(c10::Stream::DEFAULT, state_->device_payloads->device());
        return c10::OptionalStreamGuard(stream);
    }

    /// Host control values as a tensor the world's collectives take: over the values
    /// themselves, or a copy on the payloads' device (NCCL takes device tensors only; read back
    /// with received()).
    template <class T>
    at::Tensor control_tensor(T* values, std::size_t count) const {
        at::Tensor host = detail::host_tensor(values, count);
        if (!reads_device_memory()) return host;
        return host.to(state_->device_payloads->device(), host.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    }
    /// Copies a control tensor's values back to `values` when it was a device copy.
    template <class T>
    void received(const at::Tensor& t, T* values, std::size_t count) const {
        if (reads_device_memory()) detail::host_tensor(values, count).copy_(t);
    }

    template <class T>
    std::vector<T>& bucket_storage(const c10d_collectives* pg) {
        if constexpr (std::is_same_v<T, float>) return state_->float_buckets[pg];
        else return state_->double_buckets[pg];
    }

    /// The error of a collective (`operation`) that failed or ran out of time on this rank,
    /// in `phase` of the step.
    [[nodiscard]] error failure(const std::string& phase, const std::string& operation, const std::string& why) const {
        return error("kfac::comm::process_group: rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
                     ": " + operation + " in " + phase + " " + why +
                     " (a rank that stopped, or raised an error outside kfac, leaves the others waiting until the "
                     "timeout; a timeout too short for the payload can be raised: process_group's timeout argument, "
                     "and the process group's own)");
    }

    /// An exception's message; LibTorch's without the C++ backtrace it appends.
    static std::string message_of(const std::exception& e) {
        if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
        return e.what();
    }

    /// Starts a collective; a process group that refuses it raises a kfac::error.
    template <class Start>
    c10::intrusive_ptr<::c10d::Work> start(const std::string& operation, Start&& s) {
        try {
            return s();
        } catch (const std::exception& e) {
            throw failure(state_->phase, operation, std::string("could not start: ") + message_of(e));
        }
    }

    /// Waits for every work, at most the timeout each.
    void complete(std::vector<c10::intrusive_ptr<::c10d::Work>>& works, const std::string& operation) {
        const std::string what = state_->phase;
        for (auto& w : works) {
            try {
                if (!w->wait(state_->timeout))
                    throw failure(what, operation, "did not complete in " + std::to_string(state_->timeout.count()) + " ms");
            } catch (const error&) {
                throw;
            } catch (const std::exception& e) {
                throw failure(what, operation, std::string("failed or timed out after ") +
                                                   std::to_string(state_->timeout.count()) + " ms: " + message_of(e));
            }
        }
        works.clear();
    }

    /// One collective of control traffic over the world, started by `launch` and waited for.
    template <class Launch>
    void run_control(const char* what, Launch&& launch) {
        const auto stream = on_payload_stream();
        std::vector<c10::intrusive_ptr<::c10d::Work>> works{start(what, launch)};
        complete(works, what);
        ++state_->counters.control_calls;
    }

    /// A reduction of control values over the world (agreement, votes).
    void control_reduce(std::int64_t* values, std::size_t count, ::c10d::ReduceOp::RedOpType op, const char* what) {
        std::vector<at::Tensor> tensors{control_tensor(values, count)};
        ::c10d::AllreduceOptions o;
        o.reduceOp = op;
        run_control(what, [&] { return state_->world.pg->allreduce(tensors, o); });
        received(tensors[0], values, count);
    }

    std::string broadcast_text(const std::string& text, int root, const char* what) {
        std::string out = rank() == root ? text : std::string();
        if (size() == 1) return out;
        std::int64_t length = static_cast<std::int64_t>(out.size());
        control_broadcast(&length, 1, root, what);
        out.resize(static_cast<std::size_t>(length));
        if (length > 0) control_broadcast(out.data(), out.size(), root, what);
        return out;
    }

    /// A broadcast of control values over the world from `root`.
    template <class T>
    void control_broadcast(T* data, std::size_t count, int root, const char* what) {
        std::vector<at::Tensor> tensors{control_tensor(data, count)};
        ::c10d::BroadcastOptions o;
        o.rootRank = root;
        run_control(what, [&] { return state_->world.pg->broadcast(tensors, o); });
        received(tensors[0], data, count);
    }

    std::unique_ptr<state> state_;
};

}  // namespace kfac::comm
