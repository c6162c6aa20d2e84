// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file buckets.hpp
/// The bucketed allreduce's layout, shared by every transport (kfac/comm/mpi.hpp,
/// kfac/comm/process_group.hpp): which items travel together, and how an item is packed into
/// a bucket (whole, or a symmetric matrix's lower triangle) and unpacked from it. The transport
/// only moves the buckets, so two transports given the same items send the same bytes.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

#include "kfac/comm/serial.hpp"

namespace kfac::comm::detail {

/// Copies a symmetric column-major dim × dim matrix's lower triangle (column by column,
/// n(n+1)/2 values) to `out`.
template <class T>
void pack_lower(const T* m, std::int64_t dim, T* out) {
    for (std::int64_t j = 0; j < dim; ++j) {
        std::memcpy(out, m + j * dim + j, sizeof(T) * static_cast<std::size_t>(dim - j));
        out += dim - j;
    }
}
/// The inverse of pack_lower, mirroring the triangle into the upper half.
template <class T>
void unpack_lower(const T* in, std::int64_t dim, T* m) {
    for (std::int64_t j = 0; j < dim; ++j) {
        for (std::int64_t i = j; i < dim; ++i) {
            m[j * dim + i] = *in;
            m[i * dim + j] = *in;
            ++in;
        }
    }
}

/// Values an item occupies in a bucket.
template <class T>
std::size_t packed_count(const allreduce_item<T>& it, bool pack_symmetric) {
    return pack_symmetric && it.symmetric ? static_cast<std::size_t>(it.dim * (it.dim + 1) / 2) : it.count;
}

/// Consecutive items, [first, last), and where their values start in the shared buffer.
struct bucket {
    std::size_t first = 0;
    std::size_t last = 0;
    std::size_t offset = 0;
    std::size_t count = 0;
};

/// plan_buckets's rule applied one item at a time, for a caller that starts a bucket before it
/// knows the later items (kfac/comm/posted_allreduce.hpp): consecutive items share a bucket while
/// the cap allows (a cap of 0 values: one bucket per item); an item larger than the cap travels
/// alone.
class bucket_filler {
public:
    /// `cap_bytes` of `value_bytes`-byte values (0: one bucket per item).
    bucket_filler(std::size_t cap_bytes, std::size_t value_bytes)
        : cap_(cap_bytes == 0 ? 0 : std::max<std::size_t>(1, cap_bytes / value_bytes)) {}
    /// Places the next item, of `n` packed values: true when it opens a bucket (the one before,
    /// if any, is then complete).
    bool add(std::size_t n) {
        const bool opens = buckets_.empty() || cap_ == 0 || buckets_.back().count + n > cap_;
        if (opens) buckets_.push_back({items_, items_, offset_, 0});
        buckets_.back().last = ++items_;
        buckets_.back().count += n;
        offset_ += n;
        return opens;
    }
    [[nodiscard]] const std::vector<bucket>& buckets() const noexcept { return buckets_; }

private:
    std::size_t cap_;
    std::size_t items_ = 0;
    std::size_t offset_ = 0;
    std::vector<bucket> buckets_;
};

/// The buckets of `items` (bucket_filler's rule).
template <class T>
std::vector<bucket> plan_buckets(const std::vector<allreduce_item<T>>& items, std::size_t cap_bytes,
                                 bool pack_symmetric) {
    bucket_filler filler(cap_bytes, sizeof(T));
    for (const auto& it : items) filler.add(packed_count(it, pack_symmetric));
    return filler.buckets();
}

/// Values of all buckets together.
inline std::size_t total_count(const std::vector<bucket>& buckets) {
    return buckets.empty() ? 0 : buckets.back().offset + buckets.back().count;
}

/// Copies bucket `b`'s items into `buffer` at the bucket's offset.
template <class T>
void pack_bucket(const std::vector<allreduce_item<T>>& items, const bucket& b, bool pack_symmetric, T* buffer) {
    T* out = buffer + b.offset;
    for (std::size_t i = b.first; i < b.last; ++i) {
        const auto& it = items[i];
        if (pack_symmetric && it.symmetric) pack_lower(it.data, it.dim, out);
        else std::memcpy(out, it.data, sizeof(T) * it.count);
        out += packed_count(it, pack_symmetric);
    }
}

/// Copies bucket `b`'s items back out of `buffer` (where pack_bucket put them).
template <class T>
void unpack_bucket(const std::vector<allreduce_item<T>>& items, const bucket& b, bool pack_symmetric, const T* buffer) {
    const T* in = buffer + b.offset;
    for (std::size_t i = b.first; i < b.last; ++i) {
        const auto& it = items[i];
        if (pack_symmetric && it.symmetric) unpack_lower(in, it.dim, it.data);
        else std::memcpy(it.data, in, sizeof(T) * it.count);
        in += packed_count(it, pack_symmetric);
    }
}

/// allreduce_sum_each's shortcut: with no items, or a group of one rank, nothing travels and
/// every item has landed already (`landed` is told so once). True when so.
template <class T>
bool landed_without_sending(const std::vector<allreduce_item<T>>& items, int group_size, const bucket_landed& landed) {
    if (!items.empty() && group_size > 1) return false;
    if (!items.empty() && landed) landed(0, items.size());
    return true;
}

/// allreduce_sum_each's calls of `landed` (kfac/comm/serial.hpp's contract): one after each
/// completed bucket until a call throws; that exception is raised by finish(), which the
/// transport calls once every bucket has completed, so no collective is left pending.
class landing_calls {
public:
    explicit landing_calls(const bucket_landed& landed) : landed_(landed) {}
    void after(const bucket& b) {
        if (!landed_ || failure_) return;
        try {
            landed_(b.first, b.last);
        } catch (...) {
            failure_ = std::current_exception();
        }
    }
    void finish() const {
        if (failure_) std::rethrow_exception(failure_);
    }

private:
    const bucket_landed& landed_;
    std::exception_ptr failure_;
};

}  // namespace kfac::comm::detail
