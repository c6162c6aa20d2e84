// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file digits_dataset.hpp
/// The UCI handwritten digits (1,797 grey 8×8 images of the digits 0–9), as Debian's
/// python3-sklearn package ships them: `sklearn/datasets/data/digits.csv.gz`, one image per
/// line, 64 pixel values in 0..16 (row by row) and then the label.
///
/// Shared by the examples; it depends on the standard library only (no Eigen, no kfac), so a
/// LibTorch or any other host can use it:
///
/// ```cpp
/// const auto all = kfac_examples::digits::load(kfac_examples::digits::default_digits_path());
/// const auto [train, test] = kfac_examples::digits::train_test_split(all, /*seed=*/1);
/// // train.images: float [train.size(), 64] row-major in [0, 1]; train.labels: int [size()]
/// ```
///
/// The file is gzip'd; read_file.hpp reads it (through `gzip -dc`). A path that does not end
/// in `.gz` is read as plain CSV.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "dataset_errors.hpp"
#include "read_file.hpp"

namespace kfac_examples::digits {

inline constexpr int image_side = 8;
inline constexpr int pixels = image_side * image_side;  // 64 features per image
inline constexpr int classes = 10;
inline constexpr int expected_images = 1797;  // the size of the UCI set as sklearn ships it

using kfac_examples::dataset_error;    // dataset_errors.hpp
using kfac_examples::dataset_missing;

/// Images and labels, in the file's order (or the split's).
struct dataset {
    std::vector<float> images;  ///< [size(), 64], row-major, pixel / 16 so in [0, 1]
    std::vector<int> labels;    ///< [size()], each in 0..9

    [[nodiscard]] std::size_t size() const noexcept { return labels.size(); }
    /// The 64 pixels of image i.
    [[nodiscard]] const float* image(std::size_t i) const noexcept {
        return images.data() + i * static_cast<std::size_t>(pixels);
    }
};

/// A train/test partition of one dataset.
struct split {
    dataset train;
    dataset test;
};

namespace detail {

/// Where pip or Debian put Python packages: the Debian package's directory first.
inline std::vector<std::filesystem::path> python_package_dirs() {
    namespace fs = std::filesystem;
    std::vector<fs::path> dirs{"/usr/lib/python3/dist-packages",  // Debian's python3-* packages
                               "/usr/local/lib/python3/dist-packages"};
    // Versioned directories, e.g. /usr/local/lib/python3.11/dist-packages (pip install).
    for (const char* root : {"/usr/local/lib", "/usr/lib"}) {
        std::error_code ec;
        std::vector<fs::path> found;
        for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
            const std::string name = it->path().filename().string();
            if (name.rfind("python3.", 0) != 0) continue;
            for (const char* sub : {"dist-packages", "site-packages"}) found.push_back(it->path() / sub);
        }
        std::sort(found.begin(), found.end());  // directory order is unspecified
        dirs.insert(dirs.end(), found.begin(), found.end());
    }
    return dirs;
}

}  // namespace detail

/// Where Debian's python3-sklearn puts the data set (or a pip install, when that is the one
/// present): the first existing `sklearn/datasets/data/digits.csv.gz` under the Python package
/// directories. When none exists it returns the Debian location, so that load() reports it.
/// Never throws.
inline std::filesystem::path default_digits_path() {
    const std::filesystem::path rel = "sklearn/datasets/data/digits.csv.gz";
    try {
        const auto dirs = detail::python_package_dirs();
        for (const auto& d : dirs) {
            std::error_code ec;
            if (std::filesystem::is_regular_file(d / rel, ec)) return d / rel;
        }
    } catch (...) {  // bad_alloc and friends: fall back to the documented location
    }
    return std::filesystem::path("/usr/lib/python3/dist-packages") / rel;
}

/// Reads the digits from `path` (`.csv.gz`, or plain `.csv`).
/// @throws dataset_missing when the file does not exist (the message names the path and
///         the fix); dataset_error when it cannot be read or is not the expected table.
inline dataset load(const std::filesystem::path& path) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec))
        throw dataset_missing("digits data set not found at " + path.string() +
                              ": apt install python3-sklearn or pass --data PATH");
    std::string text;
    try {
        text = read_file(path);
    } catch (const file_error& e) {
        throw dataset_error(e.what());
    }

    dataset d;
    d.images.reserve(static_cast<std::size_t>(expected_images) * pixels);
    d.labels.reserve(expected_images);
    std::size_t line_no = 0;
    std::size_t pos = 0;
    while (pos < text.size()) {
        std::size_t eol = text.find('\n', pos);
        if (eol == std::string::npos) eol = text.size();
        const std::string_view line(text.data() + pos, eol - pos);
        pos = eol + 1;
        ++line_no;
        if (line.empty() || line == "\r") continue;

        // 65 comma-separated non-negative integers: 64 pixels (0..16), then the label (0..9).
        int values[pixels + 1];
        int count = 0;
        std::size_t i = 0;
        const auto bad = [&](const std::string& why) {
            return dataset_error(path.string() + ":" + std::to_string(line_no) + ": " + why +
                                 " (expected 64 pixel values in 0..16 and a label in 0..9)");
        };
        while (i < line.size() && line[i] != '\r') {
            if (count == pixels + 1) throw bad("more than 65 values");
            int v = 0;
            std::size_t digits = 0;
            // sklearn's file writes integers; accept a trailing ".0" as well.
            for (; i < line.size() && line[i] >= '0' && line[i] <= '9'; ++i, ++digits)
                v = v * 10 + (line[i] - '0');
            if (i < line.size() && line[i] == '.')
                for (++i; i < line.size() && line[i] == '0'; ++i) {}
            if (digits == 0 || digits > 3) throw bad("value " + std::to_string(count + 1) + " is not a small integer");
            values[count++] = v;
            if (i < line.size() && line[i] == ',') ++i;
            else if (i < line.size() && line[i] != '\r') throw bad("unexpected character");
        }
        if (count != pixels + 1) throw bad(std::to_string(count) + " values");
        for (int p = 0; p < pixels; ++p) {
            if (values[p] > 16) throw bad("pixel value " + std::to_string(values[p]));
            d.images.push_back(static_cast<float>(values[p]) / 16.0f);
        }
        if (values[pixels] >= classes) throw bad("label " + std::to_string(values[pixels]));
        d.labels.push_back(values[pixels]);
    }
    if (d.size() == 0) throw dataset_error(path.string() + " holds no images");
    return d;
}

/// The images `rows` of `d`, in that order.
inline dataset subset(const dataset& d, const std::vector<std::size_t>& rows) {
    dataset s;
    s.images.reserve(rows.size() * pixels);
    s.labels.reserve(rows.size());
    for (std::size_t r : rows) {
        s.images.insert(s.images.end(), d.image(r), d.image(r) + pixels);
        s.labels.push_back(d.labels[r]);
    }
    return s;
}

/// A deterministic stratified split: within each class, the images are shuffled with
/// std::mt19937(seed) (specified bit for bit by the standard; the shuffle is written out here
/// because std::shuffle is not) and round(test_fraction · class size) of them go to the test
/// set. Both sets keep the file's order. With the defaults the full set splits 1,438 / 359.
/// @throws dataset_error when test_fraction is outside (0, 1).
inline split train_test_split(const dataset& d, std::uint32_t seed = 0, double test_fraction = 0.2) {
    if (!(test_fraction > 0.0 && test_fraction < 1.0))
        throw dataset_error("test_fraction = " + std::to_string(test_fraction) + " must lie in (0, 1)");
    std::mt19937 engine(seed);
    std::vector<bool> is_test(d.size(), false);
    for (int c = 0; c < classes; ++c) {
        std::vector<std::size_t> rows;
        for (std::size_t i = 0; i < d.size(); ++i)
            if (d.labels[i] == c) rows.push_back(i);
        for (std::size_t i = rows.size(); i > 1; --i) std::swap(rows[i - 1], rows[engine() % i]);
        const auto n_test = static_cast<std::size_t>(test_fraction * static_cast<double>(rows.size()) + 0.5);
        for (std::size_t i = 0; i < n_test && i < rows.size(); ++i) is_test[rows[i]] = true;
    }
    std::vector<std::size_t> train_rows, test_rows;
    for (std::size_t i = 0; i < d.size(); ++i) (is_test[i] ? test_rows : train_rows).push_back(i);
    return {subset(d, train_rows), subset(d, test_rows)};
}

}  // namespace kfac_examples::digits
