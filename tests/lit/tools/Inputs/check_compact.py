"""Checks that `moec dump --json --compact` holds what `--json` holds:
every queue's tasks, field by field, and that it is at most a fifth of the
size. Usage: check_compact.py FULL.json COMPACT.json"""
import json
import os
import sys

full_path, compact_path = sys.argv[1], sys.argv[2]
full, compact = json.load(open(full_path)), json.load(open(compact_path))
columns = compact["entry_columns"]
problems = []
for key in ("file", "slots", "ops", "events", "statistics"):
    if full[key] != compact[key]:
        problems.append(f"{key} differ")
count = 0
for fq, cq in zip(full["queues"], compact["queues"], strict=True):
    if len(fq["entries"]) != len(cq["entries"]):
        problems.append(f"queue {fq['queue']}: entry counts differ")
        continue
    for fe, row in zip(fq["entries"], cq["entries"]):
        c = dict(zip(columns, row, strict=True))
        tile = fe["tile"]
        want = {
            "task": fe["task"], "op_index": fe["op_index"],
            "expert": tile["expert"], "peer": tile["peer"],
            "row_tile": tile["row_tile"], "col_tile": tile["col_tile"],
            "row_begin": tile["rows"][0], "row_end": tile["rows"][1],
            "col_begin": tile["cols"][0], "col_end": tile["cols"][1],
            "cost": fe["cost"], "start": fe.get("start"), "finish": fe.get("finish"),
            "waits": [[w["event"], w["threshold"]] for w in fe["waits"]],
            "signals": [[s["event"], s["increment"], s["peer_offset"]] for s in fe["signals"]],
        }
        if c != want:
            problems.append(f"task {fe['task']} differ: {c} against {want}")
        count += 1
ratio = os.path.getsize(compact_path) / os.path.getsize(full_path)
if ratio > 0.2:
    problems.append(f"sizes: the compact form is {ratio:.2f} of the full one; they differ too little")
for p in problems[:10]:
    print(p)
print(f"compact: {count} tasks equal, {ratio:.3f} of the size")
