// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file mpi.hpp
/// The MPI communication policy (CMake target kfac::mpi). The contract is documented in
/// kfac/comm/serial.hpp. The host passes its communicator (default MPI_COMM_WORLD); the
/// policy duplicates it so the library's messages never match the host's.

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kfac/comm/buckets.hpp"
#include "kfac/comm/posted_allreduce.hpp"
#include "kfac/comm/serial.hpp"
#include "kfac/config.hpp"

namespace kfac::comm {

namespace detail {

inline void check_mpi(int code, const char* call) {
    if (code == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(code, text, &length);
    throw error(std::string("MPI call ") + call + " failed: " + std::string(text, static_cast<std::size_t>(length)));
}

/// Completes `requests` by testing them and, between tests, yielding the processor: a rank that
/// waits for the others leaves its core to a rank that computes when there are more ranks than
/// cores (a laptop, a CI runner; MPICH's own wait polls without yielding). With a core each, a
/// yield returns at once and this is the busy wait MPI_Waitall would do.
inline void wait_all(int count, MPI_Request* requests, const char* call) {
    int done = count == 0;
    while (!done) {
        check_mpi(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), call);
        if (!done) std::this_thread::yield();
    }
}
inline void wait_all(std::vector<MPI_Request>& requests, const char* call) {
    wait_all(static_cast<int>(requests.size()), requests.data(), call);
}
inline void wait_one(MPI_Request& request, const char* call) { wait_all(1, &request, call); }

template <class T>
MPI_Datatype datatype() {
    if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
    else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
    else static_assert(std::is_same_v<T, float>, "kfac::comm::mpi: only float and double payloads");
}

inline int checked_count(std::size_t n) {
    if (n > static_cast<std::size_t>(INT32_MAX))
        throw error("kfac::comm::mpi: a message of " + std::to_string(n) + " values exceeds MPI's int count");
    return static_cast<int>(n);
}

}  // namespace detail

/// MPI transport. Move-only: it owns duplicated communicators.
class mpi {
public:
    /// A group of ranks: a communicator owned by the policy.
    struct group {
        MPI_Comm comm = MPI_COMM_NULL;  ///< the group's communicator
        int size = 1;                   ///< its number of ranks
    };

    /// @param comm the host's communicator; MPI must be initialised.
    explicit mpi(MPI_Comm comm = MPI_COMM_WORLD) {
        int initialised = 0;
        MPI_Initialized(&initialised);
        if (!initialised) throw error("kfac::comm::mpi: MPI_Init has not been called");
        MPI_Comm dup = MPI_COMM_NULL;
        detail::check_mpi(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup");
        state_ = std::make_unique<state>();
        state_->owned.push_back(dup);
        state_->world.comm = dup;
        MPI_Comm_rank(dup, &state_->rank);
        MPI_Comm_size(dup, &state_->size);
        state_->world.size = state_->size;
    }

    [[nodiscard]] int rank() const noexcept { return state_->rank; }                ///< this rank in the communicator
    [[nodiscard]] int size() const noexcept { return state_->size; }                ///< the communicator's size
    [[nodiscard]] group world() const noexcept { return state_->world; }            ///< the group of all ranks
    [[nodiscard]] int group_size(const group& g) const noexcept { return g.size; }  ///< the ranks of `g`

    /// Collective over the world: ranks with the same color form a group, ordered by rank.
    group split(int color) {
        MPI_Comm c = MPI_COMM_NULL;
        detail::check_mpi(MPI_Comm_split(state_->world.comm, color, state_->rank, &c), "MPI_Comm_split");
        state_->owned.push_back(c);
        ++state_->counters.control_calls;
        group g{c, 1};
        MPI_Comm_size(c, &g.size);
        return g;
    }

    /// Sums each item over the ranks of `g`, in buckets of at most `cap_bytes` (0: one per item),
    /// symmetric items as their lower triangle when `pack_symmetric`. Blocking.
    /// @throws kfac::error when an MPI call fails.
    template <class T>
    void allreduce_sum(const std::vector<allreduce_item<T>>& items, std::size_t cap_bytes,
                       bool pack_symmetric, const group& g) {
        allreduce_sum_each(items, cap_bytes, pack_symmetric, g, {});
    }

    /// The same allreduce with its buckets completed in order: after each, its items are
    /// unpacked and `landed` (when given) runs while the later buckets travel (progress()
    /// moves them meanwhile). If `landed` throws, the remaining buckets are still completed
    /// before the exception propagates, so no collective is left pending.
    template <class T>
    void allreduce_sum_each(const std::vector<allreduce_item<T>>& items, std::size_t cap_bytes, bool pack_symmetric,
                            const group& g, const bucket_landed& landed) {
        if (detail::landed_without_sending(items, g.size, landed)) return;
        // One bucket buffer per communicator, reused across steps (keyed by identity).
        auto& buffer = bucket_storage<T>(g.comm);
        const std::vector<detail::bucket> buckets = detail::plan_buckets(items, cap_bytes, pack_symmetric);
        buffer.resize(detail::total_count(buckets));
        std::vector<MPI_Request>& requests = state_->allreduce_in_flight;
        requests.assign(buckets.size(), MPI_REQUEST_NULL);
        // Pack and start each bucket as soon as it is full, so it travels while the next
        // bucket is packed.
        for (std::size_t b = 0; b < buckets.size(); ++b) {
            detail::pack_bucket(items, buckets[b], pack_symmetric, buffer.data());
            const std::size_t n = buckets[b].count;
            detail::check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer.data() + buckets[b].offset, detail::checked_count(n),
                                             detail::datatype<T>(), MPI_SUM, g.comm, &requests[b]),
                              "MPI_Iallreduce");
            ++state_->counters.allreduce_calls;
            state_->counters.allreduce_bytes += static_cast<std::int64_t>(n * sizeof(T));
        }
        detail::landing_calls calls(landed);
        for (std::size_t b = 0; b < buckets.size(); ++b) {
            const double start = MPI_Wtime();
            detail::wait_one(requests[b], "MPI_Iallreduce");
            state_->counters.allreduce_wait_seconds += MPI_Wtime() - start;
            detail::unpack_bucket(items, buckets[b], pack_symmetric, buffer.data());
            calls.after(buckets[b]);
        }
        requests.clear();
        calls.finish();
    }

    /// The same buckets posted item by item (kfac/comm/posted_allreduce.hpp): a bucket's
    /// MPI_Iallreduce starts when the item after it does not fit, so it travels while the caller
    /// computes the later items (progress() moves it meanwhile).
    template <class T>
    std::unique_ptr<posted_allreduce<T>> start_allreduce(std::size_t cap_bytes, bool pack_symmetric, const group& g) {
        return std::make_unique<posted<T>>(*state_, g, cap_bytes, pack_symmetric);
    }

    /// Starts a broadcast of `count` values from group rank `root` (MPI_Ibcast); complete at wait().
    template <class T>
    void broadcast(T* data, std::size_t count, int root, const group& g) {
        if (g.size <= 1 || count == 0) return;
        state_->pending.emplace_back();
        detail::check_mpi(MPI_Ibcast(data, detail::checked_count(count), detail::datatype<T>(), root, g.comm,
                                     &state_->pending.back()),
                          "MPI_Ibcast");
        ++state_->counters.broadcast_calls;
        state_->counters.broadcast_bytes += static_cast<std::int64_t>(count * sizeof(T));
    }

    /// Lets the pending broadcasts advance without waiting for them (MPICH moves a message
    /// only inside an MPI call): called between tasks while they travel.
    void progress() {
        for (auto* requests : {&state_->pending, &state_->allreduce_in_flight, &state_->posted_in_flight}) {
            if (requests->empty()) continue;
            int done = 0;
            detail::check_mpi(MPI_Testall(static_cast<int>(requests->size()), requests->data(), &done, MPI_STATUSES_IGNORE),
                              "MPI_Testall");
        }
    }

    /// Completes the broadcasts started since the last wait().
    void wait() {
        if (state_->pending.empty()) return;
        auto requests = std::move(state_->pending);
        state_->pending.clear();
        const double start = MPI_Wtime();
        detail::wait_all(requests, "MPI_Ibcast");
        state_->counters.broadcast_wait_seconds += MPI_Wtime() - start;
    }

    /// Every rank learns whether any failed; all get the lowest failing rank's message.
    std::optional<std::string> agree(const std::optional<std::string>& local_error) {
        const int world = state_->size;
        if (world == 1) return local_error;
        int mine = local_error ? state_->rank : world;
        int first = world;
        MPI_Request r = MPI_REQUEST_NULL;
        detail::check_mpi(MPI_Iallreduce(&mine, &first, 1, MPI_INT, MPI_MIN, state_->world.comm, &r), "MPI_Iallreduce");
        detail::wait_one(r, "MPI_Iallreduce");
        ++state_->counters.control_calls;
        if (first == world) return std::nullopt;
        std::string message = state_->rank == first ? *local_error : std::string();
        int length = static_cast<int>(message.size());
        detail::check_mpi(MPI_Ibcast(&length, 1, MPI_INT, first, state_->world.comm, &r), "MPI_Ibcast");
        detail::wait_one(r, "MPI_Ibcast");
        message.resize(static_cast<std::size_t>(length));
        detail::check_mpi(MPI_Ibcast(message.data(), length, MPI_CHAR, first, state_->world.comm, &r), "MPI_Ibcast");
        detail::wait_one(r, "MPI_Ibcast");
        state_->counters.control_calls += 2;
        return "rank " + std::to_string(first) + ": " + message;
    }

    /// Every rank's `value`, in rank order.
    std::vector<std::uint64_t> allgather(std::uint64_t value) {
        std::vector<std::uint64_t> out(static_cast<std::size_t>(state_->size));
        MPI_Request r = MPI_REQUEST_NULL;
        detail::check_mpi(
            MPI_Iallgather(&value, 1, MPI_UINT64_T, out.data(), 1, MPI_UINT64_T, state_->world.comm, &r),
            "MPI_Iallgather");
        detail::wait_one(r, "MPI_Iallgather");
        ++state_->counters.control_calls;
        return out;
    }

    /// Any length: the size travels as 64 bits and the bytes in pieces of at most 1 GiB
    /// (MPI counts are int), so a checkpoint of several GiB crosses whole.
    std::string broadcast_text(const std::string& text, int root) {
        std::string out = state_->rank == root ? text : std::string();
        if (state_->size == 1) return out;
        std::uint64_t length = out.size();
        MPI_Request r = MPI_REQUEST_NULL;
        detail::check_mpi(MPI_Ibcast(&length, 1, MPI_UINT64_T, root, state_->world.comm, &r), "MPI_Ibcast");
        detail::wait_one(r, "MPI_Ibcast");
        out.resize(static_cast<std::size_t>(length));
        constexpr std::size_t piece = std::size_t(1) << 30;
        for (std::size_t at = 0; at < out.size(); at += piece) {
            const auto n = static_cast<int>(std::min(piece, out.size() - at));
            detail::check_mpi(MPI_Ibcast(out.data() + at, n, MPI_CHAR, root, state_->world.comm, &r), "MPI_Ibcast");
            detail::wait_one(r, "MPI_Ibcast");
            ++state_->counters.control_calls;
        }
        ++state_->counters.control_calls;
        return out;
    }

    /// values ← their element-wise maximum over all ranks.
    void allreduce_max(std::vector<std::int64_t>& values) {
        if (state_->size == 1 || values.empty()) return;
        MPI_Request r = MPI_REQUEST_NULL;
        detail::check_mpi(MPI_Iallreduce(MPI_IN_PLACE, values.data(), detail::checked_count(values.size()), MPI_INT64_T,
                                         MPI_MAX, state_->world.comm, &r),
                          "MPI_Iallreduce");
        detail::wait_one(r, "MPI_Iallreduce");
        ++state_->counters.control_calls;
    }

    /// What this rank's policy has sent and waited for so far.
    [[nodiscard]] const comm_counters& counters() const noexcept { return state_->counters; }

private:
    struct state {
        int rank = 0;
        int size = 1;
        group world{};
        std::vector<MPI_Comm> owned;
        std::vector<MPI_Request> pending;
        std::vector<MPI_Request> allreduce_in_flight;  // allreduce_sum_each's buckets, for progress()
        std::vector<MPI_Request> posted_in_flight;     // a posted allreduce's buckets, for progress()
        std::map<MPI_Comm, std::vector<float>> float_buckets;
        std::map<MPI_Comm, std::vector<double>> double_buckets;
        // A posted allreduce's buffers, one per bucket (a bucket travels while later ones are
        // filled, so they cannot share one growing buffer), kept for the next step.
        std::map<MPI_Comm, std::vector<std::vector<float>>> float_posted_buffers;
        std::map<MPI_Comm, std::vector<std::vector<double>>> double_posted_buffers;
        comm_counters counters{};
        ~state() {
            int finalized = 0;
            MPI_Finalized(&finalized);
            if (finalized) return;  // the host finalised first; nothing left to free
            for (auto& c : owned) MPI_Comm_free(&c);
        }
    };

    template <class T>
    std::vector<T>& bucket_storage(MPI_Comm c) {
        if constexpr (std::is_same_v<T, float>) return state_->float_buckets[c];
        else return state_->double_buckets[c];
    }

    template <class T>
    static std::vector<std::vector<T>>& posted_buffers(state& s, MPI_Comm c) {
        if constexpr (std::is_same_v<T, float>) return s.float_posted_buffers[c];
        else return s.double_posted_buffers[c];
    }

    /// start_allreduce's allreduce: the buckets bucket_filler forms, each packed into its own
    /// buffer and started as soon as it is complete. One at a time per policy (its requests are
    /// the policy's posted_in_flight).
    template <class T>
    class posted final : public posted_allreduce<T> {
    public:
        posted(state& s, const group& g, std::size_t cap_bytes, bool pack_symmetric)
            : state_(s), group_(g), pack_symmetric_(pack_symmetric), filler_(cap_bytes, sizeof(T)),
              buffers_(std::move(posted_buffers<T>(s, g.comm))) {
            state_.posted_in_flight.clear();
        }
        ~posted() override {
            if (!completed_) {
                try {  // a failure agreed by every rank: every rank starts and waits for the same buckets
                    start_open_buckets();
                    detail::wait_all(state_.posted_in_flight, "MPI_Iallreduce");
                } catch (...) {  // MPI failed; nothing more can be done for the collective
                }
            }
            state_.posted_in_flight.clear();
            posted_buffers<T>(state_, group_.comm) = std::move(buffers_);
        }
        void add(const allreduce_item<T>& item) override {
            // The item opening a bucket completes the one before it, which then starts.
            if (filler_.add(detail::packed_count(item, pack_symmetric_))) start_open_buckets();
            items_.push_back(item);
        }
        void close() override { start_open_buckets(); }
        void complete(const bucket_landed& landed) override {
            if (detail::landed_without_sending(items_, group_.size, landed)) {
                completed_ = true;
                return;
            }
            start_open_buckets();
            detail::landing_calls calls(landed);
            for (std::size_t b = 0; b < started_; ++b) {
                const double start = MPI_Wtime();
                detail::wait_one(state_.posted_in_flight[b], "MPI_Iallreduce");
                state_.counters.allreduce_wait_seconds += MPI_Wtime() - start;
                detail::unpack_bucket(items_, own_buffer(filler_.buckets()[b]), pack_symmetric_, buffers_[b].data());
                calls.after(filler_.buckets()[b]);
            }
            completed_ = true;
            calls.finish();
        }

    private:
        /// Starts every bucket whose items have all been added, in order.
        void start_open_buckets() {
            if (group_.size <= 1) return;
            const auto& buckets = filler_.buckets();
            for (; started_ < buckets.size() && buckets[started_].last <= items_.size(); ++started_) {
                const detail::bucket& b = buckets[started_];
                if (buffers_.size() <= started_) buffers_.resize(started_ + 1);  // a moved buffer keeps its storage
                auto& buffer = buffers_[started_];
                buffer.resize(b.count);
                detail::pack_bucket(items_, own_buffer(b), pack_symmetric_, buffer.data());
                state_.posted_in_flight.push_back(MPI_REQUEST_NULL);
                detail::check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer.data(), detail::checked_count(b.count),
                                                 detail::datatype<T>(), MPI_SUM, group_.comm,
                                                 &state_.posted_in_flight.back()),
                                  "MPI_Iallreduce");
                ++state_.counters.allreduce_calls;
                state_.counters.allreduce_bytes += static_cast<std::int64_t>(b.count * sizeof(T));
            }
        }
        /// `b` as it lies in its own buffer.
        static detail::bucket own_buffer(detail::bucket b) {
            b.offset = 0;
            return b;
        }

        state& state_;
        group group_;
        bool pack_symmetric_;
        detail::bucket_filler filler_;
        std::vector<allreduce_item<T>> items_;
        std::vector<std::vector<T>> buffers_;
        std::size_t started_ = 0;
        bool completed_ = false;
    };

    std::unique_ptr<state> state_;
};

}  // namespace kfac::comm
