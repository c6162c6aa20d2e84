// SPDX-License-Identifier: Apache-2.0
// options.skip_layers and options.reduce_layers compiled once (kfac/detail/layer_patterns.hpp),
// checked against their definition: std::regex_search (ECMAScript, case-sensitive) over the
// name, and for skip_layers over the kind's two names too.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include <kfac/detail/layer_patterns.hpp>

namespace layer_patterns_test {

using kfac::layer_kind;
using kfac::detail::layer_patterns;

TEST_CASE("a pattern matches anywhere in the name, case-sensitively", "[options][layer_patterns]") {
    const layer_patterns p("skip_layers", {"conv", "^head$"});
    CHECK(p.match_name("layer1.conv2"));
    CHECK(p.match_name("head"));
    CHECK_FALSE(p.match_name("head.bias"));  // anchored: the whole name only
    CHECK_FALSE(p.match_name("Conv"));       // case-sensitive
    CHECK_FALSE(layer_patterns().match_name("anything"));
    CHECK_FALSE(layer_patterns("skip_layers", {}).match_layer("fc", layer_kind::linear));
}

TEST_CASE("skip_layers also matches the kind's lower-case and PyTorch names", "[options][layer_patterns]") {
    const auto filter = [](std::vector<std::string> patterns) {
        kfac::options o;
        o.skip_layers = std::move(patterns);
        return kfac::detail::skip_filter(o);
    };
    CHECK(filter({"^linear$"}).match_layer("fc", layer_kind::linear));
    CHECK(filter({"^Linear$"}).match_layer("fc", layer_kind::linear));
    CHECK(filter({"Conv2d"}).match_layer("stem", layer_kind::conv2d));
    CHECK_FALSE(filter({"Conv2d"}).match_layer("stem", layer_kind::conv1d));
    CHECK(filter({"LayerNorm"}).match_layer("ln", layer_kind::layer_norm));
    CHECK_FALSE(filter({"^fc$"}).match_layer("fc2", layer_kind::linear));
    // reduce_layers is matched against the name alone.
    kfac::options o;
    o.reduce_layers = {"^linear$"};
    CHECK_FALSE(kfac::detail::reduce_filter(o).match_name("fc"));
    CHECK(kfac::detail::reduce_filter(o).match_name("linear"));
}

TEST_CASE("a malformed pattern is a kfac::error naming the option and the pattern", "[options][layer_patterns][errors]") {
    using Catch::Matchers::Contains;
    kfac::options o;
    o.reduce_layers = {"ok", "[unclosed"};
    CHECK_THROWS_AS(kfac::detail::reduce_filter(o), kfac::error);
    CHECK_THROWS_WITH(kfac::detail::reduce_filter(o),
                      Contains("options.reduce_layers: '[unclosed'") && Contains("not a valid ECMAScript regular expression"));
    o.skip_layers = {"("};
    CHECK_THROWS_WITH(kfac::detail::skip_filter(o), Contains("options.skip_layers: '('"));
}

}  // namespace layer_patterns_test
