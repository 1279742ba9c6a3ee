"""The progress bar of `xtcache teacher-dump` (tqdm, documents of this job), with an ETA where this
job's rows can be counted cheaply.

    python -c "from stage1_teacher.progress import progress_bar"   # used by stage1_teacher.pipeline
"""

from __future__ import annotations

from stage1_teacher.config import TeacherDumpConfig


def progress_bar(cfg: TeacherDumpConfig, shard_plan, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=count_rows(shard_plan, cfg), unit="doc", dynamic_ncols=True, mininterval=1.0)


def count_rows(shard_plan, cfg: TeacherDumpConfig) -> int | None:
    """Rows of this job's ranges (cheap: the plan's row-group counts or a newline count of its local
    files), for the progress bar's ETA. None (no ETA) for Arrow files and for remote text files,
    which would have to be read twice."""
    from xtcache.store_io import is_local, local_path

    total = 0
    for r in shard_plan.jobs[cfg.store.shard_index]:
        rows = shard_plan.range_rows(r)
        url = cfg.input.data[r.file]
        if rows is not None:
            total += rows
        elif shard_plan.files[r.file].format == "arrow" or not is_local(url):
            return None
        else:
            try:
                with open(local_path(url), "rb") as f:
                    total += sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 22), b""))
            except OSError:
                return None
    return total
