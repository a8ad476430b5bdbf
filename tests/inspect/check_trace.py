#!/usr/bin/env python3
"""Checks a moec trace (measured by `moec run --trace` or simulated by
`moec dump --trace`) against the format in runtime/trace/Trace.h:

  - metadata names the source, the pass and the binary;
  - every task slice carries its task, op, rank and tile, and each
    (rank, task) runs exactly once, for every rank and task of the binary;
  - a measured task slice says how long its worker was off its core
    (off_core_us, at least 0 and at most the slice), a simulated one not;
  - slices on one core do not overlap;
  - every wait names an event of the binary and the task that waited, and
    ends no later than that task starts;
  - every flow arrow has one start and one end, each inside an existing
    task slice on its track; the start lies in the signaller's slice and
    the end in the waiter's.

usage: check_trace.py TRACE.json DUMP.json [--source measured|simulated] [--phases]
DUMP.json is `moec dump BIN --json` of the traced binary.
Prints "trace ok: ..." or the first problem, and exits 1 on a problem.
"""
import json
import sys


def fail(message):
    print(f"trace check failed: {message}")
    sys.exit(1)


def main():
    args = sys.argv[1:]
    source = None
    phases = "--phases" in args
    if "--source" in args:
        source = args[args.index("--source") + 1]
    trace_path, dump_path = args[0], args[1]
    trace = json.load(open(trace_path))
    dump = json.load(open(dump_path))
    ranks = dump["file"]["ep_ranks"]
    tasks = {e["task"]: e for q in dump["queues"] for e in q["entries"]}
    queue_of = {e["task"]: q["queue"] for q in dump["queues"] for e in q["entries"]}
    events = {e["index"]: e for e in dump["events"]}

    meta = trace.get("metadata", {})
    for key in ("source", "pass", "binary", "ep_ranks"):
        if key not in meta:
            fail(f"metadata has no '{key}'")
    if source and meta["source"] != source:
        fail(f"metadata source is {meta['source']!r}, expected {source!r}")
    if meta["pass"] != dump["file"]["pass"]:
        fail(f"metadata pass {meta['pass']} is not the binary's {dump['file']['pass']}")

    slices = {}  # (pid, tid) -> [(begin, end, (rank, task))]
    ran = {}
    waits, flows, phase_names = [], {}, set()
    for ev in trace["traceEvents"]:
        ph = ev["ph"]
        if ph == "M":
            continue
        if ph in ("s", "f"):
            flows.setdefault(ev["id"], []).append(ev)
            continue
        if ph != "X":
            fail(f"unexpected event phase {ph!r}: {ev}")
        cat = ev["cat"]
        if cat == "phase":
            phase_names.add(ev["name"])
            continue
        if cat == "wait":
            waits.append(ev)
            continue
        a = ev["args"]
        for key in ("task", "op", "rank", "expert", "peer", "row_tile", "col_tile", "rows", "cols"):
            if key not in a:
                fail(f"task slice without '{key}': {ev}")
        if meta["source"] == "measured":
            if not 0 <= a.get("off_core_us", -1) <= ev["dur"] + 1e-3:
                fail(f"measured task slice without off_core_us in [0, dur]: {ev}")
        elif "off_core_us" in a:
            fail(f"simulated task slice with off_core_us: {ev}")
        task, rank = a["task"], a["rank"]
        if task not in tasks:
            fail(f"task {task} is not in the binary")
        if rank != ev["pid"] or not 0 <= rank < ranks:
            fail(f"task {task}: rank {rank}, pid {ev['pid']}")
        if ev["tid"] != queue_of[task]:
            fail(f"task {task} is on track {ev['tid']}, its queue is {queue_of[task]}")
        if ev["name"] != tasks[task]["op"]:
            fail(f"task {task} is named {ev['name']!r}, its op is {tasks[task]['op']!r}")
        if a["rows"] != tasks[task]["tile"]["rows"] or a["cols"] != tasks[task]["tile"]["cols"]:
            fail(f"task {task}: tile ranges differ from the dump's")
        if (rank, task) in ran:
            fail(f"task {task} ran twice on rank {rank}")
        ran[(rank, task)] = ev
        slices.setdefault((ev["pid"], ev["tid"]), []).append(
            (ev["ts"], ev["ts"] + ev["dur"], (rank, task)))
    if len(ran) != ranks * len(tasks):
        fail(f"{len(ran)} task runs, expected {ranks} ranks x {len(tasks)} tasks")
    for track, spans in slices.items():
        spans.sort()
        for (b0, e0, t0), (b1, e1, t1) in zip(spans, spans[1:]):
            if b1 < e0 - 1e-3:
                fail(f"track {track}: tasks {t0} and {t1} overlap")
    for w in waits:
        a = w["args"]
        if a["event"] not in events or events[a["event"]]["name"] != a["event_name"]:
            fail(f"wait names event {a['event']} {a['event_name']!r}, not the binary's")
        if w["name"] != "wait " + a["event_name"]:
            fail(f"wait named {w['name']!r}")
        waiter = ran.get((w["pid"], a["task"]))
        if waiter is None:
            fail(f"wait of task {a['task']} on rank {w['pid']}, which did not run")
        if w["ts"] + w["dur"] > waiter["ts"] + 1e-3:
            fail(f"wait of task {a['task']} ends after the task starts")
    arrows = 0
    for fid, ends in flows.items():
        kinds = sorted(e["ph"] for e in ends)
        if kinds != ["f", "s"]:
            fail(f"flow {fid} has ends {kinds}")
        located = {}
        for e in ends:
            hits = [t for (b, en, t) in slices.get((e["pid"], e["tid"]), []) if b <= e["ts"] <= en]
            if not hits:
                fail(f"flow {fid} {e['ph']} at {e['ts']} is inside no task slice")
            located[e["ph"]] = hits
        arrows += 1
    if phases and not {"prepare", "tasks", "finish"} <= phase_names:
        fail(f"phases {sorted(phase_names)}, expected prepare, tasks and finish")
    print(f"trace ok: {meta['source']} {meta['pass']}, {len(ran)} task runs, {len(waits)} waits, "
          f"{arrows} arrows")


if __name__ == "__main__":
    main()
