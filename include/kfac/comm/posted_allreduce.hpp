// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file posted_allreduce.hpp
/// The bucketed allreduce posted item by item (options.overlap_factor_allreduce): the caller adds
/// the items in order as their values come to exist, and a bucket starts travelling as soon as
/// the next item does not fit in it, while the caller computes the later items; complete() then
/// finishes the buckets in order, as allreduce_sum_each does. The buckets are plan_buckets's
/// (kfac/comm/buckets.hpp), so the sums are allreduce_sum's, bit for bit.
///
/// A policy posts early by having
/// ```
///   template <class T> std::unique_ptr<posted_allreduce<T>> start_allreduce(std::size_t cap_bytes,
///                                                                           bool pack_symmetric, const group&);
/// ```
/// (kfac::comm::mpi); for any other, start_allreduce() below keeps the items and sends them all
/// at complete().

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "kfac/comm/serial.hpp"

namespace kfac::comm {

/// A bucketed allreduce in flight. Every rank adds items of the same sizes in the same order.
/// Destroyed before complete() (a failure agreed by every rank), it still starts its last bucket
/// and waits for all it started, so no collective is left pending; the items' values are then
/// undefined.
template <class T>
class posted_allreduce {
public:
    posted_allreduce() = default;
    posted_allreduce(const posted_allreduce&) = delete;
    posted_allreduce& operator=(const posted_allreduce&) = delete;
    virtual ~posted_allreduce() = default;

    /// The next item, its values in place (they are read when its bucket starts, by complete() at
    /// the latest, and must stay where they are until then).
    virtual void add(const allreduce_item<T>& item) = 0;
    /// No item follows: starts the last bucket.
    virtual void close() = 0;
    /// Starts the last bucket (if close() did not), then completes the buckets in order: after
    /// each, its items hold their sums and `landed(first, last)` runs (when given) while later
    /// buckets travel. If `landed` throws, every bucket is still completed before the exception
    /// propagates.
    virtual void complete(const bucket_landed& landed) = 0;
};

/// For a policy that does not post early: the items, sent by allreduce_sum_each at complete().
/// Destroyed before complete(), it sends nothing: neither did any other rank.
template <class CommPolicy, class T>
class collected_allreduce final : public posted_allreduce<T> {
public:
    /// An allreduce over group `g` of `c`, with plan_buckets's `cap_bytes` and `pack_symmetric`.
    collected_allreduce(CommPolicy& c, std::size_t cap_bytes, bool pack_symmetric, typename CommPolicy::group g)
        : comm_(c), cap_bytes_(cap_bytes), pack_symmetric_(pack_symmetric), group_(std::move(g)) {}
    void add(const allreduce_item<T>& item) override { items_.push_back(item); }
    void close() override {}
    void complete(const bucket_landed& landed) override {
        comm::allreduce_sum_each(comm_, items_, cap_bytes_, pack_symmetric_, group_, landed);
    }

private:
    CommPolicy& comm_;
    std::size_t cap_bytes_;
    bool pack_symmetric_;
    typename CommPolicy::group group_;
    std::vector<allreduce_item<T>> items_;
};

/// Whether a policy starts a posted allreduce's buckets as they fill (has start_allreduce).
template <class CommPolicy, class T>
concept starts_allreduce_early = requires(CommPolicy& c, std::size_t cap_bytes, const typename CommPolicy::group& g) {
    c.template start_allreduce<T>(cap_bytes, bool{}, g);
};

/// The policy's own posted allreduce where it has one, else a collected_allreduce.
template <class T, class CommPolicy>
std::unique_ptr<posted_allreduce<T>> start_allreduce(CommPolicy& c, std::size_t cap_bytes, bool pack_symmetric,
                                                     const typename CommPolicy::group& g) {
    if constexpr (starts_allreduce_early<CommPolicy, T>)
        return c.template start_allreduce<T>(cap_bytes, pack_symmetric, g);
    else
        return std::make_unique<collected_allreduce<CommPolicy, T>>(c, cap_bytes, pack_symmetric, g);
}

}  // namespace kfac::comm
