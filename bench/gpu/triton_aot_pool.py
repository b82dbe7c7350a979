"""A pool of worker processes with a time limit per task: a compile that runs past it is stopped (its
worker is killed and replaced) and reported, instead of holding the whole run.

``concurrent.futures`` cannot stop one running task, and a Triton compile can take minutes (ptxas on a
kernel that spills), so each worker has its own task queue and the parent kills the worker whose task
is late. Workers are spawned, not forked: the parent has torch's thread pools running.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import wait
from typing import Callable, Iterable

__all__ = ["run_pool"]


def _work(fn, conn) -> None:
    try:
        while (task := conn.recv()) is not None:
            conn.send(fn(task))
    except (EOFError, BrokenPipeError):  # the parent is gone
        pass


class _Worker:
    """One process and its own pipe: killing a late worker never touches another's channel."""

    def __init__(self, ctx, fn):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_work, args=(fn, child), daemon=True)
        self.process.start()
        child.close()
        self.task: int | None = None
        self.started = 0.0

    def give(self, index: int, item) -> None:
        self.task, self.started = index, time.monotonic()
        self.conn.send(item)

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.process.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                pass
        self.process.join(timeout=None if kill else 10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def run_pool(fn: Callable, items: Iterable, workers: int, timeout: float,
             on_result: Callable[[int, dict], None]) -> None:
    """``on_result(i, fn(items[i]))`` for every item, ``workers`` at a time; an item still running
    after ``timeout`` seconds gets ``{"error": ..., "seconds": timeout}`` instead."""
    items = list(items)
    if not items:
        return
    ctx = mp.get_context("spawn")
    pending = list(enumerate(items))[::-1]
    pool = [_Worker(ctx, fn) for _ in range(min(workers, len(items)))]
    finished = False
    try:
        while pending or any(w.task is not None for w in pool):
            for worker in pool:
                if worker.task is None and pending:
                    worker.give(*pending.pop())
            busy = {w.conn: w for w in pool if w.task is not None}
            for conn in wait(list(busy), timeout=1.0):
                worker = busy[conn]
                try:
                    result = conn.recv()
                except EOFError:  # the worker died (out of memory, a crash in the compiler)
                    worker.stop(kill=True)
                    result = {"error": f"worker process died (exit code {worker.process.exitcode})", "seconds": 0.0}
                    pool[pool.index(worker)] = _Worker(ctx, fn)
                on_result(worker.task, result)
                worker.task = None
            for i, worker in enumerate(pool):
                if worker.task is not None and time.monotonic() - worker.started > timeout:
                    on_result(worker.task, {"error": f"compile still running after {timeout:.0f} s (stopped)",
                                            "seconds": round(timeout, 1)})
                    worker.stop(kill=True)
                    pool[i] = _Worker(ctx, fn)
        finished = True
    finally:
        for worker in pool:  # interrupted (an exception, SIGTERM): kill the compiles under way
            worker.stop(kill=not finished)
