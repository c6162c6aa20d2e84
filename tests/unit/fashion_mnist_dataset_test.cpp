// SPDX-License-Identifier: Apache-2.0
// The flagship's data loader (examples/common/fashion_mnist_dataset.hpp) on small IDX files
// written here and gzip'd with the system's gzip, as Debian's dataset-fashion-mnist ships them:
// a valid set loads value for value, and every way a file can be missing or wrong gives an
// error naming the file, what is wrong and (when missing) the package.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../../examples/common/fashion_mnist_dataset.hpp"

namespace fs = std::filesystem;
namespace fm = kfac_examples::fashion_mnist;

namespace {

void put_u32(std::string& out, std::uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xffu));
}

/// An IDX file of unsigned bytes: magic, dimensions, values.
std::string idx(std::uint32_t magic, const std::vector<std::uint32_t>& dims, const std::vector<std::uint8_t>& values) {
    std::string out;
    put_u32(out, magic);
    for (auto d : dims) put_u32(out, d);
    out.append(values.begin(), values.end());
    return out;
}

/// A fresh directory holding the four files of a set of `n_train` and `n_test` images.
struct fake_dataset {
    fs::path dir;
    std::vector<std::uint8_t> train_pixels, test_pixels, train_labels, test_labels;

    fake_dataset(const std::string& name, std::uint32_t n_train, std::uint32_t n_test)
        : dir(fs::temp_directory_path() /
              ("kfac_fashion_mnist_test_" + name + "_" + std::to_string(std::random_device{}()))) {
        fs::remove_all(dir);
        fs::create_directories(dir);
        for (std::uint32_t i = 0; i < n_train * fm::pixels; ++i) train_pixels.push_back(static_cast<std::uint8_t>(i % 251));
        for (std::uint32_t i = 0; i < n_test * fm::pixels; ++i) test_pixels.push_back(static_cast<std::uint8_t>(i % 241));
        for (std::uint32_t i = 0; i < n_train; ++i) train_labels.push_back(static_cast<std::uint8_t>(i % 10));
        for (std::uint32_t i = 0; i < n_test; ++i) test_labels.push_back(static_cast<std::uint8_t>((7 * i) % 10));
        write("train-images-idx3-ubyte.gz", idx(0x803, {n_train, 28, 28}, train_pixels));
        write("train-labels-idx1-ubyte.gz", idx(0x801, {n_train}, train_labels));
        write("t10k-images-idx3-ubyte.gz", idx(0x803, {n_test, 28, 28}, test_pixels));
        write("t10k-labels-idx1-ubyte.gz", idx(0x801, {n_test}, test_labels));
    }
    ~fake_dataset() {
        std::error_code ec;
        fs::remove_all(dir, ec);
    }

    /// Writes `bytes` gzip'd to `name` (through the gzip the loader reads with).
    void write(const std::string& name, const std::string& bytes) const {
        const fs::path raw = dir / "raw";
        std::ofstream(raw, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
        const std::string command = "gzip -c -- " + kfac_examples::shell_quote(raw.string()) + " > " +
                                    kfac_examples::shell_quote((dir / name).string());
        REQUIRE(std::system(command.c_str()) == 0);
        fs::remove(raw);
    }
};

}  // namespace

TEST_CASE("the Fashion-MNIST loader reads gzip'd IDX files value for value", "[examples][fashion_mnist]") {
    const fake_dataset d("valid", 3, 2);
    const auto data = fm::load(d.dir);
    CHECK(data.train.size() == 3);
    CHECK(data.test.size() == 2);
    CHECK(data.train.pixels == d.train_pixels);
    CHECK(data.test.pixels == d.test_pixels);
    CHECK(data.train.labels == d.train_labels);
    CHECK(data.test.labels == d.test_labels);
}

TEST_CASE("the Fashion-MNIST loader names the file, the fault and the package", "[examples][fashion_mnist]") {
    using Catch::Contains;
    const fake_dataset d("faults", 2, 1);
    const std::string images = (d.dir / "train-images-idx3-ubyte.gz").string();
    SECTION("a missing file: its path and the Debian package") {
        fs::remove(images);
        CHECK_THROWS_AS(fm::load(d.dir), fm::dataset_missing);
        CHECK_THROWS_WITH(fm::load(d.dir), Contains(images) && Contains("apt install dataset-fashion-mnist"));
    }
    SECTION("a file that is not gzip'd") {
        std::ofstream(images, std::ios::binary) << "plain text";
        CHECK_THROWS_WITH(fm::load(d.dir), Contains(images) && Contains("not a valid gzip file"));
    }
    SECTION("labels where images belong: the magic number found and the one expected, in hexadecimal") {
        d.write("train-images-idx3-ubyte.gz", idx(0x801, {2}, {1, 2}));
        CHECK_THROWS_WITH(fm::load(d.dir), Contains(images) && Contains("magic number 0x00000801, expected 0x00000803"));
    }
    SECTION("images of another size") {
        d.write("train-images-idx3-ubyte.gz", idx(0x803, {2, 32, 32}, std::vector<std::uint8_t>(2 * 32 * 32)));
        CHECK_THROWS_WITH(fm::load(d.dir), Contains(images) && Contains("dimension 2 is 32, expected 28"));
    }
    SECTION("a truncated file") {
        auto cut = d.train_pixels;
        cut.resize(cut.size() - 5);
        d.write("train-images-idx3-ubyte.gz", idx(0x803, {2, 28, 28}, cut));
        CHECK_THROWS_WITH(fm::load(d.dir), Contains(images) && Contains("truncated or corrupt"));
    }
    SECTION("as many labels as images, and labels in 0..9") {
        d.write("train-labels-idx1-ubyte.gz", idx(0x801, {3}, {0, 1, 2}));
        CHECK_THROWS_WITH(fm::load(d.dir), Contains("train has 2 images but 3 labels"));
        d.write("train-labels-idx1-ubyte.gz", idx(0x801, {2}, {0, 10}));
        CHECK_THROWS_WITH(fm::load(d.dir), Contains("train has the label 10"));
    }
}
