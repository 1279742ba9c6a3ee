"""`xtcache.reaper`: processes started under `guard_children()` do not outlive a SIGKILLed parent.

The vLLM case (engine processes of a killed `teacher-dump`) is in test_stage1_vllm.py; this one
uses plain forked sleepers, so it runs in seconds.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]

PARENT = r'''
import multiprocessing as mp, time
from xtcache.reaper import guard_children

def sleeper():
    time.sleep(300)

if __name__ == "__main__":
    mp.set_start_method("fork")
    with guard_children():
        guarded = mp.Process(target=sleeper)
        guarded.start()
        second = mp.Process(target=sleeper)
        second.start()
    unguarded = mp.Process(target=sleeper)
    unguarded.start()
    print(guarded.pid, second.pid, unguarded.pid, flush=True)
    time.sleep(300)
'''


def test_guarded_children_end_with_a_killed_parent():
    p = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, cwd=REPO, text=True)
    guarded, second, unguarded = (psutil.Process(int(x)) for x in p.stdout.readline().split())
    p.send_signal(signal.SIGKILL)
    p.wait()
    try:
        gone, alive = psutil.wait_procs([guarded, second], timeout=30)
        assert not alive
        assert unguarded.is_running() and unguarded.status() != psutil.STATUS_ZOMBIE
    finally:
        for q in (guarded, second, unguarded):
            if q.is_running():
                q.kill()


STARTING = r'''
import multiprocessing as mp, time
from xtcache.reaper import guard_children

def sleeper():
    time.sleep(300)

if __name__ == "__main__":
    mp.set_start_method("fork")
    with guard_children():  # killed while the "engine" is still starting: the block never ends
        child = mp.Process(target=sleeper)
        child.start()
        print(child.pid, flush=True)
        time.sleep(300)
'''


def test_children_are_guarded_while_the_block_still_runs():
    p = subprocess.Popen([sys.executable, "-c", STARTING], stdout=subprocess.PIPE, cwd=REPO, text=True)
    child = psutil.Process(int(p.stdout.readline()))
    time.sleep(1.5)  # a few registration polls
    p.send_signal(signal.SIGKILL)
    p.wait()
    try:
        _, alive = psutil.wait_procs([child], timeout=30)
        assert not alive
    finally:
        if child.is_running():
            child.kill()
