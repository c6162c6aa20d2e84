#!/usr/bin/env bash
# Every GPU check of the project in one call, for whoever has a GPU at hand.
#
#   bench/gpu_checks.sh pack [DIR]   # here (no GPU needed): build the CUDA programs, gather
#                                    # them and what they need into DIR (default .gpu)
#   bench/gpu_checks.sh run [DIR]    # on the GPU machine, from the repository root
#   bench/gpu_checks.sh local        # both, on one machine that has a GPU and the toolchain
#
# `pack` configures a build without MPI (build-gpu/, for sm_90 and PTX of compute_75, so the
# binaries run on an H100/H200 natively and JIT elsewhere), builds the CUDA suite, the golden
# replay and bench_cuda, and copies into DIR: the binaries, the non-system libraries they load
# (OpenBLAS from the pinned wheel), and kfac-pytorch's copy (KFAC_PYTORCH, default
# ../shared/peers/kfac-pytorch). DIR is listed in .git/info/exclude, so it is no part of the
# repository; a GPU session carries it (the device tool's `carry`).
#
# `run` runs, in order, and stops at nothing (each step's status is collected, the script's
# exit status is the number of failed steps):
#   1. the CUDA suite: kfac_cuda_tests (backend calls, whole preconditioners) and
#      kfac_cuda_kinds_tests (every layer kind against the CPU backend);
#   2. kfac_replay_cuda on every golden case of tests/data/golden, in double and in float;
#   3. bench_cuda on ResNet-32, ResNet-50 and the BERT-base-like stack (every kind), float32;
#   4. bench/side_by_side_gpu.py: kfac-pytorch against bench_cuda on ResNet-50 at batch 32 and
#      the BERT-base-like stack at 32 × 128;
#   5. the LibTorch CUDA programs, configured against the Python torch's LibTorch
#      (torch.utils.cmake_prefix_path) when CMake, Eigen and the torch package are there:
#      kfac_torch_cuda_tests and the Fashion-MNIST flagship with --device cuda when its data
#      set is found (KFAC_FASHION_MNIST_DIR).
# Logs and JSON lines go to $OUT when set (the device tool's output folder), else DIR/results.
set -uo pipefail
mode=${1:?usage: bench/gpu_checks.sh pack|run|local [DIR]}
dir=${2:-.gpu}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

pack() {
    mkdir -p "$dir/bin" "$dir/lib"
    grep -qxF "/$dir" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$dir" >> .git/info/exclude; }
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKFAC_ENABLE_MPI=OFF -DKFAC_BUILD_EXAMPLES=OFF \
        "-DCMAKE_CUDA_ARCHITECTURES=90-real;75-virtual" || return 1
    local targets=(kfac_cuda_tests kfac_cuda_kinds_tests kfac_replay_cuda bench_cuda)
    cmake --build build-gpu --target "${targets[@]}" || return 1
    for t in "${targets[@]}"; do cp "$(find build-gpu -type f -name "$t" -perm -u+x | head -1)" "$dir/bin/"; done
    # Libraries outside the system and the CUDA toolkit (the GPU machine has both).
    for b in "$dir"/bin/*; do
        ldd "$b" | awk '/=> \// {print $3}' | grep -v -e '^/lib' -e '^/usr/lib' -e '/cuda' | while read -r lib; do
            cp -L "$lib" "$dir/lib/"
        done
    done
    local peers=${KFAC_PYTORCH:-../shared/peers/kfac-pytorch}
    if [ -d "$peers/kfac" ]; then
        rm -rf "$dir/kfac-pytorch" && mkdir -p "$dir/kfac-pytorch"
        cp -r "$peers/kfac" "$peers/README.md" "$dir/kfac-pytorch/" 2>/dev/null
    else
        echo "gpu_checks: no kfac-pytorch at $peers (set KFAC_PYTORCH); the side-by-side will be skipped" >&2
    fi
    du -sh "$dir"
}

run() {
    local out=${OUT:-$dir/results}
    mkdir -p "$out"
    export LD_LIBRARY_PATH="$root/$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local failed=0
    step() {  # step NAME COMMAND...: runs it, logs it, counts a failure (77: skipped)
        local name=$1; shift
        echo "=== $name: $*"
        "$@" > "$out/$name.log" 2>&1
        local rc=$?
        tail -n 25 "$out/$name.log"
        if [ $rc -eq 0 ]; then echo "=== $name: passed"
        elif [ $rc -eq 77 ]; then echo "=== $name: skipped"
        else echo "=== $name: FAILED (exit $rc)"; failed=$((failed + 1)); fi
    }
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
    step cuda_backend "$dir/bin/kfac_cuda_tests"
    step cuda_layer_kinds "$dir/bin/kfac_cuda_kinds_tests"
    for case_dir in tests/data/golden/*/; do
        for precision in double float; do
            step "replay_cuda.$(basename "$case_dir").$precision" "$dir/bin/kfac_replay_cuda" "$case_dir" "--$precision"
        done
    done
    step bench_cuda "$dir/bin/bench_cuda" --model bench/models/resnet32_cifar10.txt --model bench/models/resnet50_imagenet.txt \
        --model bench/models/bert_base_stack.txt --iterations 10
    if [ -d "$dir/kfac-pytorch/kfac" ]; then
        step side_by_side python3 bench/side_by_side_gpu.py --bench-cuda "$dir/bin/bench_cuda" \
            --kfac-pytorch "$dir/kfac-pytorch" --iterations 10 --json "$out/side_by_side.json"
    fi
    local torch_prefix
    if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) && command -v cmake > /dev/null; then
        step torch_cuda_configure cmake -S . -B build-torch-cuda -DCMAKE_BUILD_TYPE=Release -DKFAC_ENABLE_MPI=OFF \
            -DKFAC_BUILD_BENCHMARKS=OFF "-DCMAKE_PREFIX_PATH=$torch_prefix" -DCMAKE_CUDA_ARCHITECTURES=native
        step torch_cuda_build cmake --build build-torch-cuda --target kfac_torch_cuda_tests kfac_fashion_mnist -j
        step torch_cuda "$(find build-torch-cuda -type f -name kfac_torch_cuda_tests | head -1)"
        local flagship
        flagship=$(find build-torch-cuda -type f -name kfac_fashion_mnist -perm -u+x | head -1)
        if [ -n "$flagship" ]; then
            step flagship_cuda_cnn "$flagship" --device cuda --model cnn --epochs 3 --out "$out/flagship_cnn"
            step flagship_cuda_resnet "$flagship" --device cuda --model resnet --epochs 2 --out "$out/flagship_resnet"
        fi
    else
        echo "=== LibTorch CUDA programs: no Python torch or no CMake here; skipped"
    fi
    echo "=== gpu_checks: $failed failed step(s); logs in $out"
    return "$failed"
}

case $mode in
    pack) pack ;;
    run) run ;;
    local) pack && run ;;
    *) echo "usage: bench/gpu_checks.sh pack|run|local [DIR]" >&2; exit 2 ;;
esac
