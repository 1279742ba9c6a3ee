"""The progress bar of `xtcache teacher-dump` (tqdm, documents of this job), with an ETA where this
job's rows can be counted cheaply.

    python -c "from stage1_teacher.progress import progress_bar"   # used by stage1_teacher.pipeline
"""

from __future__ import annotations

from stage1_teacher.corpus import Corpus


def progress_bar(corpus: Corpus, shard_plan, job: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=count_rows(corpus, shard_plan, job), unit="doc", dynamic_ncols=True, mininterval=1.0)


def count_rows(corpus: Corpus, shard_plan, job: int) -> int | None:
    """Rows of job `job`'s ranges (cheap: the plan's row-group counts or a newline count of its local
    files), for the progress bar's ETA. None (no ETA) for Arrow files and for remote text files,
    which would have to be read twice."""
    total = 0
    for r in shard_plan.jobs[job]:
        rows = shard_plan.range_rows(r)
        if rows is None and shard_plan.files[r.file].format != "arrow":
            rows = corpus.count_lines(r.file)
        if rows is None:
            return None
        total += rows
    return total
