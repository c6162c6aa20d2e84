#!/usr/bin/env bash
# Every GPU check of the project in one call, for whoever has a GPU at hand.
#
#   bench/gpu_checks.sh pack [DIR]   # here (no GPU needed): build the CUDA programs, gather
#                                    # them and what they need into DIR (default .gpu)
#   bench/gpu_checks.sh run [DIR]    # on the GPU machine, from the repository root
#   bench/gpu_checks.sh local        # both, on one machine that has a GPU and the toolchain
#
# `pack` configures a build without MPI and OpenBLAS (build-gpu/, for sm_90 and PTX of
# compute_75, so the binaries run on an H100/H200 natively and JIT elsewhere), builds the CUDA
# suite, the golden replay and bench_cuda, and packs into DIR/pack.tar.gz the stripped
# binaries, the header-only dependencies with their CMake packages (Eigen, Catch2, xtensor, xtl,
# nlohmann_json) and kfac-pytorch's copy (KFAC_PYTORCH, default ../shared/peers/kfac-pytorch);
# the Fashion-MNIST files go beside it (about 40 MB in all). DIR is listed in
# .git/info/exclude, so it is no part of the repository; a GPU session carries it (the device
# tool's `carry`, 64 MiB at most).
#
# `run` runs, in order, and stops at nothing (each step's status is collected, the script's
# exit status is the number of failed steps):
#   1. the CUDA suite: kfac_cuda_tests, its backend cases (backend calls, whole
#      preconditioners) and its layer kinds' cases (every layer kind against the CPU backend);
#   2. kfac_replay_cuda on every golden case of tests/data/golden, in double and in float;
#   3. the LibTorch CUDA programs, configured against the Python torch's LibTorch
#      (torch.utils.cmake_prefix_path) when CMake, Eigen and the torch package are there:
#      kfac_torch_cuda_tests, the Fashion-MNIST flagship (CNN and ResNet-8) with --device cuda
#      when its data set is there (DIR/fashion-mnist or KFAC_FASHION_MNIST_DIR), the CNN again
#      with --precision bf16 and fp16, and the transformer example with --device cuda;
#   4. bench_cuda on ResNet-32, ResNet-50 and the BERT-base-like stack (every kind), float32;
#   5. bench/side_by_side_gpu.py: kfac-pytorch against bench_cuda on ResNet-50 at batch 32 and
#      the BERT-base-like stack at 32 × 128.
#   Checks of numbers first, timings last: a call cut short by its time limit keeps the former.
#   (Step 1's layer kinds' cases hold the mixed-precision GPU checks: bf16 device views
#   against the CPU backend under a loss scale, fp64 decompositions.)
# Logs and JSON lines go to $OUT when set (the device tool's output folder), else DIR/results.
set -uo pipefail
mode=${1:?usage: bench/gpu_checks.sh pack|run|local [DIR]}
dir=${2:-.gpu}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

pack() {
    local stage=$dir/unpacked
    rm -rf "$dir" && mkdir -p "$stage/bin" "$stage/lib" "$stage/prefix"
    grep -qxF "/$dir" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$dir" >> .git/info/exclude; }
    # No MPI (the GPU machine's may differ) and no OpenBLAS (24 MB): the CPU backend the tests
    # compare with runs on Eigen alone there. The build type's -O3 for the engines and
    # bench_cuda, whose figures step 4 reports (a build with the tests otherwise compiles them at
    # -O1, and bench_cuda's host code at -O0: cmake/kfacEngineInstances.cmake, bench/CMakeLists.txt).
    cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKFAC_ENABLE_MPI=OFF -DKFAC_ENABLE_LAPACK=OFF \
        -DKFAC_BUILD_EXAMPLES=OFF "-DCMAKE_CUDA_ARCHITECTURES=90-real;75-virtual" \
        -DKFAC_TEST_OPTIMIZATION= -DKFAC_ENGINES_OPTIMIZATION= || return 1
    local targets=(kfac_cuda_tests kfac_replay_cuda bench_cuda)
    cmake --build build-gpu --target "${targets[@]}" || return 1
    for t in "${targets[@]}"; do cp "$(find build-gpu -type f -name "$t" -perm -u+x | head -1)" "$stage/bin/"; done
    strip "$stage"/bin/*
    # Libraries outside the system and the CUDA toolkit (the GPU machine has both).
    for b in "$stage"/bin/*; do
        ldd "$b" | awk '/=> \// {print $3}' | grep -v -e '^/lib' -e '^/usr/lib' -e '/cuda' | while read -r lib; do
            cp -L "$lib" "$stage/lib/"
        done
    done
    # Header-only dependencies and their CMake packages, for configuring the LibTorch CUDA
    # programs there (paths kept relative to /usr, as the packages' configs expect).
    (cd /usr && cp -r --parents include/eigen3 share/eigen3/cmake include/catch2 lib/cmake/Catch2 lib/libCatch2WithMain.a include/xtensor \
        lib/x86_64-linux-gnu/cmake/xtensor include/xtl share/cmake/xtl include/nlohmann share/cmake/nlohmann_json \
        "$root/$stage/prefix/" 2>/dev/null)
    local peers=${KFAC_PYTORCH:-../shared/peers/kfac-pytorch}
    if [ -d "$peers/kfac" ]; then
        mkdir -p "$stage/kfac-pytorch" && cp -r "$peers/kfac" "$peers/README.md" "$stage/kfac-pytorch/"
    else
        echo "gpu_checks: no kfac-pytorch at $peers (set KFAC_PYTORCH); the side-by-side will be skipped" >&2
    fi
    tar -C "$stage" -czf "$dir/pack.tar.gz" . && rm -rf "$stage"
    # The data set as it is (already compressed), for the flagship on the GPU.
    local data=${KFAC_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
    if [ -f "$data/train-images-idx3-ubyte.gz" ]; then mkdir -p "$dir/fashion-mnist" && cp "$data"/*-ubyte.gz "$dir/fashion-mnist/"; fi
    du -sh "$dir"
}

run() {
    local out=${OUT:-$dir/results}
    mkdir -p "$out"
    local stage=$dir/unpacked
    [ -f "$dir/pack.tar.gz" ] && { rm -rf "$stage"; mkdir -p "$stage"; tar -C "$stage" -xzf "$dir/pack.tar.gz"; }
    export LD_LIBRARY_PATH="$root/$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
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
    step cuda_backend "$stage/bin/kfac_cuda_tests" -# "[#cuda_backend_test]"
    step cuda_layer_kinds "$stage/bin/kfac_cuda_tests" -# "[#cuda_layer_kinds_test]"
    for case_dir in tests/data/golden/*/; do
        for precision in double float; do
            step "replay_cuda.$(basename "$case_dir").$precision" "$stage/bin/kfac_replay_cuda" "$case_dir" "--$precision"
        done
    done
    local torch_prefix
    if torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) && command -v cmake > /dev/null; then
        step torch_cuda_configure cmake -S . -B build-torch-cuda -DCMAKE_BUILD_TYPE=Release -DKFAC_ENABLE_MPI=OFF \
            -DKFAC_ENABLE_LAPACK=OFF -DKFAC_BUILD_BENCHMARKS=OFF "-DCMAKE_PREFIX_PATH=$root/$stage/prefix;$torch_prefix" \
            -DCMAKE_CUDA_ARCHITECTURES=native
        step torch_cuda_build cmake --build build-torch-cuda --target kfac_torch_cuda_tests kfac_fashion_mnist \
            kfac_torch_transformer -j
        step torch_cuda "$(find build-torch-cuda -type f -name kfac_torch_cuda_tests | head -1)"
        local flagship
        flagship=$(find build-torch-cuda -type f -name kfac_fashion_mnist -perm -u+x | head -1)
        local data=${KFAC_FASHION_MNIST_DIR:-$dir/fashion-mnist}
        if [ -n "$flagship" ] && [ -f "$data/train-images-idx3-ubyte.gz" ]; then
            step flagship_cuda_cnn "$flagship" --device cuda --model cnn --data "$data" --csv "$out/flagship_cnn.csv" --no-plot
            step flagship_cuda_resnet "$flagship" --device cuda --model resnet --data "$data" --csv "$out/flagship_resnet.csv" \
                --no-plot
            # Mixed precision on the GPU (docs/precision.md): CUDA autocast in bf16, and in fp16
            # with the dynamic loss scaler and K-FAC's overflow skips.
            for p in bf16 fp16; do
                step "flagship_cuda_cnn_$p" "$flagship" --device cuda --model cnn --precision "$p" --data "$data" \
                    --csv "$out/flagship_cnn_$p.csv" --no-plot
            done
        fi
        local transformer
        transformer=$(find build-torch-cuda -type f -name kfac_torch_transformer -perm -u+x | head -1)
        [ -n "$transformer" ] && step transformer_cuda "$transformer" --device cuda --expect-accuracy 0.9
    else
        echo "=== LibTorch CUDA programs: no Python torch or no CMake here; skipped"
    fi
    step bench_cuda "$stage/bin/bench_cuda" --model bench/models/resnet32_cifar10.txt --model bench/models/resnet50_imagenet.txt \
        --model bench/models/bert_base_stack.txt --model bench/models/mobilenet_v1.txt --iterations 5
    if [ -d "$stage/kfac-pytorch/kfac" ]; then
        step side_by_side python3 bench/side_by_side_gpu.py --bench-cuda "$stage/bin/bench_cuda" \
            --kfac-pytorch "$stage/kfac-pytorch" --iterations 5 --json "$out/side_by_side.json"
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
