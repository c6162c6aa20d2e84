// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file fashion_mnist_dataset.hpp
/// Fashion-MNIST (Zalando: 60,000 training and 10,000 test grey 28×28 images of clothing in
/// 10 classes) as Debian's `dataset-fashion-mnist` package ships it: four gzip'd IDX files in
/// `/usr/share/datasets/fashion-mnist/`.
///
/// The IDX format (LeCun's MNIST page): a big-endian header, the magic number 0x00000803 for
/// images (unsigned bytes, 3 dimensions: count, rows, columns) or 0x00000801 for labels (1
/// dimension: count), then the values row by row. The standard library only (no kfac, no
/// LibTorch), so any host can use it:
///
/// ```cpp
/// const auto data = kfac_examples::fashion_mnist::load(kfac_examples::fashion_mnist::default_dir());
/// // data.train.pixels: uint8 [60000 · 784]; data.train.labels: uint8 [60000]
/// ```

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "dataset_errors.hpp"
#include "read_file.hpp"

namespace kfac_examples::fashion_mnist {

inline constexpr int side = 28;
inline constexpr int pixels = side * side;  // 784
inline constexpr int classes = 10;
inline constexpr const char* class_names[classes] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                                     "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

using kfac_examples::dataset_error;    // dataset_errors.hpp
using kfac_examples::dataset_missing;

/// Images and labels in the files' order.
struct images {
    std::vector<std::uint8_t> pixels;  ///< [size() · 784], row by row, 0 (background) to 255
    std::vector<std::uint8_t> labels;  ///< [size()], each in 0..9
    [[nodiscard]] std::size_t size() const noexcept { return labels.size(); }
};

struct dataset {
    images train;  ///< 60,000
    images test;   ///< 10,000
};

/// Debian's location of the files.
inline std::filesystem::path default_dir() { return "/usr/share/datasets/fashion-mnist"; }

namespace detail {

inline std::uint32_t big_endian(const std::string& bytes, std::size_t at) {
    return (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at])) << 24) |
           (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 1])) << 16) |
           (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 2])) << 8) |
           static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 3]));
}

/// `value` as IDX headers are written: "0x" and eight hexadecimal digits.
inline std::string hex(std::uint32_t value) {
    char text[11];
    std::snprintf(text, sizeof text, "0x%08x", static_cast<unsigned>(value));
    return text;
}

/// The values of an IDX file of unsigned bytes with the given dimensions after the count
/// (none for labels, {28, 28} for images); `count` receives the first dimension.
inline std::vector<std::uint8_t> read_idx(const std::filesystem::path& path, const std::vector<std::uint32_t>& inner,
                                          std::size_t& count) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec))
        throw dataset_missing("Fashion-MNIST file not found: " + path.string() +
                              " (apt install dataset-fashion-mnist, or pass --data DIR with the four "
                              "*-ubyte.gz files)");
    std::string bytes;
    try {
        bytes = read_file(path);
    } catch (const file_error& e) {
        throw dataset_error(e.what());
    }
    const std::size_t header = 4 * (2 + inner.size());
    const std::uint32_t magic = 0x00000800u | static_cast<std::uint32_t>(1 + inner.size());
    if (bytes.size() < header || big_endian(bytes, 0) != magic)
        throw dataset_error(path.string() + ": not an IDX file of unsigned bytes with " +
                            std::to_string(1 + inner.size()) + " dimensions (magic number " +
                            (bytes.size() >= 4 ? hex(big_endian(bytes, 0)) : std::string("missing")) + ", expected " +
                            hex(magic) + ")");
    count = big_endian(bytes, 4);
    std::size_t per_item = 1;
    for (std::size_t i = 0; i < inner.size(); ++i) {
        const std::uint32_t d = big_endian(bytes, 8 + 4 * i);
        if (d != inner[i])
            throw dataset_error(path.string() + ": dimension " + std::to_string(i + 2) + " is " + std::to_string(d) +
                                ", expected " + std::to_string(inner[i]));
        per_item *= d;
    }
    if (bytes.size() != header + count * per_item)
        throw dataset_error(path.string() + ": holds " + std::to_string(bytes.size() - header) + " bytes of values for " +
                            std::to_string(count) + " items of " + std::to_string(per_item) +
                            " (truncated or corrupt)");
    return {bytes.begin() + static_cast<std::ptrdiff_t>(header), bytes.end()};
}

inline images read_pair(const std::filesystem::path& dir, const std::string& prefix) {
    images out;
    std::size_t n_images = 0, n_labels = 0;
    out.pixels = read_idx(dir / (prefix + "-images-idx3-ubyte.gz"), {side, side}, n_images);
    out.labels = read_idx(dir / (prefix + "-labels-idx1-ubyte.gz"), {}, n_labels);
    if (n_images != n_labels)
        throw dataset_error(dir.string() + ": " + prefix + " has " + std::to_string(n_images) + " images but " +
                            std::to_string(n_labels) + " labels");
    for (const auto label : out.labels)
        if (label >= classes)
            throw dataset_error(dir.string() + ": " + prefix + " has the label " + std::to_string(label) +
                                "; labels are 0..9");
    return out;
}

}  // namespace detail

/// Reads `train-{images-idx3,labels-idx1}-ubyte.gz` and `t10k-...` from `dir`.
/// @throws dataset_missing naming the first missing file and the package that has it;
///         dataset_error when a file cannot be read or is not what Fashion-MNIST is.
inline dataset load(const std::filesystem::path& dir = default_dir()) {
    return {detail::read_pair(dir, "train"), detail::read_pair(dir, "t10k")};
}

}  // namespace kfac_examples::fashion_mnist
