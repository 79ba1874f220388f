"""Every benchmark figure names the machine it was measured on (issue 66).

A ratio from an AVX-512 EPYC and one from an AVX2 Xeon are different facts, so each JSON a
benchmark writes carries ``machine`` (CPU model, vector extensions, cores, torch, threads) and each
CSV row the same columns. The static check keeps new benchmarks from forgetting it.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import torch

from hpcfl.bench.machine import (
    VECTOR_EXTENSIONS,
    csv_with_machine,
    machine_record,
    stamp_csv,
    with_machine,
    with_machine_columns,
)

REPO = Path(__file__).resolve().parents[1]

DERIVED_ONLY = {
    "fedcka_similarity.py": "re-tabulates a run's CKA rows; it measures nothing on this machine",
    "experiment.py": "writes the peers' data bundle, not a figure",
    "peer_common.py": "runs in the peers' own venvs (no hpcfl there); harness.py adds the machine record",
    "run_hpcfl.py": "writes one run's record through peer_common; harness.py adds the machine record",
}
"""Benchmark scripts that write files without a machine record, and why."""


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    match = re.search(r"^(flags|Features)\s*:(.*)$", text, flags=re.M)
    return set(match.group(2).split()) if match else set()


def test_record_matches_this_machine():
    record = machine_record()
    flags = _cpu_flags()
    assert record["cpu_vector_extensions"] == [f for f in VECTOR_EXTENSIONS if f in flags]
    assert record["torch"] == torch.__version__
    assert record["threads"] == torch.get_num_threads()
    assert record["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert 1 <= record["cores"] <= record["logical_cpus"]
    assert machine_record(threads=3)["threads"] == 3
    json.dumps(record)  # plain JSON


def test_json_and_csv_carry_the_machine(tmp_path):
    payload = with_machine({"rows": [1]}, threads=1)
    assert payload["rows"] == [1] and payload["machine"]["threads"] == 1
    assert with_machine(payload) is payload  # a record already there is kept

    rows = with_machine_columns([{"a": 1, "threads": 7}], threads=2)
    assert rows[0]["threads"] == 7  # the row's own field wins
    assert list(rows[0])[:2] == ["a", "threads"] and rows[0]["cpu_model"] == machine_record()["cpu_model"]

    text = csv_with_machine("a,b\n1,2\n3,4\n", threads=2)
    table = list(csv.DictReader(io.StringIO(text)))
    assert [(r["a"], r["b"], r["threads"]) for r in table] == [("1", "2", "2"), ("3", "4", "2")]
    assert table[0]["cpu_vector_extensions"] == " ".join(machine_record()["cpu_vector_extensions"])

    path = tmp_path / "t.csv"
    path.write_text("x\n5\n")
    stamp_csv(path)
    assert next(csv.DictReader(path.open()))["torch"] == torch.__version__


def test_every_benchmark_records_its_machine():
    """Each script in benchmarks/ and hpcfl/bench that writes a file does so through
    hpcfl.bench.machine (or _runs.write_tables, which does)."""
    writes = re.compile(
        r"write_text\(|open\([^)]*[\"']w[\"']|atomic_write_text\(|DictWriter\(|csv\.writer\(|write_csv\("
    )
    missing = []
    scripts = sorted((REPO / "benchmarks").rglob("*.py")) + sorted(
        (REPO / "hpcfl" / "bench").rglob("report.py")
    )
    for path in scripts:
        text = path.read_text()
        if path.name in DERIVED_ONLY or path.name.startswith("_dry") or not writes.search(text):
            continue
        if "hpcfl.bench.machine" not in text and "write_tables(" not in text:
            missing.append(str(path.relative_to(REPO)))
    assert not missing, f"these benchmarks write figures without the machine record: {missing}"
