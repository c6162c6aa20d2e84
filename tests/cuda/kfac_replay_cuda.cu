// SPDX-License-Identifier: Apache-2.0
// kfac_replay built by nvcc, with the CUDA backend as its default (--backend cuda).
#include "kfac_replay.cpp"
