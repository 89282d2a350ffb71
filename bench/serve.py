"""The serving benchmark: bursts and open loops of separate jobs through `handler.handler` at default settings, plain
transformers `generate` measured in the same run as the peer. One entry, a part per workload, each in a fresh
process; their JSON lands in OUT, and OUT/serve.json gathers them with the commit they measured.

    python -m bench.serve --out OUT [--parts h200,cap24,cap48-7b,images,structured,batch1,cold,oom] [--quick]

  h200, cap24, cap48-7b   bench.paged's parts: the whole GPU (batch 1, 64 uniform, 64 and 256 mixed, long among
                          short, open loop, parity with generate), a process capped to 24 GB (2B) or 48 GB (7B)
  images                  bench.images: new images a second, a repeated image, a chat's later turns
  structured              bench.structured: 64 jobs free, constrained to a JSON schema, and half of each
  batch1                  bench.batch1_recordings: batch 1's first token in a fresh worker
  cold                    bench.harness's cold starts (fresh processes, with and without the compile cache)
  oom                     bench.oom: out-of-memory handling under a capped process

The profilers are `python -m bench.profile`; `bench/README.md` says what each figure is against its target."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGED = ("h200", "cap24", "cap48-7b")
PARTS = {
    **{part: ("bench.paged", ["--parts", part]) for part in PAGED},
    "images": ("bench.images", []),
    "structured": ("bench.structured", []),
    "batch1": ("bench.batch1_recordings", []),
    "cold": ("bench.harness", ["--skip", "main,open"]),
    "oom": ("bench.oom", []),
}
QUICK = {"bench.paged": ["--quick"], "bench.harness": ["--quick"]}


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="h200,cap24,images")
    parser.add_argument("--models", default="/tmp/bench-models", help="where model shapes are built and kept")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, where a part has them")
    parser.add_argument("--commit", default=None, help="the commit measured (a copy of the tree may have no git)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"commit": args.commit or commit(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}
    for part in args.parts.split(","):
        module, extra = PARTS[part]
        command = [sys.executable, "-m", module, "--out", str(out / part), "--models", args.models, *extra]
        command += QUICK.get(module, []) if args.quick else []
        started = time.monotonic()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        (out / f"{part}.log").write_text(done.stdout[-200_000:] + done.stderr[-200_000:])
        results = {p.stem: json.loads(p.read_text()) for p in sorted((out / part).glob("*.json"))}
        summary["parts"][part] = {"returncode": done.returncode, "seconds": time.monotonic() - started, **results}
        if done.returncode or any(isinstance(r, dict) and r.get("exit") for r in results.values()):
            logs = sorted((out / part).glob("*.log"))
            summary["parts"][part]["log_tails"] = {p.name: p.read_text()[-6000:] for p in logs}
        print(f"{part}: exit {done.returncode} in {time.monotonic() - started:.0f}s, {len(results)} result files")
        (out / "serve.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
