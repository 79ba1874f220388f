#!/usr/bin/env bash
# The GPU checks and figures of one lent-GPU session, in ONE device call (device time is 15 minutes
# a session, a machine's start included, so a call must not be wasted).
#
#   bash benchmarks/gpu_session.sh wheels    # HERE, online: wheels the GPU image lacks -> .whl/,
#                                            # Fashion-MNIST -> .data/ (then carry [".whl", ".data"])
#   bash benchmarks/gpu_session.sh dry       # HERE, on the CPU: every step's command line parsed by
#                                            # its own parser, the tests collected, the wheels and data
#                                            # present; exit 1 on the first problem (run it before a call)
#   bash benchmarks/gpu_session.sh run [STEP ...]  # THERE: the steps (default all, in the order below)
#
# `run` installs the carried wheels under /tmp/site and hpcfl with --no-deps (the image has its own
# PyTorch and Triton), then runs the steps in PRIORITY order, each under its own `timeout` and all
# under one budget (GPU_SESSION_BUDGET seconds, default 480 = 8 minutes): a step that cannot get its
# minimum time in what is left is skipped, and says so. After EVERY step the whole output folder is
# archived to $OUT/gpu_session.tgz and the log copied to $OUT/gpu_session.log (only 8 files come back
# from a device call, and what is under $OUT comes back even when the call is killed), so a call cut
# short still returns every finished step.
#
# Steps (name: what; timeout / minimum seconds):
#   tests       pytest -m gpu (compiled Triton gathers, CKA kernel, fused eNTK vs CPU reference,
#               CUDA-vs-CPU runs of FedAvg, SCAFFOLD, FedPVR, FedDyn, NTK-FL, DP-SGD, TCT) + the
#               eNTK layer forms on CUDA (test_entk_forms: fixed and autotuned gathers) + the
#               CKA/Triton test files on CUDA + the fused eNTK's CUDA-graph replay (test_entk_cuda_graph:
#               replay equals eager on simplecnn/resnet18-GN/vgg11, fallback on a host sync, no host
#               sync in the fused batch, autotune never under capture) + the native CPU eNTK kernel
#               on the GPU host's CPU (test_entk_native: a second CPU model; skips without AVX-512/cc)
#   checkpoint  a tiny device: cuda run (tests/fixtures/cuda_checkpoint.yaml) whose checkpoint files
#               are written again from CUDA tensors (hpcfl itself now writes host copies) by
#               tests/fixtures/make_checkpoint_cuda.py; the run directory is the CPU suite's fixture
#               tests/fixtures/checkpoint_cuda/
#   entk18      hpcfl bench entk, resnet18-GN CIFAR shape, p = 1e5, B = 256: fused, vmap, Opacus
#   layercosts  benchmarks/entk_layer_costs.py: every Linear/Conv2d weight of simplecnn, resnet8-GN,
#               resnet18-GN, vgg11 (B = 256, p = 1e5) by the gather kernels and by materialising
#               (one batched product, then a pick), do_bench-timed; fits the eNTK cost model's
#               CUDA constants (paste the printed dict into CUDA_COSTS in hpcfl/entk/costs.py); the
#               steps after it use the fit through HPCFL_ENTK_COSTS (hpcfl/entk/costs.py)
#   main        the README's main job (TCT vs FedAvg on Fashion-MNIST) with device=cuda, timed
#   round       FedAvg round throughput at the default client_batch (auto) vs one by one vs a plain
#               loop, K = 10, 100, 1000
#   batched     benchmarks/batched_clients.py: groups vs one by one, simplecnn and resnet8
#   perdevice   benchmarks/clients_per_device.py: peak GPU memory of one vectorised group of N =
#               1, 64, 256, 1024 clients (simplecnn, resnet8), the memory per client (slope), what
#               client_batch: auto picks, and how many clients fit at once (FedScale: ~19 per GPU)
#   entk        hpcfl bench entk, fused and fused-graph (fused with its full batches replayed as one
#               CUDA graph, hpcfl/entk/cuda_graph.py) vs Opacus hooks (its fastest eNTK mode on this
#               GPU: functorch was half as fast on resnet18 and simplecnn; vmap far slower),
#               simplecnn, resnet8-GN, vgg11, resnet18-GN (simplecnn first: the host-bound model
#               the graph is for), the fitted CUDA constants of hpcfl/entk/costs.py; every method
#               timed --in-process (one CUDA start-up per model, not per method and round: ~80 s of
#               session 2's 260 s step), each model its own command, so one crash loses one model
#   profile     the fused eNTK batch's kernels (torch.profiler) beside plain training's: what a
#               per-layer GPU cost model is fitted from
#   dp          DP-SGD vs Opacus (hooks and ghost clipping) and non-private, simplecnn and resnet8-GN
#   text        benchmarks/text_per_sample.py: char-transformer and char-lstm at batch 10 and 64, eNTK
#               features (hpcfl fused / the LSTM's loop fallback vs torch.func vmap, in-process) and
#               the DP-SGD step (hpcfl vs Opacus hooks and ghost clipping, DPLSTM for the LSTM)
#   stage2      TCT stage 2's closed form on the GPU vs the same machine's CPU at n_k = 6,000,
#               p = 100,000, M = 500 (the CPU run: one timed round, its primal extrapolated from 3
#               steps; session 2's CPU run without that bound did not reach its timed round in 90 s)
#   peers       the peers harness's experiment (benchmarks/peers: FedAvg, Fashion-MNIST dir:0.5, 100
#               clients, 10 a round, 50 rounds, seed 0) through `hpcfl run` on the GPU, client_batch 1
#               and auto -> peers_cuda.{json,csv,md,png}; hpcfl only: the peers' own environments
#               (Flower with Ray, ...) are built on this CPU machine and cannot be carried to the GPU
#   frameworks  BlazeFL's/Flower's published setup (100 clients x 500, 5 epochs, batch 50; CNN, ResNet-18)
#   tcttable    TCT's Fashion-MNIST Table 2 at the largest budget that fits a step (not the paper's 200
#               rounds x 5 epochs, p = 1e5): #C = 1 and #C = 2, SimpleCNN, 10 clients, 20 rounds x 1
#               epoch (TCT 10 + 10, p = 20,000), lr 0.05 fixed, one seed, two runs at a time; runs
#               are resumable, so a step cut short keeps its finished runs
#   gathertune  layercosts again with the gathers launched through triton.autotune (tile sizes per
#               shape; off by default until this step shows it pays): simplecnn, resnet18, vgg11
#   shakespeare LEAF's Shakespeare at FedProx's budget (issue 62; not in the default list: name it):
#               LEAF's LSTM (char-lstm, ~818k parameters), FedAvg, FedProx (mu 0.001) and TCT on
#               LEAF's current split (temporal, role window), 143 roles drawn at random (FedProx's
#               count), 40 rounds x 10 clients x 20 local epochs, batch 10, lr 0.8 (LEAF's), one
#               seed, each run tested on its roles' test shares every 5 rounds. Hours of GPU time,
#               so it is RESUMABLE across device windows: runs checkpoint every round and are
#               resumed when unfinished; after the step $OUT/shakespeare_runs.tgz holds the run
#               directories with each run's latest checkpoint. Next window: extract it here into
#               benchmarks/out/gpu_session/ and carry ["benchmarks/out/gpu_session/shakespeare"]
set -uo pipefail
cd "$(dirname "$0")/.."

OUTDIR=benchmarks/out/gpu_session
STEPS_ALL=(tests entk stage2 tcttable batched perdevice gathertune layercosts checkpoint entk18 main round profile dp text peers frameworks)
STEPS_NAMED=(shakespeare) # run only when named: `run shakespeare`

# Each step: "timeout min_seconds" then the command (one line; $OUTDIR expanded when it runs).
declare -A LIMIT=(
    [tests]="200 60" [checkpoint]="60 20" [entk18]="90 40" [layercosts]="120 30" [main]="120 60" [round]="120 50"
    [batched]="120 40" [perdevice]="120 40" [entk]="200 40" [profile]="45 20" [dp]="90 40" [text]="180 60" [stage2]="120 40" [frameworks]="150 60" [gathertune]="90 30"
    [tcttable]="200 90" [shakespeare]="570 120" [peers]="150 60"
)
declare -A CMD=(
    [tests]="python3 -m pytest -q -p no:cacheprovider -m 'gpu or not slow' tests/test_gpu.py tests/test_checkpoint_devices.py tests/test_cka.py tests/test_triton_kernels.py tests/test_fake_accelerator.py tests/test_entk_forms.py tests/test_entk_native.py tests/test_entk_cuda_graph.py --junitxml $OUTDIR/pytest_gpu.xml"
    [checkpoint]="python3 tests/fixtures/make_checkpoint_cuda.py $OUTDIR/checkpoint_cuda"
    [entk18]="python3 -m hpcfl bench entk --device cuda --model resnet18 --batch 256 --p 100000 --methods vmap,fused,opacus,opacus-functorch --rounds 2 --repeats 5 --out $OUTDIR/entk_resnet18_cuda"
    [layercosts]="python3 benchmarks/entk_layer_costs.py --device cuda --models simplecnn resnet8 resnet18 vgg11 --batch 256 --p 100000 --out $OUTDIR/entk_layer_costs_cuda"
    [main]="python3 -m hpcfl compare --set device=cuda --out $OUTDIR/compare_cuda"
    [round]="python3 benchmarks/round_throughput.py --device cuda --clients 10 100 1000 --rounds 2 --out $OUTDIR/round_throughput_cuda"
    [batched]="python3 benchmarks/batched_clients.py --device cuda --models resnet8 simplecnn --clients 100 1000 --batches all auto --repeats 3 --no-yardstick --out $OUTDIR/batched_clients_cuda"
    [entk]="python3 -m hpcfl bench entk --device cuda --model simplecnn --batch 256 --p 100000 --methods fused,fused-graph,opacus --rounds 2 --repeats 5 --in-process --out $OUTDIR/entk_simplecnn_cuda ; python3 -m hpcfl bench entk --device cuda --model resnet8 --norm gn --batch 256 --p 100000 --methods fused,fused-graph,opacus --rounds 2 --repeats 5 --in-process --out $OUTDIR/entk_resnet8_cuda ; python3 -m hpcfl bench entk --device cuda --model vgg11 --batch 256 --p 100000 --methods fused,fused-graph,opacus --rounds 2 --repeats 5 --in-process --out $OUTDIR/entk_vgg11_cuda ; python3 -m hpcfl bench entk --device cuda --model resnet18 --batch 256 --p 100000 --methods fused,fused-graph,opacus --rounds 2 --repeats 5 --in-process --out $OUTDIR/entk_resnet18_cuda"
    [perdevice]="python3 benchmarks/clients_per_device.py --device cuda --groups 1 64 256 1024 --out $OUTDIR/clients_per_device_cuda"
    [profile]="python3 benchmarks/entk_profile.py --device cuda --models simplecnn resnet8 vgg11 --out $OUTDIR/entk_profile_cuda"
    [dp]="python3 benchmarks/privacy.py --parts throughput --device cuda --allocators default --sessions 1 --threads 4 --steps 40 --models simplecnn resnet8-gn --out $OUTDIR/privacy_cuda"
    [text]="python3 benchmarks/text_per_sample.py --device cuda --in-process --sessions 1 --threads 4 --rounds 2 --out $OUTDIR/text_per_sample_cuda"
    [stage2]="python3 benchmarks/stage2_solver.py --device cuda --n 6000 --p 100000 --classes 10 --local-steps 500 --out $OUTDIR/stage2_cuda && python3 benchmarks/stage2_solver.py --device cpu --n 6000 --p 100000 --classes 10 --local-steps 500 --rounds 1 --check-rounds 1 --check-steps 2 --max-primal-seconds 5 --out $OUTDIR/stage2_cpu_of_gpu_host"
    [gathertune]="python3 benchmarks/entk_layer_costs.py --device cuda --autotune --models simplecnn resnet18 vgg11 --batch 256 --p 100000 --out $OUTDIR/entk_layer_costs_cuda"
    [tcttable]="python3 benchmarks/tct_fmnist_table.py --device cuda --jobs 2 --partitions classes:1 classes:2 --seeds 1 --lrs 0.05 --rounds 20 --local-steps 0 --local-epochs 1 --p 20000 --no-figure3 --out $OUTDIR/tct_fmnist --results $OUTDIR/tct_fmnist_results"
    [shakespeare]="python3 benchmarks/shakespeare_table.py --device cuda --model char-lstm --rows fedavg fedprox tct --split temporal --window role --sample-roles 143 --test-samples 0 --clients 143 --clients-per-round 10 --rounds 40 --local-epochs 20 --batch 10 --lrs 0.8 --validation 0 --seeds 1 --last 3 --eval-every 5 --jobs 1 --threads 4 --out $OUTDIR/shakespeare --results $OUTDIR/shakespeare_results --stem shakespeare_fedprox_budget"
    [peers]="python3 benchmarks/peers/harness.py --device cuda --seeds 0 --out $OUTDIR/peers_cuda"
    [frameworks]="python3 benchmarks/fl_frameworks_setup.py --device cuda --models simplecnn resnet18 --batches auto --out $OUTDIR/fl_frameworks_setup_cuda"
)

wheels() {
    # zarr 3 (what CI installs) and what it needs beyond the image; submitit (hpcfl submit); mpich (a
    # launcher for the MPIComm test); opacus (the eNTK and DP-SGD baseline).
    local platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl zarr==3.1.6 numcodecs==0.16.6 donfig google-crc32c submitit mpich opacus || return 1
    grep -qxF '/.data/' "$exclude" 2>/dev/null || echo '/.data/' >>"$exclude"
    mkdir -p .data && cp -r "${HPCFL_DATA:-../shared/datasets}/fashion-mnist" .data/
    cp -r "${HPCFL_DATA:-../shared/datasets}/shakespeare" .data/ # the step `shakespeare` (5 MB)
    du -sh .whl .data
}

dry() {
    # Everything a call needs, checked on the CPU: syntax, wheels, data, every step's arguments
    # through its own parser (benchmarks/_dry_parse.py), the tests' collection.
    # the project's venv where there is one (the system python3 has no hpcfl); $PYTHON overrides
    local default=python3
    [ -x .venv/bin/python ] && default=.venv/bin/python
    local py=${PYTHON:-$default} failed=0
    bash -n "$0" || return 1
    for w in zarr numcodecs donfig google_crc32c submitit mpich opacus; do
        compgen -G ".whl/${w}-*.whl" >/dev/null || { echo "dry: no .whl/${w}-*.whl (run: $0 wheels)"; failed=1; }
    done
    [ -f .data/fashion-mnist/train-images-idx3-ubyte.gz ] || [ -f .data/fashion-mnist/train-images-idx3-ubyte ] ||
        { echo "dry: no .data/fashion-mnist (run: $0 wheels)"; failed=1; }
    [ -f .data/shakespeare/shakespeare-0.6.tar.gz ] ||
        { echo "dry: no .data/shakespeare (run: $0 wheels)"; failed=1; }
    for step in "${STEPS_ALL[@]}" "${STEPS_NAMED[@]}"; do
        local part
        while IFS= read -r part; do
            eval "words=($part)"
            [ "${words[0]}" = python3 ] || { echo "dry: $step: not a python3 command: $part"; failed=1; continue; }
            if [ "${words[1]}" = -m ] && [ "${words[2]}" = pytest ]; then
                "$py" -m pytest --collect-only -p no:cacheprovider "${words[@]:3}" >/tmp/gpu_session_dry.log 2>&1 ||
                    { echo "dry: $step: pytest collection failed"; tail -5 /tmp/gpu_session_dry.log; failed=1; continue; }
                echo "dry: $step: $(grep -E 'collected|selected' /tmp/gpu_session_dry.log | tail -1)"
            else
                "$py" benchmarks/_dry_parse.py "${words[@]:1}" || { echo "dry: $step: FAILED: $part"; failed=1; }
            fi
        done < <(echo "${CMD[$step]}" | sed -e 's/ && /\n/g' -e 's/ ; /\n/g')
    done
    [ -f tests/fixtures/cuda_checkpoint.yaml ] || { echo "dry: no tests/fixtures/cuda_checkpoint.yaml"; failed=1; }
    [ $failed = 0 ] && echo "dry: every step's command line is accepted" || echo "dry: FIX the lines above"
    return $failed
}

shakespeare_archive() {
    # The step's run directories with each run's LATEST checkpoint only (the next device window
    # resumes from it), as $OUT/shakespeare_runs.tgz; TCT's feature stores (*.zarr, gigabytes) are
    # left out: a resumed stage 2 extracts them again (hpcfl.tct.features.ensure_store).
    [ -n "${OUT:-}" ] && [ -d "$OUTDIR/shakespeare" ] || return 0
    (cd "$OUTDIR" && {
        find shakespeare \( -path '*/checkpoints/round_*' -o -name '*.zarr' \) -prune -o -type f -print
        find shakespeare -type d -name checkpoints | while IFS= read -r c; do
            last=$(find "$c" -maxdepth 1 -type d -name 'round_*' | sort | tail -1)
            [ -n "$last" ] && find "$last" -type f
        done
    } | tar czf "$OUT/shakespeare_runs.tgz.part" -T - 2>/dev/null) &&
        mv "$OUT/shakespeare_runs.tgz.part" "$OUT/shakespeare_runs.tgz"
}

archive() {
    [ -n "${OUT:-}" ] || return 0
    # the figures and records only (a run's feature store or checkpoints would pass the 16 MB a file)
    (cd "$OUTDIR" && find . -type f -size -2M -not -path '*.zarr/*' -not -name '*.pt' -print0 |
        tar czf "$OUT/gpu_session.tgz.part" --null -T - checkpoint_cuda 2>/dev/null)
    mv "$OUT/gpu_session.tgz.part" "$OUT/gpu_session.tgz"
    cp "$OUTDIR/gpu_session.log" "$OUT/gpu_session.log"
}

run() {
    mkdir -p "$OUTDIR"
    exec > >(tee "$OUTDIR/gpu_session.log") 2>&1
    local budget=${GPU_SESSION_BUDGET:-480}
    local deadline=$((SECONDS + budget))
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || { echo "wheels did not install"; archive; exit 1; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        export PATH=/tmp/site/bin:$PATH # mpich's mpiexec
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e . ||
        echo "hpcfl did not install as a package: imported from the checkout (PYTHONPATH) instead"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1 HPCFL_DATA=${HPCFL_DATA:-$PWD/.data}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    local steps=("$@")
    [ ${#steps[@]} -gt 0 ] || steps=("${STEPS_ALL[@]}")
    for step in "${steps[@]}"; do
        [ -n "${CMD[$step]:-}" ] || { echo "== $step: no such step (${STEPS_ALL[*]} ${STEPS_NAMED[*]})"; continue; }
        read -r limit minimum <<<"${LIMIT[$step]}"
        local left=$((deadline - SECONDS))
        if [ $left -lt "$minimum" ]; then
            echo "== $step: SKIPPED ($left s left of the budget, it needs $minimum)"
            continue
        fi
        [ $left -lt "$limit" ] && limit=$left
        echo "== $step (at most $limit s): ${CMD[$step]}"
        local t0=$SECONDS
        timeout --kill-after=5 "$limit" bash -c "${CMD[$step]}"
        echo "== $step: exit $? after $((SECONDS - t0)) s ($((deadline - SECONDS)) s of the budget left)"
        local fit=$OUTDIR/entk_layer_costs_cuda/entk_layer_costs_cuda.json
        if [ "$step" = layercosts ] && grep -q '"fitted": {' "$fit" 2>/dev/null; then
            export HPCFL_ENTK_COSTS=$PWD/$fit
            echo "== the steps after it use the fitted eNTK layer-form constants: HPCFL_ENTK_COSTS=$HPCFL_ENTK_COSTS"
        fi
        [ "$step" = shakespeare ] && shakespeare_archive
        archive
    done
    echo "== done after $SECONDS s"
    archive
}

case "${1:-}" in
wheels) wheels ;;
dry) dry ;;
run) run "${@:2}" ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh wheels | dry | run [STEP ...]   (steps: ${STEPS_ALL[*]} ${STEPS_NAMED[*]})" >&2
    exit 2
    ;;
esac
