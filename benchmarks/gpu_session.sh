#!/usr/bin/env bash
# The GPU checks and figures of one lent-GPU session, in one device call (device time is short).
#
#   bash benchmarks/gpu_session.sh wheels     # HERE, online: the wheels the GPU image lacks -> .whl/,
#                                             # Fashion-MNIST -> .data/ (carry [".whl", ".data"])
#   bash benchmarks/gpu_session.sh run [STEPS]  # THERE; STEPS: any of "tests entk round batched" (default all,
#                                             # in one call; split them when a call would pass 600 s)
#   bash benchmarks/gpu_session.sh run        # THERE (device run, carry [".whl"]): tests + figures,
#                                             # benchmarks/out/gpu_session/ (+ $OUT/gpu_session.tgz)
#
# The GPU image has its own PyTorch, Triton, mpi4py, numpy, matplotlib, pyyaml and tqdm, and no
# package registry; what hpcfl needs beyond them travels as cp312 manylinux wheels. `run` installs
# them under /tmp/site, installs hpcfl with --no-deps, then (each step logged to $OUT/gpu_session.log,
# a failing step does not stop the next):
#   1. pytest -m gpu: compiled Triton gathers vs references (every dtype), CKA kernel forward and
#      gradients on CUDA, fused eNTK on CUDA vs the CPU reference, FedAvg cuda vs cpu, MPIComm on
#      CUDA tensors, batched clients on CUDA;
#   2. hpcfl bench entk --device cuda: resnet18 (CIFAR shape, p = 100,000; Opacus beside it when its
#      wheel came along), simplecnn at batch 256, vgg11;
#   3. benchmarks/round_throughput.py --device cuda: hpcfl (one by one, and client_batch auto) vs a
#      plain PyTorch loop on the same GPU, 10 and 100 clients (target >= 0.95x);
#   4. benchmarks/batched_clients.py --device cuda (issue 15's >= 5x target at 100 clients).
set -uo pipefail
cd "$(dirname "$0")/.."

wheels() {
    # zarr 3 (the version CI installs) and what it needs beyond the image; submitit (hpcfl submit); mpich (a launcher for the
    # MPIComm test; the image's mpi4py may be built against another MPI); opacus (the eNTK baseline).
    local platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl zarr==3.1.6 numcodecs==0.16.6 donfig google-crc32c submitit mpich opacus
    grep -qxF '/.data/' "$exclude" 2>/dev/null || echo '/.data/' >>"$exclude"
    mkdir -p .data && cp -r "${HPCFL_DATA:-../shared/datasets}/fashion-mnist" .data/
    du -sh .whl .data
}

run() {
    # Outputs gather in one folder; under the device tool ($OUT set) they go back as ONE archive,
    # since only 8 files come back from $OUT.
    local out=benchmarks/out/gpu_session
    mkdir -p "$out"
    [ -n "${OUT:-}" ] && trap 'tar czf "$OUT/gpu_session.tgz" -C "$out" . && cp "$out/gpu_session.log" "$OUT/"' EXIT
    exec > >(tee "$out/gpu_session.log") 2>&1
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
        export PATH=/tmp/site/bin:$PATH  # mpich's mpiexec
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
    export PYTHONUNBUFFERED=1 HPCFL_DATA=${HPCFL_DATA:-.data}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

    local steps=${1:-tests entk round batched}

    [[ " $steps " == *" tests "* ]] && echo "== 1. pytest -m gpu (+ the CUDA-aware CKA and Triton gather tests)" &&
    python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" \
        tests/test_gpu.py tests/test_cka.py tests/test_triton_kernels.py tests/test_batched_clients.py \
        --junitxml "$out/pytest_gpu.xml"

    [[ " $steps " == *" entk "* ]] && echo "== 2. eNTK throughput on the GPU" &&
    for spec in "resnet18 256" "simplecnn 256" "vgg11 256"; do
        set -- $spec
        python3 -m hpcfl bench entk --device cuda --model "$1" --batch "$2" --p 100000 \
            --out "$out/entk_$1_cuda"
    done

    [[ " $steps " == *" round "* ]] && echo "== 3. FedAvg round throughput on the GPU vs a plain loop" &&
    python3 benchmarks/round_throughput.py --device cuda --clients 10 100 --rounds 3 \
        --out "$out/round_throughput_cuda"

    [[ " $steps " == *" batched "* ]] && echo "== 4. batched clients on the GPU" &&
    python3 benchmarks/batched_clients.py --device cuda --models simplecnn resnet8 \
        --clients 10 100 1000 --repeats 3 --out "$out/batched_clients_cuda"
}

case "${1:-}" in
wheels) wheels ;;
run) run "${*:2}" ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh wheels|run" >&2
    exit 2
    ;;
esac
