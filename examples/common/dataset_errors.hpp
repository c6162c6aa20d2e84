// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file dataset_errors.hpp
/// The errors of the examples' data loaders (digits_dataset.hpp, fashion_mnist_dataset.hpp):
/// one pair for every data set, so a program treats them alike.

#include <stdexcept>

namespace kfac_examples {

/// Any problem while locating or reading a data set (the message names the file).
class dataset_error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

/// A file is missing: a program may treat this differently (a test skips).
class dataset_missing : public dataset_error {
public:
    using dataset_error::dataset_error;
};

}  // namespace kfac_examples
