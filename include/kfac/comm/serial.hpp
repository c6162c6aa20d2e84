// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file serial.hpp
/// The single-process communication policy, and the contract every CommPolicy meets.
///
/// **CommPolicy.** A communication policy is a (movable) type with
/// ```
///   using group = ...;                        // a subset of the ranks
///   int rank() const;  int size() const;
///   group world() const;                      // all ranks
///   group split(int color);                   // collective: ranks with equal color, by rank
///   int group_size(const group&) const;
///   // Sum each buffer over all ranks of `g`, in buckets of at most cap_bytes (0: one per
///   // item), packing symmetric items to their lower triangle when asked. Blocking.
///   template <class T> void allreduce_sum(const std::vector<allreduce_item<T>>&,
///                                         std::size_t cap_bytes, bool pack_symmetric, const group& g);
///   // Start a broadcast of `count` values from group rank `root`; complete at wait().
///   template <class T> void broadcast(T* data, std::size_t count, int root, const group& g);
///   void wait();
///   // Control: collective agreement on failure (first failing rank's message, or none).
///   std::optional<std::string> agree(const std::optional<std::string>& local_error);
///   std::vector<std::uint64_t> allgather(std::uint64_t value);
///   // Control: every rank gets rank `root`'s text (the others' argument is ignored).
///   std::string broadcast_text(const std::string& text, int root);
///   // Control: element-wise maximum over all ranks, in place (per-layer verdicts).
///   void allreduce_max(std::vector<std::int64_t>& values);
///   const comm_counters& counters() const;
///   // Optional: the phase of the step the next data collectives belong to, for errors.
///   void phase(const char* name);
///   // Optional: let pending broadcasts advance without completing them (between tasks that
///   // overlap them, options.overlap_communication); for transports that move data only
///   // inside their own calls.
///   void progress();
///   // Optional: allreduce_sum with its buckets completed in order, `landed(first, last)`
///   // called after each (items [first, last) hold their sums) while later ones travel; if
///   // `landed` throws, every bucket is still completed before the exception propagates.
///   template <class T> void allreduce_sum_each(const std::vector<allreduce_item<T>>&,
///       std::size_t cap_bytes, bool pack_symmetric, const group& g, const bucket_landed& landed);
///   // Optional, for a policy whose payloads are device memory (a device backend then hands
///   // it its buffers unstaged, kfac/detail/host_staging.hpp): says so, and broadcasts the
///   // few payloads that are host memory all the same (checkpoints), completing at wait().
///   bool reads_device_memory() const;
///   template <class T> void broadcast_host(T* data, std::size_t count, int root, const group& g);
/// ```
/// Every rank calls the collectives in the same order. Groups of one rank send nothing and
/// count nothing.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kfac {

/// What a communication policy did. Bytes are payload bytes of the calls this rank took
/// part in; control traffic (agreement, digests) is counted apart.
struct comm_counters {
    std::int64_t allreduce_calls = 0;  ///< data allreduces started: one per bucket
    std::int64_t allreduce_bytes = 0;  ///< their payload bytes
    std::int64_t broadcast_calls = 0;  ///< data broadcasts started
    std::int64_t broadcast_bytes = 0;  ///< their payload bytes
    std::int64_t control_calls = 0;    ///< control collectives: split, agree, allgather, ...
    /// Seconds this rank spent in wait() for its broadcasts to complete: what was not hidden
    /// behind other work (options.overlap_communication; bench_kfac_mpi --overlap).
    double broadcast_wait_seconds = 0.0;
    /// Seconds this rank spent blocked waiting for factor allreduce buckets to complete: what
    /// the work between buckets did not hide (allreduce_sum_each; bench_kfac_mpi --overlap).
    double allreduce_wait_seconds = 0.0;
};

/// One buffer of a bucketed allreduce: `count` values, or a `dim` × `dim` symmetric
/// column-major matrix when `symmetric` (then count = dim²).
template <class T>
struct allreduce_item {
    T* data = nullptr;       ///< the values, summed in place
    std::size_t count = 0;   ///< how many
    bool symmetric = false;  ///< whether it is a symmetric matrix (its lower triangle may travel alone)
    std::int64_t dim = 0;    ///< its dimension when symmetric
};

namespace comm {

/// Called as a bucket of an allreduce completes: items [first, last) hold their sums.
using bucket_landed = std::function<void(std::size_t first, std::size_t last)>;

/// The bucketed allreduce with `landed` called as buckets complete: the policy's
/// allreduce_sum_each where it has one, else its allreduce_sum and one call for every item.
template <class CommPolicy, class T>
void allreduce_sum_each(CommPolicy& c, const std::vector<allreduce_item<T>>& items, std::size_t cap_bytes,
                        bool pack_symmetric, const typename CommPolicy::group& g, const bucket_landed& landed) {
    if constexpr (requires { c.allreduce_sum_each(items, cap_bytes, pack_symmetric, g, landed); }) {
        c.allreduce_sum_each(items, cap_bytes, pack_symmetric, g, landed);
    } else {
        c.allreduce_sum(items, cap_bytes, pack_symmetric, g);
        if (!items.empty()) landed(0, items.size());
    }
}

/// Lets a policy whose collectives move only inside its calls (kfac::comm::mpi) advance the
/// pending ones between tasks; a policy without progress() needs none (Gloo has its threads).
template <class CommPolicy>
void progress(CommPolicy& c) {
    if constexpr (requires { c.progress(); }) c.progress();
}

/// Tells a policy that names phases in its errors (kfac::comm::process_group) which phase of
/// the step its next collectives belong to; a policy without phase() ignores it.
template <class CommPolicy>
void announce_phase(CommPolicy& c, const char* name) noexcept {
    if constexpr (requires { c.phase(name); }) c.phase(name);
}

/// Broadcasts `count` values in host memory from group rank `root` (completing at wait()),
/// also with a policy whose payloads are device memory (its broadcast_host()).
template <class CommPolicy, class T>
void broadcast_host(CommPolicy& c, T* data, std::size_t count, int root, const typename CommPolicy::group& g) {
    if constexpr (requires { c.broadcast_host(data, count, root, g); }) c.broadcast_host(data, count, root, g);
    else c.broadcast(data, count, root, g);
}

/// One process: every collective is the identity and nothing is sent.
class serial {
public:
    struct group {};  ///< the one group there is: this process

    [[nodiscard]] int rank() const noexcept { return 0; }                     ///< this process's rank: 0
    [[nodiscard]] int size() const noexcept { return 1; }                     ///< the number of ranks: 1
    [[nodiscard]] group world() const noexcept { return {}; }                 ///< the group of this process
    group split(int) noexcept { return {}; }                                  ///< the group of this process
    [[nodiscard]] int group_size(const group&) const noexcept { return 1; }  ///< the group's ranks: 1
    /// Nothing to do: each buffer is its own sum.
    template <class T>
    void allreduce_sum(const std::vector<allreduce_item<T>>&, std::size_t, bool, const group&) noexcept {}
    /// Nothing to do: the root's values are already here.
    template <class T>
    void broadcast(T*, std::size_t, int, const group&) noexcept {}
    void wait() noexcept {}  ///< nothing to wait for
    /// `local_error`: this process's verdict is everyone's.
    std::optional<std::string> agree(const std::optional<std::string>& local_error) { return local_error; }
    std::vector<std::uint64_t> allgather(std::uint64_t value) { return {value}; }  ///< {value}
    std::string broadcast_text(const std::string& text, int) { return text; }     ///< `text`
    void allreduce_max(std::vector<std::int64_t>&) noexcept {}                    ///< nothing to do
    /// All zero: nothing is ever sent.
    [[nodiscard]] const comm_counters& counters() const noexcept { return counters_; }

private:
    comm_counters counters_{};
};

}  // namespace comm
}  // namespace kfac
