// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file engine_checkpoint.hpp
/// save() and load() of the engine's state through detail::checkpoint_io (the records'
/// tensors gathered to rank 0 and scattered back by the plan; kfac/checkpoint/format.hpp).

#include <exception>
#include <filesystem>
#include <istream>
#include <iterator>
#include <ostream>
#include <string>
#include <string_view>

#include "kfac/checkpoint/files.hpp"
#include "kfac/detail/checkpoint_io.hpp"
#include "kfac/detail/engine.hpp"

namespace kfac::detail {

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::save(const std::filesystem::path& path,
                                                      const checkpoint::save_options& o) {
    const auto archive = checkpoint_io<engine>::collect(*this, o);
    agree_on([&] {
        if (archive) checkpoint::write_file(path, *archive);
    });
}

template <class Backend, class CommPolicy, class ComputeMethod>
std::string engine<Backend, CommPolicy, ComputeMethod>::save_bytes(const checkpoint::save_options& o) {
    const auto archive = checkpoint_io<engine>::collect(*this, o);
    std::string bytes;
    agree_on([&] {
        if (archive) bytes = checkpoint::serialize(*archive);
    });
    return bytes;
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::save(std::ostream& out, const checkpoint::save_options& o) {
    const std::string bytes = save_bytes(o);
    agree_on([&] {
        if (comm_.rank() != 0) return;
        out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
        if (!out) throw error("save(): writing " + std::to_string(bytes.size()) + " bytes to the stream failed");
    });
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::load(const std::filesystem::path& path,
                                                      const checkpoint::load_options& o) {
    std::string bytes;
    agree_on([&] {
        // A folder, a device or a pipe is refused by its type, and every failure is a
        // kfac::error naming the file (kfac/checkpoint/files.hpp), which every rank raises.
        if (comm_.rank() == 0) bytes = checkpoint::read_bytes(path);
    });
    load_from(std::move(bytes), path.string(), o);
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::load_bytes(std::string_view bytes, const checkpoint::load_options& o) {
    load_from(comm_.rank() == 0 ? std::string(bytes) : std::string(), "(bytes in memory)", o);
}

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::load(std::istream& in, const checkpoint::load_options& o) {
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

template <class Backend, class CommPolicy, class ComputeMethod>
void engine<Backend, CommPolicy, ComputeMethod>::load_from(std::string bytes, const std::string& source,
                                                           const checkpoint::load_options& o) {
    using io = checkpoint_io<engine>;
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
    // checkpoint_io::commit left every layer without second-order data, so no previous
    // eigenvectors are kept: every factor is decomposed exactly.
    update_second_order(plan, outcome);
    health_.kept_decompositions += outcome.health.kept_decompositions;
}

}  // namespace kfac::detail
