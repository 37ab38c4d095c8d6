"""The bench's e2e tests' helpers: a run of the command, its results.md read back by contender, a
moe run."""

from __future__ import annotations

# shorter and fewer sequences per microbatch than the workloads' configs: the e2e runs check what
# the bench writes and which tasks each row ran, which no size changes, and each job then computes
# (and calibrates) in about half the CPU
SMALL_DATA = (
    "--set",
    "data.min_seq_len=16",
    "--set",
    "data.max_seq_len=32",
    "--set",
    "data.microbatch_size=2",
)


def table_rows(markdown: str) -> dict[str, list[str]]:
    """contender -> its table cells, from results.md."""
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            line.startswith("| ")
            and cells[0] not in ("contender",)
            and not cells[0].startswith("---")
        ):
            rows[cells[0]] = cells
    return rows


def rrfp_bench(*args: str, timeout: float):
    """``python -m rrfp bench ARGS`` as a child of the preloaded forkserver (torch imported
    already): the command's entry, output and exit code, as ``subprocess.run`` gives them. Not in
    the test process: the job's agent is a fork of the command's process."""
    from harness import ROOT
    from harness.forked_python import run_python
    from harness.launch import child_env

    return run_python(["-m", "rrfp", "bench", *args], cwd=ROOT, env=child_env(), timeout=timeout)


def run_bench_moe(out, contenders, *flags: str) -> tuple[dict, str]:
    """``rrfp bench --workloads moe`` with these contenders and flags, writing to ``out``
    (``rrfp_bench``): the results.json document and the process's stdout, after asserting it
    exited 0."""
    import json

    res = rrfp_bench(
        "--workloads",
        "moe",
        *flags,
        "--contenders",
        ",".join(c.replace(" ", "-") for c in contenders),
        "--out",
        str(out),
        *SMALL_DATA,
        timeout=380,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), res.stdout


def tasks_per_lane(trace_path) -> dict[tuple[str, int], int]:
    """(contender, trace thread) -> how many tasks it ran, from a bench run's trace file (its
    waits left out)."""
    import json

    trace = json.loads(trace_path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    tasks: dict[tuple[str, int], int] = {}
    for e in trace:
        if e.get("ph") == "X" and e["name"] != "wait":
            key = (names[e["pid"]], e["tid"])
            tasks[key] = tasks.get(key, 0) + 1
    return tasks
