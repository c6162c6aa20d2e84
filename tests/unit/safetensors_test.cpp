// SPDX-License-Identifier: Apache-2.0
// The safetensors container of checkpoints: what is written reads back bit for bit, a file
// laid out as Python's safetensors writes it parses, and every kind of damage is an error
// that names the file and what is wrong.
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <sys/stat.h>
#include <unistd.h>

#include <kfac/checkpoint/files.hpp>
#include <kfac/checkpoint/safetensors.hpp>

using Catch::Contains;
namespace ck = kfac::checkpoint;

namespace {

ck::archive sample() {
    ck::archive a;
    const float f[6] = {1.5f, -2.f, 3.25f, 0.f, 1e-30f, 7.f};
    const double d[3] = {0.1, -1e300, 2.0};
    const std::int64_t step[1] = {42};
    a.tensors.push_back(ck::tensor::from("fc1.A", f, {2, 3}));
    a.tensors.push_back(ck::tensor::from("fc1.G", d, {3}));
    a.tensors.push_back(ck::tensor::from("steps", step, {}));
    a.tensors.push_back(ck::tensor::from("empty", f, {0, 4}));
    a.metadata["format_version"] = "1";
    a.metadata["note"] = "quote \" backslash \\ newline \n tab \t bell \x07 é";
    return a;
}

std::uint64_t header_size(const std::string& bytes) {
    std::uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    return n;
}

}  // namespace

TEST_CASE("an archive reads back bit for bit", "[checkpoint][safetensors]") {
    const auto a = sample();
    const std::string bytes = ck::serialize(a);
    // Layout: 8-byte size, a JSON header padded to 8 bytes, then the data.
    CHECK(header_size(bytes) % 8 == 0);
    CHECK(bytes[8] == '{');
    CHECK(bytes.size() == 8 + header_size(bytes) + 6 * 4 + 3 * 8 + 8);
    const auto b = ck::parse(bytes, "memory");
    REQUIRE(b.tensors.size() == a.tensors.size());
    for (std::size_t i = 0; i < a.tensors.size(); ++i) {
        CHECK(b.tensors[i].name == a.tensors[i].name);
        CHECK(b.tensors[i].type == a.tensors[i].type);
        CHECK(b.tensors[i].shape == a.tensors[i].shape);
        CHECK(b.tensors[i].bytes == a.tensors[i].bytes);
    }
    CHECK(b.metadata == a.metadata);
    CHECK(ck::data_checksum(b.tensors) == ck::data_checksum(a.tensors));
    // float and double convert both ways; the scalar reads as one value.
    CHECK(b.find("fc1.G")->values<float>()[0] == 0.1f);
    CHECK(b.find("fc1.A")->values<double>()[2] == 3.25);
    CHECK(b.find("steps")->values<std::int64_t>() == std::vector<std::int64_t>{42});
}

TEST_CASE("a header written the way Python's safetensors writes it parses", "[checkpoint][safetensors]") {
    // Keys in another order, whitespace, escapes, the metadata last, space padding.
    const std::string header =
        "{ \"b\": {\"data_offsets\": [8, 16], \"shape\": [1], \"dtype\": \"F64\"},\n"
        "  \"a\\u00e9\\ud83d\\ude00\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},\n"
        "  \"__metadata__\": {\"format\": \"pt\"} }    ";
    std::string bytes(8, '\0');
    const std::uint64_t n = header.size();
    std::memcpy(bytes.data(), &n, 8);
    bytes += header;
    const float a[2] = {1.f, 2.f};
    const double b = 3.0;
    bytes.append(reinterpret_cast<const char*>(a), 8);
    bytes.append(reinterpret_cast<const char*>(&b), 8);
    const auto x = ck::parse(bytes, "python.safetensors");
    REQUIRE(x.tensors.size() == 2);
    CHECK(x.tensors[0].name == "a\xc3\xa9\xf0\x9f\x98\x80");  // é and U+1F600 in UTF-8, stored first
    CHECK(x.tensors[0].values<float>() == std::vector<float>{1.f, 2.f});
    CHECK(x.tensors[1].values<double>() == std::vector<double>{3.0});
    CHECK(x.metadata.at("format") == "pt");
}

TEST_CASE("damaged files are errors naming the file and the fault", "[checkpoint][safetensors]") {
    const std::string good = ck::serialize(sample());
    const std::uint64_t h = header_size(good);
    auto with_header = [](std::string header, const std::string& data) {
        std::string bytes(8, '\0');
        const std::uint64_t n = header.size();
        std::memcpy(bytes.data(), &n, 8);
        return bytes + header + data;
    };
    CHECK_THROWS_WITH(ck::parse(good.substr(0, 5), "f.safetensors"), Contains("f.safetensors") && Contains("fewer than the 8"));
    CHECK_THROWS_WITH(ck::parse(good.substr(0, 8 + h - 3), "f"), Contains("header size") && Contains("exceeds"));
    CHECK_THROWS_WITH(ck::parse(good.substr(0, good.size() - 1), "f"), Contains("ends at byte") && Contains("truncated"));
    CHECK_THROWS_WITH(ck::parse(good + "x", "f"), Contains("data section holds"));
    CHECK_THROWS_WITH(ck::parse(with_header("{\"t\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}", "a"), "f"),
                      Contains("tensor 't' has dtype F8_E4M3"));
    CHECK_THROWS_WITH(ck::parse(with_header("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", "abcd"), "f"),
                      Contains("spans 4 bytes") && Contains("need 8"));
    CHECK_THROWS_WITH(ck::parse(with_header("{\"t\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                                            "\"u\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
                                            "abcd"),
                                "f"),
                      Contains("overlap or gap"));
    CHECK_THROWS_WITH(ck::parse(with_header("{\"t\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", "abcd"), "f"),
                      Contains("non-negative"));
    CHECK_THROWS_WITH(ck::parse(with_header("{\"t\": [1, 2", ""), "f"), Contains("does not parse"));
    CHECK_THROWS_WITH(ck::parse(with_header("{\"__metadata__\":{\"k\":1}}", ""), "f"), Contains("metadata 'k'"));
    // A flipped bit in the data parses but changes the checksum the metadata carries.
    std::string flipped = good;
    flipped[8 + h + 3] ^= 0x10;
    CHECK(ck::data_checksum(ck::parse(flipped, "f").tensors) != ck::data_checksum(sample().tensors));
}

TEST_CASE("JSON text: escapes, numbers and strictness", "[checkpoint][json]") {
    namespace jt = ck::json_text;
    CHECK(jt::quote("a\"b\\c\n\x01") == "\"a\\\"b\\\\c\\n\\u0001\"");
    const auto v = jt::parse(" {\"n\": -12, \"x\": 2.5e3, \"l\": [true, false, null], \"s\": \"\\u0041\\/\"} ");
    CHECK(v.member("n")->is_integer());
    CHECK(v.member("n")->integer == -12);
    CHECK_FALSE(v.member("x")->is_integer());
    CHECK(v.member("x")->number == 2500.0);
    CHECK(v.member("l")->array.size() == 3);
    CHECK(v.member("s")->text == "A/");
    for (const char* bad : {"{", "[1,]", "{\"a\" 1}", "01x", "\"\\x\"", "\"\\ud800\"", "tru", "{} {}", "\"a\nb\""})
        CHECK_THROWS_AS(jt::parse(bad), kfac::error);
}

TEST_CASE("files are written through a temporary and a rename", "[checkpoint][safetensors]") {
    const auto dir = std::filesystem::temp_directory_path() / ("kfac_safetensors_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    const auto path = dir / "state.safetensors";
    ck::write_file(path, sample());
    CHECK(std::filesystem::exists(path));
    // No temporary is left behind: the folder holds the file alone.
    CHECK(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()) == 1);
    CHECK(ck::read_file(path).metadata.at("format_version") == "1");
    // Overwriting replaces the whole file.
    ck::archive small;
    small.metadata["format_version"] = "2";
    ck::write_file(path, small);
    CHECK(ck::read_file(path).tensors.empty());
    CHECK_THROWS_WITH(ck::write_file(dir / "missing" / "x.safetensors", small), Contains("missing") && Contains("cannot create"));
    CHECK_THROWS_WITH(ck::read_file(dir / "absent.safetensors"), Contains("absent.safetensors") && Contains("cannot open"));
    std::filesystem::remove_all(dir);
}

namespace {


std::string bytes_of(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::size_t entries(const std::filesystem::path& dir) {
    return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()));
}

}  // namespace

TEST_CASE("the temporary file is created exclusively: links and stale files at its names are left alone",
          "[checkpoint][safetensors][integrity]") {
    const auto dir = std::filesystem::temp_directory_path() / ("kfac_safetensors_tmp_test_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const auto path = dir / "state.safetensors";
    const auto victim = dir / "victim.txt";
    std::ofstream(victim) << "precious";
    // The old fixed name and the first names of the scheme (FILE.tmp.<pid>.<n>), which a
    // local user can predict: links to the victim, and a stale temporary of a crashed save.
    const std::string stem = "state.safetensors.tmp." + std::to_string(::getpid()) + ".";
    std::filesystem::create_symlink(victim, dir / "state.safetensors.tmp");
    std::filesystem::create_symlink(victim, dir / (stem + "0"));
    std::filesystem::create_symlink(dir / "nowhere", dir / (stem + "1"));  // dangling: creating through it would make the target
    std::ofstream(dir / (stem + "2")) << "stale";
    ck::write_file(path, sample());
    CHECK(bytes_of(victim) == "precious");
    CHECK(std::filesystem::is_symlink(dir / "state.safetensors.tmp"));
    CHECK(std::filesystem::is_symlink(dir / (stem + "0")));
    CHECK(std::filesystem::is_symlink(dir / (stem + "1")));
    CHECK_FALSE(std::filesystem::exists(dir / "nowhere"));
    CHECK(bytes_of(dir / (stem + "2")) == "stale");
    CHECK_FALSE(std::filesystem::is_symlink(path));
    CHECK(ck::read_file(path).metadata == sample().metadata);
    CHECK(entries(dir) == 6);  // the victim, 3 links, the stale file, the written file
    // A rename that fails (the target is a folder) removes the temporary it wrote.
    const auto folder = dir / "taken";
    std::filesystem::create_directories(folder / "inside");
    CHECK_THROWS_WITH(ck::write_file(folder, sample()), Contains("taken") && Contains("rename"));
    CHECK(entries(dir) == 7);
    std::filesystem::remove_all(dir);
}

TEST_CASE("reading a folder, a device or a pipe is an error naming it", "[checkpoint][safetensors][integrity]") {
    const auto dir = std::filesystem::temp_directory_path() / ("kfac_safetensors_read_test_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    CHECK_THROWS_WITH(ck::read_file(dir), Contains("checkpoint " + dir.string()) && Contains("not a regular file") &&
                                              Contains("a folder"));
    if (std::filesystem::exists("/dev/zero"))  // endless: read to its end, it exhausts memory
        CHECK_THROWS_WITH(ck::read_file("/dev/zero"), Contains("checkpoint /dev/zero") && Contains("not a regular file"));
    // Opening a pipe for reading waits for a writer: refused before it is opened.
    const auto fifo = dir / "pipe";
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    CHECK_THROWS_WITH(ck::read_file(fifo), Contains(fifo.string()) && Contains("not a regular file"));
    std::filesystem::remove_all(dir);
}

namespace {

/// `bytes` with its JSON header replaced by `header` (padded with spaces to 8 bytes, as
/// serialize() pads it), the data section unchanged.
std::string with_header(const std::string& bytes, std::string header) {
    const std::uint64_t old_size = header_size(bytes);
    while (header.size() % 8 != 0) header += ' ';
    std::string out(8, '\0');
    const std::uint64_t n = header.size();
    std::memcpy(out.data(), &n, 8);
    return out + header + bytes.substr(8 + old_size);
}

}  // namespace

TEST_CASE("a name twice in one JSON object is refused at every level of a header", "[checkpoint][safetensors][json]") {
    // Which copy wins would silently decide a tensor's data or a metadata entry (the second copy
    // won before): a tensor twice, a metadata key twice, two __metadata__ objects, and a
    // duplicate inside a tensor's entry are each an error naming the name.
    CHECK_THROWS_WITH(ck::json_text::parse("{\"a\": 1, \"b\": {\"c\": 2, \"c\": 3}}"),
                      Contains("\"c\"") && Contains("appears twice"));
    CHECK_NOTHROW(ck::json_text::parse("{\"a\": {\"c\": 1}, \"b\": {\"c\": 2}}"));  // the same name in two objects
    ck::archive a;
    const float f[2] = {1.f, 2.f};
    a.tensors.push_back(ck::tensor::from("x", f, {2}));
    a.metadata["key"] = "one";
    const std::string bytes = ck::serialize(a);
    std::string header = bytes.substr(8, header_size(bytes));
    while (!header.empty() && header.back() == ' ') header.pop_back();
    REQUIRE(ck::parse(with_header(bytes, header), "f").tensors.size() == 1);
    const std::size_t at = header.find("\"x\":{");
    REQUIRE(at != std::string::npos);
    const std::string tensor_entry = header.substr(at, header.find('}', at) + 1 - at);  // "x":{...}
    const std::string metadata = "\"__metadata__\":{\"key\":\"one\"}";
    REQUIRE(header.find(metadata) != std::string::npos);
    const std::string twice_tensor = "{" + tensor_entry + "," + header.substr(1);
    const std::string twice_key = std::string(header).replace(header.find(metadata), metadata.size(),
                                                              "\"__metadata__\":{\"key\":\"one\",\"key\":\"two\"}");
    const std::string twice_metadata = std::string(header).replace(header.size() - 1, 1, "," + metadata + "}");
    const std::string twice_dtype = std::string(header).replace(header.find("\"dtype\""), 0, "\"dtype\":\"F64\",");
    const std::pair<const std::string*, const char*> cases[] = {
        {&twice_tensor, "\"x\""}, {&twice_key, "\"key\""}, {&twice_metadata, "\"__metadata__\""}, {&twice_dtype, "\"dtype\""}};
    for (const auto& [text, name] : cases) {
        INFO(*text);
        CHECK_THROWS_WITH(ck::parse(with_header(bytes, *text), "dup.safetensors"),
                          Contains("checkpoint dup.safetensors") && Contains(name) && Contains("appears twice"));
    }
}
