"""The dry run's processes: one per stage measured, as many at once as asked, failures as one line."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import sys
import time
import warnings

from megatron_lite.run_modes.dry_run.stage import measure_stage, stage_ranks


class DryRunError(RuntimeError):
    """A stage's dry run failed: its code raised, or its process died."""


def _name(stage: int, routing: str | None) -> str:
    return f"stage {stage}'s dry run" + (f" ({routing} routing)" if routing else "")


def _measure_in_child(config, stage: int, routing: str | None, device_type: str, conn) -> None:
    """In a process of its own: stage ``stage``'s (peak, static bytes, seconds) under ``routing``, or
    its error, on ``conn``."""
    try:
        start = time.perf_counter()
        with warnings.catch_warnings():  # the job's own warnings were the preflight's to give, once
            warnings.simplefilter("ignore")
            peak, static = measure_stage(config, stage_ranks(config)[stage], device_type, routing)
        conn.send((peak, static, time.perf_counter() - start))
    except BaseException as err:  # reported by the parent as one line
        conn.send(f"{type(err).__name__}: {err}".splitlines()[0])
    finally:
        conn.close()


def run_in_children(config, stages: list[int], device_type: str, workers: int, routings=(None,)):
    """Yield ``((stage, routing), (peak, static, seconds))`` as each process reports, one for every
    stage and routing (a MoE model's, dry_run/moe.py; None for a dense one), ``workers`` at once;
    DryRunError (the others stopped) when one raises or dies."""
    # Fork where it is safe (Linux): the child starts with torch imported; elsewhere a fresh process.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    pending, running = [(s, r) for s in stages for r in routings], {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                job = pending.pop(0)
                receive, send = context.Pipe(duplex=False)
                process = context.Process(target=_measure_in_child, args=(config, *job, device_type, send))
                process.start()
                send.close()  # the child's end: EOF here once the child is gone
                running[job] = (process, receive)
            multiprocessing.connection.wait([r for _, r in running.values()])
            for job, (process, receive) in list(running.items()):
                if not receive.poll():
                    continue
                try:
                    result = receive.recv()
                except EOFError:  # gone without a word: killed (out of memory?) or crashed
                    process.join()
                    raise DryRunError(f"{_name(*job)} died (exit code {process.exitcode})") from None
                process.join()
                del running[job]
                if isinstance(result, str):
                    raise DryRunError(f"{_name(*job)} failed: {result}")
                yield job, result
    finally:
        for process, _ in running.values():
            process.kill()
            process.join()
