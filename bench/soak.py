"""Soak: many short jobs through the runpod SDK's real production loop (`python handler.py` against the
loopback queue stand-in of tools/runpod_queue.py), a tiny random-weight model on CPU. Run by hand
(it takes minutes; not part of CI):

    python -m bench.soak [--jobs 1000] [--family qwen2-vl] [--max-new-tokens 4] [--out soak.json]

Prints (and writes with --out): jobs/s from the first take to the last answer, jobs lost (no accepted
answer) and answered twice, and the worker's resident memory after the first 50 answers and at the
end. Every tenth job is invalid (a vqa without a question), so error answers are soaked too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tools.runpod_queue import JobQueue, worker
from tools.sample_images import data_uri, plain, striped

ROOT = Path(__file__).resolve().parent.parent


def jobs(count: int, max_new_tokens: int) -> list[dict]:
    images = [data_uri(striped()), data_uri(plain("red", (64, 48))), data_uri(striped((96, 64)))]
    out = []
    for n in range(count):
        job = {"task": "vqa", "image_url": images[n % len(images)], "max_new_tokens": max_new_tokens}
        if n % 10 != 9:
            job["question"] = f"What is in picture {n}?"
        out.append(job)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--family", default="qwen2-vl")
    parser.add_argument("--model", help="a model folder (default: build a tiny one)")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait for every answer")
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    model = args.model
    if model is None:
        import tools.tiny_models as tiny_models

        model = tiny_models.build(args.family, work / args.family)
    with JobQueue() as queue:
        ids = [queue.put(job) for job in jobs(args.jobs, args.max_new_tokens)]
        with worker(queue, model, work / "worker.log") as running:
            first = min(50, len(ids))
            if not queue.wait_answered(ids[:first], args.timeout):
                sys.exit(f"the first {first} jobs were not answered; see {work / 'worker.log'}")
            rss_after_first = running.rss_kib()
            finished = queue.wait_answered(ids, args.timeout)
            rss_end = running.rss_kib()
            time.sleep(3)  # late duplicates, if any, would arrive now
        answers = queue.answers()
        started = min(queue.taken.values())
        ended = max(post.at for post in queue.accepted())
    answered = sum(1 for job_id in ids if len(answers.get(job_id, [])) >= 1)
    errors = sum(1 for job_id in ids if answers.get(job_id) and "error" in answers[job_id][0])
    figures = {
        "jobs": len(ids),
        "answered": answered,
        "lost": len(ids) - answered,
        "answered_twice_or_more": sum(1 for job_id in ids if len(answers.get(job_id, [])) > 1),
        "error_answers": errors,
        "finished_in_time": finished,
        "seconds": round(ended - started, 1),
        "jobs_per_s": round(answered / (ended - started), 2),
        "rss_mib_after_first_50": round(rss_after_first / 1024, 1),
        "rss_mib_at_end": round(rss_end / 1024, 1),
        "rss_growth_pct": round(100 * (rss_end - rss_after_first) / rss_after_first, 1),
        "worker_exit_code": running.process.returncode,
        "log": str(work / "worker.log"),
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
