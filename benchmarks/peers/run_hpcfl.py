"""hpcfl's side of the peers harness: the bundle's FedAvg experiment through ``hpcfl run``, as a user runs it.

    PYTHONPATH=. python benchmarks/peers/run_hpcfl.py --seed 0 --mode 1proc --out bench-out/peers/h.json

The config (written beside the record) uses hpcfl's plug-in route to train on the bundle itself:
``imports: [hpcfl_bundle]``, ``dataset: peers-bundle`` with ``data_root`` the bundle, ``partition:
natural`` (the bundle's 100 client lists); ``clients_per_round: 10`` makes hpcfl draw its own
participants, which are the bundle's ``draws.json`` (experiment.py wrote hpcfl's draw): every metrics
row's ``participants`` is checked against it, and a mismatch fails the run.

Timing, from the run's own output: the progress bar (tqdm on stderr, one update per round, after the
round's bookkeeping) is read as it is printed and time-stamped here; its first print (``0/R``) is the
start of round 1 (``startup_s``: this script's start to then, so the ``hpcfl`` process's start, its
imports, the data and the setup are in it) and each later one ends a round (``round_eval_s``). On
an evaluated round, ``metrics.jsonl``'s ``eval_s`` (the server step, the evaluation and the row's
other work) is taken off to give ``round_s`` (train + aggregation), as the peers time it. The
stamps are taken when this process reads the bar: on an idle machine within milliseconds; on a
loaded one they lag while it waits for a core (a smoke run at load 14 on 2 cores gave one round of
0.16 s beside rounds of 0.6-1.6 s), so only the idle run's figures are quoted.

``--algorithm fedadam | fedyogi | fedadagrad | fedavgm`` (issue 60, item 5) runs hpcfl's server
optimiser of that name at Flower 1.42's defaults, in hpcfl's keys (:data:`FLOWER_DEFAULTS`, the
table of ``server_opt_check.py``, whose unit check feeds the same client models to both server
steps and finds them equal): FedAdam η 0.1, β1 0.9, β2 0.99, τ 1e-3; FedYogi η 0.01, β1 0.9,
β2 0.99, τ 1e-3; FedAdagrad η 0.1, β1 0 (Flower's has no first moment), τ 1e-3; FedAvgM η 1,
momentum 0 (Flower's default: FedAvg's step). Flower's ``eta_l`` (0.1 for FedAdam and FedAdagrad,
0.0316 for FedYogi) is stored by its strategies and never sent to a client: both sides train with
the bundle's lr. What hpcfl cannot match by a parameter (:data:`DIFFERENCES`): its adaptive
methods start the second moment at v₋₁ = τ² (Reddi et al.'s Algorithm 2; Flower: 0), and its
FedAdam takes no bias correction (Flower's: η·√(1 − β2^(t+1))/(1 − β1^(t+1)) in round t).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import peer_common as pc  # noqa: E402  (first: the script's start time)
from server_opt_check import CASES  # noqa: E402  (Flower's defaults in hpcfl's keys)

MODES = {
    "1proc": "hpcfl run, 1 process",
    "mpi2": "mpiexec -n 2 hpcfl run (2 MPI ranks x 1 thread)",
    "batch-auto": "hpcfl run, 1 process, client_batch auto",
    "batch-10": "hpcfl run, 1 process, client_batch 10 (the round's clients as one vectorised step)",
    "threads2": "hpcfl run, 1 process, client_threads 2 (2 clients at once, 1 torch thread each)",
    "cuda": "hpcfl run, 1 process, 1 GPU, client_batch 1",
    "cuda-auto": "hpcfl run, 1 process, 1 GPU, client_batch auto",
}
CLIENT_BATCH = {
    "1proc": "1",
    "mpi2": "1",
    "batch-auto": "auto",
    "batch-10": "10",
    "threads2": "1",
    "cuda": "1",
    "cuda-auto": "auto",
}
ALGORITHMS = ("fedavg", "fedadam", "fedyogi", "fedadagrad", "fedavgm")
#: algorithm -> the ``params`` hpcfl runs it with: Flower 1.42's defaults for the server optimisers
#: (server_opt_check.CASES: ``fedavgm_default`` is Flower's FedAvgM, momentum 0)
FLOWER_DEFAULTS: dict[str, dict[str, float]] = {
    "fedadam": CASES["fedadam"][3],
    "fedyogi": CASES["fedyogi"][3],
    "fedadagrad": CASES["fedadagrad"][3],
    "fedavgm": CASES["fedavgm_default"][3],
}
#: what hpcfl's server step does differently from Flower's at the same parameters
DIFFERENCES = {
    "fedadam": "v starts at tau^2 (Flower: 0); no bias correction (Flower: eta*sqrt(1-beta2^(t+1))/(1-beta1^(t+1)))",
    "fedyogi": "v starts at tau^2 (Flower: 0)",
    "fedadagrad": "v starts at tau^2 (Flower: 0)",
    "fedavgm": "none at momentum 0 (the step is FedAvg's on both sides)",
}
REPO = pc.HERE.parent.parent
_BAR = re.compile(r"\b(\d+)/(\d+) \[")  # tqdm's "  4/50 [00:12<..." (the rounds done)


def algorithm_params(algorithm: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The config's ``params``: FedAvg's weighting from the bundle; a server optimiser's Flower
    defaults (hpcfl's server optimisers average the uploads by samples, as Flower's strategies)."""
    if algorithm == "fedavg":
        return {"weighting": spec["weighting"]}
    if spec["weighting"] != "samples":
        raise ValueError(f"{algorithm} averages by samples; the bundle asks {spec['weighting']!r}")
    return dict(FLOWER_DEFAULTS[algorithm])


def hpcfl_config(
    exp_dir: Path, spec: dict[str, Any], seed: int, rounds: int, mode: str, algorithm: str = "fedavg"
) -> dict[str, Any]:
    """The ``hpcfl run`` config of the experiment: the bundle's spec, in hpcfl's keys."""
    return {
        "name": f"peers-{mode}-{seed}" if algorithm == "fedavg" else f"peers-{algorithm}-{mode}-{seed}",
        "imports": ["hpcfl_bundle"],
        "dataset": "peers-bundle",
        "data_root": str(exp_dir.resolve()),
        "download": False,
        "partition": "natural",
        "num_clients": int(spec["num_clients"]),
        "model": spec["model"],
        "algorithm": algorithm,
        "params": algorithm_params(algorithm, spec),
        "rounds": rounds,
        "local_epochs": int(spec["local_epochs"]),
        "batch_size": int(spec["batch_size"]),
        "lr": float(spec["lr"]),
        "momentum": float(spec["momentum"]),
        "weight_decay": float(spec["weight_decay"]),
        "drop_last": bool(spec["drop_last"]),
        "eval_every": int(spec["eval_every"]),
        "clients_per_round": int(spec["clients_per_round"]),
        "seed": seed,
        "device": "cuda" if mode.startswith("cuda") else "cpu",
        "client_batch": CLIENT_BATCH[mode],
        "client_threads": 2 if mode == "threads2" else 1,
        # the peers keep no checkpoint: one at the end (hpcfl's default is every round)
        "checkpoint_every": rounds,
        "progress": True,  # its per-round updates are the timing read here
    }


def hpcfl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("hpcfl")
    except PackageNotFoundError:
        v = "unknown"
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "--", "hpcfl"]).returncode != 0
        return f"{v}+{commit}{'-dirty' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        return v


def command(mode: str, config: Path, run_dir: Path) -> list[str]:
    hpcfl = [sys.executable, "-m", "hpcfl", "run", str(config), "--run-dir", str(run_dir), "--overwrite"]
    if mode == "mpi2":
        mpiexec = Path(sys.executable).with_name("mpiexec")
        return [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", "2", *hpcfl]
    return hpcfl


def watch_progress(proc: subprocess.Popen[bytes], log: Path) -> tuple[dict[int, float], str]:
    """Time-stamp each progress-bar print of ``proc``'s stderr (rounds done → perf_counter); the
    whole stderr goes to ``log``. Returns (stamps, the last non-bar line: the error line if any)."""
    stamps: dict[int, float] = {}
    last_line, pending = "", b""
    assert proc.stderr is not None
    with open(log, "wb") as out:
        while chunk := proc.stderr.read1(4096):  # type: ignore[attr-defined]
            now = time.perf_counter()
            out.write(chunk)
            pending += chunk
            *pieces, pending = re.split(rb"[\r\n]", pending)
            # tqdm writes "\r" + the bar and flushes: the piece still pending is a whole bar already
            for piece in [*pieces, pending]:
                text = piece.decode(errors="replace").strip()
                if (m := _BAR.search(text)) is not None:
                    stamps.setdefault(int(m.group(1)), now)
                elif text and piece is not pending:
                    last_line = text
    return stamps, last_line


def run(args: Any, exp: pc.Experiment, rec: pc.Recorder, info: dict[str, Any]) -> None:
    info["version"] = hpcfl_version()
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds
    cfg = hpcfl_config(Path(args.experiment), exp.spec, args.seed, rounds, args.mode, args.algorithm)
    if args.algorithm != "fedavg":
        info["server_params"] = cfg["params"]
    config = work / "config.yaml"
    config.write_text(json.dumps(cfg, indent=1) + "\n")  # JSON is YAML
    run_dir = work / "run"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(pc.HERE), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.setdefault("HPCFL_DATA", str(REPO.parent / "shared" / "datasets"))
    proc = subprocess.Popen(
        command(args.mode, config, run_dir), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env
    )
    stamps, last = watch_progress(proc, work / "stderr.log")
    if proc.wait() != 0:
        raise RuntimeError(f"hpcfl run exited {proc.returncode}: {last}")
    rows = {int(r["round"]): r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    missing = [n for n in range(rounds + 1) if n not in stamps]
    if missing:
        raise RuntimeError(f"the progress bar skipped rounds {missing[:5]} (see {work / 'stderr.log'})")
    rec.startup_s = stamps[0] - rec.start
    for r in range(1, rounds + 1):
        span = stamps[r] - stamps[r - 1]
        row = rows.get(r)
        rec.round_s.append(span - float(row["eval_s"]) if row else span)
        rec.round_eval_s.append(span)
        draw = exp.draw(args.seed, r)
        rec.samples_per_round.append(sum(len(exp.clients[k]) for k in draw))
        if row is not None:
            if sorted(row["participants"]) != draw:
                raise RuntimeError(f"round {r}: hpcfl trained {row['participants']}, draws.json says {draw}")
            rec.evaluated(r, row["test_accuracy"], row["test_loss"])
    used = json.loads((run_dir / "determinism.json").read_text())
    info["notes"] = (
        f"hpcfl's own draw checked against draws.json on every evaluated round; torch threads per rank "
        f"{used.get('threads_per_rank')}, client_batch used {used.get('client_batch_used')}, client_threads "
        f"{used.get('client_threads', 1)}; a checkpoint "
        "only after the last round (hpcfl's default: every round)"
    )
    if args.algorithm != "fedavg":
        info["notes"] += (
            f"; {args.algorithm} at Flower 1.42's defaults {cfg['params']}, differences: "
            f"{DIFFERENCES[args.algorithm]}"
        )


if __name__ == "__main__":
    sys.exit(pc.main(MODES, run, "hpcfl", algorithms=ALGORITHMS))
