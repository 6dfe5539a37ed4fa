"""One sampler for a process tree (RSS summed, its anonymous share, disk reads), and what it saw split by stage:
the scale rehearsal's measurement (bench/bench_nightly_scale.py)."""

from __future__ import annotations

import subprocess
import threading
import time

import numpy as np

MIB = 1 << 20
BETWEEN = "flow code between tasks"


class TreeSampler(threading.Thread):
    """RSS summed over a process and its descendants (and its anonymous share: RSS less the resident file-backed
    and shared pages, the memory a process holds rather than the OS's page cache mapped into it), and the bytes
    they read from disk (each process's count kept after it exits), every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        import psutil

        self.root, self.interval = psutil.Process(pid), interval
        # (time, RSS bytes, bytes read so far, root's RSS, anonymous RSS bytes)
        self.samples: list[tuple[float, int, int, int, int]] = []
        self.read: dict[int, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            rss = root = anonymous = 0
            for proc in procs:
                try:
                    memory = proc.memory_info()
                    rss += memory.rss
                    anonymous += memory.rss - memory.shared
                    root = root or rss  # the first is the flow's own process
                    self.read[proc.pid] = max(self.read.get(proc.pid, 0), proc.io_counters().read_bytes)
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.samples.append((time.time(), rss, sum(self.read.values()), root, anonymous))
            self.done.wait(self.interval)

    def stop(self) -> None:
        self.done.set()
        self.join()


def drop_page_cache() -> bool:
    """So that reading the store is reading the disk (root only; otherwise the read figures undercount)."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def per_stage(samples: list[tuple[float, int, int, int, int]], intervals: dict[str, list[tuple[float, float]]],
              start: float, end: float) -> dict:
    """Seconds (the union of a stage's intervals), peak RSS (and peak anonymous RSS) and disk reads inside them;
    the rest of the run's samples are BETWEEN (the flow's own code, subflow starts, the process starting)."""
    out, claimed = {}, np.zeros(len(samples), bool)
    times = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples])
    own = np.array([s[3] for s in samples])
    anonymous = np.array([s[4] if len(s) > 4 else 0 for s in samples])
    read = np.diff(np.array([0] + [s[2] for s in samples]))
    step = float(np.median(np.diff(times))) if len(times) > 1 else 0.1
    for stage, spans in intervals.items():
        inside = np.zeros(len(samples), bool)
        for a, b in spans:  # and the sample either side: a task shorter than the interval still has one
            inside |= (times >= a - step) & (times <= b + step)
        claimed |= inside
        merged, seconds = sorted(spans), 0.0
        last = -1.0
        for a, b in merged:
            seconds += max(0.0, b - max(a, last))
            last = max(last, b)
        out[stage] = {"seconds": round(seconds, 1),
                      "peak_rss_mb": int(rss[inside].max() // MIB) if inside.any() else None,
                      "peak_anonymous_mb": int(anonymous[inside].max() // MIB) if inside.any() else None,
                      "flow_process_peak_mb": int(own[inside].max() // MIB) if inside.any() else None,
                      "read_mb": round(float(read[inside].sum()) / MIB, 1), "tasks": len(spans)}
    rest = ~claimed & (times >= start) & (times <= end)
    busy = sum(v["seconds"] for v in out.values())
    out[BETWEEN] = {"seconds": round(max(0.0, end - start - busy), 1),
                    "peak_rss_mb": int(rss[rest].max() // MIB) if rest.any() else None,
                    "peak_anonymous_mb": int(anonymous[rest].max() // MIB) if rest.any() else None,
                    "flow_process_peak_mb": int(own[rest].max() // MIB) if rest.any() else None,
                    "read_mb": round(float(read[rest].sum()) / MIB, 1), "tasks": 0}
    return out


