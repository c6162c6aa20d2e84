// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file process_group_payloads.hpp
/// How kfac::comm::process_group hands payloads to c10d: as tensors over the caller's memory.
///
/// Host payloads (the default) are packed into a host buffer by kfac/comm/buckets.hpp, as
/// comm::mpi packs them. Payloads in a device's memory (a CUDA backend's matrices, for
/// ProcessGroupNCCL) are packed on that device with ATen operations that move the same values
/// to the same places: a symmetric item's lower triangle column by column (pack_lower's
/// order), mirrored back into both triangles when unpacked (unpack_lower's). Those operations
/// run on the device's default stream, the one kfac's CUDA backend queues its work on
/// (kfac/backend/detail/cuda_support.cuh), so they follow the kernels that wrote the payloads
/// and precede the ones that read the results.

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include "kfac/comm/buckets.hpp"
#include "kfac/comm/serial.hpp"

namespace kfac::comm::detail {

template <class T>
at::ScalarType torch_dtype() {
    if constexpr (std::is_same_v<T, float>) return at::kFloat;
    else if constexpr (std::is_same_v<T, double>) return at::kDouble;
    else if constexpr (std::is_same_v<T, std::int64_t>) return at::kLong;
    else if constexpr (std::is_same_v<T, std::int32_t>) return at::kInt;
    else if constexpr (std::is_same_v<T, char>) return at::kByte;
    else static_assert(std::is_same_v<T, float>, "kfac::comm::process_group: unsupported payload type");
}

/// A one-dimensional tensor over `count` values at `data` in `device`'s memory, which it
/// does not own.
template <class T>
at::Tensor memory_tensor(T* data, std::size_t count, c10::Device device = c10::Device(c10::kCPU)) {
    return at::from_blob(static_cast<void*>(data), {static_cast<std::int64_t>(count)},
                         at::TensorOptions().dtype(torch_dtype<T>()).device(device));
}

/// A one-dimensional tensor over `count` values at `data` in host memory.
template <class T>
at::Tensor host_tensor(T* data, std::size_t count) {
    return memory_tensor(data, count);
}

/// Buckets of payloads that live in one device's memory, packed and unpacked there.
class device_buckets {
public:
    explicit device_buckets(c10::Device device) : device_(device) {}

    [[nodiscard]] c10::Device device() const noexcept { return device_; }

    /// The device's default stream, current while a guard lives (see the file comment).
    [[nodiscard]] c10::StreamGuard on_default_stream() const {
        return c10::StreamGuard(c10::Stream(c10::Stream::DEFAULT, device_));
    }

    /// Bucket `b` of `items` as one new tensor on the device (symmetric items as their lower
    /// triangles when `pack_symmetric`).
    template <class T>
    at::Tensor pack(const std::vector<allreduce_item<T>>& items, const bucket& b, bool pack_symmetric) {
        std::vector<at::Tensor> pieces;
        pieces.reserve(b.last - b.first);
        for (std::size_t i = b.first; i < b.last; ++i) {
            const auto& it = items[i];
            at::Tensor whole = memory_tensor(it.data, it.count, device_);
            pieces.push_back(pack_symmetric && it.symmetric ? whole.index_select(0, triangle(it.dim).lower) : whole);
        }
        return at::cat(pieces);
    }

    /// Copies bucket `b`'s items back out of `packed` (pack's layout), mirroring triangles.
    template <class T>
    void unpack(const std::vector<allreduce_item<T>>& items, const bucket& b, bool pack_symmetric,
                const at::Tensor& packed) {
        std::int64_t offset = 0;
        for (std::size_t i = b.first; i < b.last; ++i) {
            const auto& it = items[i];
            at::Tensor whole = memory_tensor(it.data, it.count, device_);
            const auto n = static_cast<std::int64_t>(packed_count(it, pack_symmetric));
            at::Tensor values = packed.narrow(0, offset, n);
            if (pack_symmetric && it.symmetric) {
                const auto& t = triangle(it.dim);
                whole.index_copy_(0, t.lower, values);
                whole.index_copy_(0, t.mirrored, values);
            } else {
                whole.copy_(values);
            }
            offset += n;
        }
    }

private:
    /// For a dim × dim column-major matrix: the flat positions of its lower triangle in
    /// pack_lower's order (column j, rows j..dim−1: j·dim + i), and of their mirror images
    /// (i·dim + j).
    struct triangle_positions {
        at::Tensor lower;
        at::Tensor mirrored;
    };

    const triangle_positions& triangle(std::int64_t dim) {
        auto found = triangles_.find(dim);
        if (found != triangles_.end()) return found->second;
        std::vector<std::int64_t> lower, mirrored;
        lower.reserve(static_cast<std::size_t>(dim * (dim + 1) / 2));
        mirrored.reserve(lower.capacity());
        for (std::int64_t j = 0; j < dim; ++j) {
            for (std::int64_t i = j; i < dim; ++i) {
                lower.push_back(j * dim + i);
                mirrored.push_back(i * dim + j);
            }
        }
        auto on_device = [&](std::vector<std::int64_t>& v) {  // a copy, also on the CPU
            return memory_tensor(v.data(), v.size()).to(device_, at::kLong, /*non_blocking=*/false, /*copy=*/true);
        };
        return triangles_.emplace(dim, triangle_positions{on_device(lower), on_device(mirrored)}).first->second;
    }

    c10::Device device_;
    std::map<std::int64_t, triangle_positions> triangles_;
};

}  // namespace kfac::comm::detail
