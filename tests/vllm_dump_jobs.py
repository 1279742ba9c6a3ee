"""Stage 1 dumps on vLLM run in a fresh interpreter, sharing one pair of in-process engines
(tests/test_stage1_vllm.py runs it once per module).

    python -m tests.vllm_dump_jobs JOBS.json RESULTS.json

JOBS.json is a list of {"name", "config" (the values of `build_config`), "head_architectures"
(optional: the set `stage1_teacher.capture.head` treats as supported, [] to force the fallback)}. The jobs
run in order through `run_teacher_dump` with one `EngineCache`, so each engine starts once.
RESULTS.json maps each name to {"summary" (`Summary.as_dict()`, null on error), "error" ("Type:
message", null on success), "engines" (the engine kinds the job asked the cache for, in order),
"warnings" (messages logged at WARNING or above)}.

A fresh interpreter, not the pytest worker: vLLM's in-process engine start scans every imported
module (its kernel overrides), and a module another test file imported there can break that scan
(werkzeug's LocalProxy, through the S3 tests' server); the engine's own settings also stay in here.
"""

from __future__ import annotations

import json
import logging
import sys


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_jobs(jobs: list[dict]) -> dict:
    import stage1_teacher.capture.head as head
    from stage1_teacher.capture.run import EngineCache
    from stage1_teacher.config import build_config
    from stage1_teacher.dump import run_teacher_dump

    cache, requested, results = EngineCache(), [], {}
    real_get = cache.get
    cache.get = lambda key, factory: (requested.append(key[0]), real_get(key, factory))[1]
    supported = set(head.HEAD_ARCHITECTURES)
    handler = _Warnings()
    logging.getLogger().addHandler(handler)
    try:
        for job in jobs:
            head.HEAD_ARCHITECTURES = set(job.get("head_architectures", supported))
            requested.clear()
            handler.messages = []
            summary, error = None, None
            try:
                summary = run_teacher_dump(build_config(job["config"]), engines=cache, progress=False).as_dict()
            except Exception as e:  # reported to the test, which decides
                error = f"{type(e).__name__}: {e}"
            results[job["name"]] = {"summary": summary, "error": error, "engines": list(requested),
                                    "warnings": list(handler.messages)}
    finally:
        head.HEAD_ARCHITECTURES = supported
        cache.close()
    return results


def main() -> None:
    jobs_path, results_path = sys.argv[1:3]
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = run_jobs(jobs)
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
