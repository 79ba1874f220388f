"""``python killed.py RUNS.json OUT ROWS``: each run of RUNS.json ({run name: config path}) as
``hpcfl run CONFIG --run-dir OUT/<name>`` in a forked child that SIGKILLs itself right after
writing its ROWS-th metrics row (so the kill lands between that round's client-state writes and the
checkpoint that would cover them). The parent does no tensor work (children fork a clean torch) and
prints ``{name: how the child ended}`` as JSON ("killed" when it died by SIGKILL as planned)."""

import json
import os
import signal
import sys
from pathlib import Path

import hpcfl.runner.experiment as experiment
from hpcfl.cli.main import main

runs, out, rows = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), int(sys.argv[3])


def child(config: str, run_dir: Path) -> None:
    written = []
    append = experiment.append_jsonl

    def append_then_die(path, row):  # noqa: ANN001, ANN202 - the patched module function
        append(path, row)
        if Path(path).name == "metrics.jsonl":  # not client_metrics.jsonl (client_eval)
            written.append(row)
        if len(written) >= rows:
            os.kill(os.getpid(), signal.SIGKILL)

    experiment.append_jsonl = append_then_die
    os._exit(main(["run", config, "--run-dir", str(run_dir)]))


ends = {}
for name, config in runs.items():
    pid = os.fork()
    if pid == 0:
        child(config, out / name)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        ends[name] = "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
    else:
        ends[name] = f"exit {os.WEXITSTATUS(status)}"
print(json.dumps(ends), flush=True)
