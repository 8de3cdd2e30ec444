"""How many CPU threads torch computes with: one budget per process, leased by the stages.

torch's default is one thread per core in every process (and every Python thread) that computes.
Three `dflash-eval run` commands on a 2-core machine then ran 6 threads on 2 cores, and ops this
small spend their time in OpenMP waiting for a thread that is not scheduled: 9.8x the time of one run
alone (1.75x with one thread each); greedy decoding of the tiny target took 465 ms per token instead
of 9 ms with 1 thread when other processes were busy.

The budget: `--threads N` (every command that computes), the flow parameter `threads`, else
$OMP_NUM_THREADS, else this machine's cores (the ones this process may run on) divided by the heavy
stages allowed to compute at once on it, at least 1. What "allowed at once" is depends on who started
the run:

- deployment runs (`dflash-eval serve`, a work-pool worker): heavy stages take turns through the
  machine's heavy-stage limit (tasks/heavy.py: DEFAULT_SLOTS = 1, unless raised on the server), so
  cores / that limit, fixed for the run: with 1 slot the one heavy stage computing gets every core,
  and runs waiting for the slot compute nothing meanwhile.
- runs by hand (`run`, `stage`, `demo`, `tiny build`): they take no slot, and nothing bounds how many
  a user starts at once. Each such process registers itself for its lifetime in a folder of lock
  files on this machine (RUNS_BY_HAND_DIR; a lock dies with its process, even on SIGKILL), and each
  lease divides the cores by the processes registered at that moment: one run alone gets every core,
  three started together get a third each. Deployment runs are not counted (the slots share them out).

Per op size (`threads_for`): a stage whose ops are small (greedy decoding of a small model: one token
per forward; a small drafter's replay) computes on one thread: below SMALL_OP_WORK of work per op
(parameters x tokens one forward processes, from benchmarks/bench_threads.py) a second thread gains
little and can cost 10x. Larger ops get the whole budget: each of them lasts long enough that waiting
for a descheduled thread costs little, and the big models' ops (a 27B target decoding: a pass over
54 GB of weights per token) are bound by memory bandwidth, which grows with the threads reading it.

Leases (`compute_threads`): torch's thread count is per OS thread here (the OpenMP backend of the CPU
wheels: torch.set_num_threads sets the calling thread's count, and the count of threads that have
not computed yet), and every Python thread that runs torch ops brings its own OpenMP team. Several
flow runs in one process (evaluate_checkpoint called from threads; a stage's worker threads) would
each run a full pool. So each computing thread leases its threads from the process's budget: at most
what is free, and at least 1, the thread it runs on. It never waits for more: stages compute while
holding the store's entry locks, and a stage waiting for threads held by one that waits for its lock
would never finish. So a process computes on at most its budget plus one thread per computing Python
thread that found none free. `dflash-eval serve` (Prefect 3.9) runs each flow run in a process of its
own, which takes its budget from the run's `threads` parameter.

The inter-op pool (torch.set_num_interop_threads: at most once per process, before any inter-op work)
gets the budget on the first configure_threads; once it is set or in use it stays as it is.
"""

import atexit
import functools
import inspect
import math
import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the drafter module imports transformers: not worth it for an annotation
    from dflash_core.drafter import DFlashDrafter

# Ops below this much work (parameters x tokens processed by one forward) compute on one thread. bench_threads.py
# on 2 cores, 2 threads / 1 thread: when the machine was otherwise idle, greedy decoding up to the 125M-parameter
# target (work 1.2e8) gained nothing from a second thread (0.97-0.99), replays of 3.5M and 7.5M drafters (work
# 2e9 and 4e9) took 0.78 of the time, forwards of 8 x 128 tokens of the 16M and 125M targets (2e10, 1e11) 0.53-0.56;
# whenever another process kept a core busy, 2 threads were slower for every op (1.2-3x, and 10-60x for the tiny
# models' ops, which then wait for a thread that is not scheduled). So below ~2e9 a second thread gains at most
# ~20% and can cost 10x: the threshold errs to 1 thread there.
SMALL_OP_WORK = 3e9
# Where runs by hand on this machine register while they run (local to the machine: never the home folder,
# which may be shared by several machines).
RUNS_BY_HAND_DIR = Path(tempfile.gettempdir()) / f"dflash-eval-{os.getuid() if hasattr(os, 'getuid') else 0}" / "runs"


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity; os.cpu_count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def explicit_threads() -> int | None:
    """$OMP_NUM_THREADS when it holds a count (a user's explicit choice), else None."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def default_threads(heavy_at_once: int = 1, cores: int | None = None) -> int:
    """The thread budget of a process: $OMP_NUM_THREADS if set, else the cores divided by the heavy
    stages allowed to compute at once on this machine (see the module docstring), at least 1."""
    explicit = explicit_threads()
    if explicit is not None:
        return explicit
    cores = machine_cores() if cores is None else cores
    return max(1, cores // max(1, heavy_at_once))


def threads_for(work_per_op: float, budget: int) -> int:
    """Threads for ops of `work_per_op` (parameters x tokens one forward processes): 1 below
    SMALL_OP_WORK, else the whole `budget`."""
    return 1 if work_per_op <= SMALL_OP_WORK else max(1, budget)


def parameter_count(module: torch.nn.Module) -> int:
    """A model's parameters (what one token of a forward touches once)."""
    return sum(p.numel() for p in module.parameters())


def checkpoint_parameters(model_dir) -> int:
    """The parameters of a Hugging Face checkpoint's safetensors files, read from their headers (nothing
    is loaded); 0 when there are none."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


# --- runs by hand on this machine

_registration: int | None = None  # the file descriptor holding this process's lock


def register_run_by_hand(directory: Path | None = None) -> None:
    """Count this process among the runs by hand computing on this machine (in `directory`, default
    RUNS_BY_HAND_DIR) until it exits. The lock file is locked before it gets the name others count, so a
    counter never takes it for a dead process's."""
    global _registration
    if _registration is not None:
        return
    directory = RUNS_BY_HAND_DIR if directory is None else directory
    try:
        import fcntl

        directory.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(directory / f".{name}.new", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(directory / f".{name}.new", directory / f"{name}.lock")
        _registration = fd  # kept open, and so locked, as long as the process lives
        atexit.register((directory / f"{name}.lock").unlink, missing_ok=True)  # tidy; counters skip it anyway
    except (ImportError, OSError):  # no flock (not POSIX) or no writable temp folder: this run counts alone
        pass


def runs_by_hand(directory: Path | None = None) -> int:
    """The runs by hand computing on this machine now (this one included when registered), at least 1; the
    lock files of processes that have died are removed."""
    directory = RUNS_BY_HAND_DIR if directory is None else directory
    try:
        import fcntl

        paths = list(directory.glob("*.lock"))
    except (ImportError, OSError):
        return 1
    alive = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:  # removed meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            alive += 1  # its process holds it
        else:
            path.unlink(missing_ok=True)  # its process died
        finally:
            os.close(fd)
    return max(1, alive)


# --- the budget and its leases

class ThreadBudget:
    """Threads the computing Python threads of one process share (see the module docstring). `share`, when
    given, says how many of them this process may use right now (runs by hand: its part of the cores)."""

    def __init__(self, total: int, share: Callable[[], int] | None = None):
        if total < 1:
            raise ValueError(f"a thread budget needs at least 1 thread, got {total}")
        self.total, self.share = total, share
        self._lock = threading.Lock()
        self._in_use: dict[int, int] = {}  # Python thread id -> threads it computes with now

    def in_use(self) -> int:
        """Threads the leases hold now, all Python threads together."""
        with self._lock:
            return sum(self._in_use.values())

    def available(self) -> int:
        """What the whole budget is worth now: `total`, or this process's share of the cores when smaller."""
        return self.total if self.share is None else max(1, min(self.total, self.share()))

    def _free_for(self, thread_id: int, available: int) -> int:
        return available - sum(n for t, n in self._in_use.items() if t != thread_id)

    @contextmanager
    def lease(self, want: int | None = None) -> Iterator[int]:
        """Compute on this Python thread with up to `want` threads (None: all available) while inside;
        yields how many it got: what is free, at least 1. Nests: an inner lease replaces the outer one's
        count (more or fewer) until it ends, then the outer count comes back as far as it is still free."""
        thread_id = threading.get_ident()
        available = self.available()  # outside the lock: it may read the runs-by-hand folder
        with self._lock:
            outer = self._in_use.get(thread_id)
            n = max(1, min(available if want is None else want, self._free_for(thread_id, available)))
            self._in_use[thread_id] = n
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            yield n
        finally:
            available = self.available() if outer is not None else available
            with self._lock:
                if outer is None:
                    del self._in_use[thread_id]
                    restore = before  # outside any lease: the thread's count as it was
                else:
                    restore = max(1, min(outer, self._free_for(thread_id, available)))
                    self._in_use[thread_id] = restore
            torch.set_num_threads(restore)


_budget: ThreadBudget | None = None
_budget_lock = threading.Lock()
_interop_set = False


def configure_threads(threads: int | None = None, heavy_at_once: int | None = None, set_default: bool = True) -> int:
    """Set this process's thread budget and return it. `threads` fixes it. None keeps a budget set
    before (e.g. by the command line), else takes the default: $OMP_NUM_THREADS, else the cores divided
    by `heavy_at_once` (a deployment run: the machine's heavy-stage slots), or, when that is None (a run
    by hand), by the runs by hand computing at each lease (this process is registered among them).
    set_default: also make it torch's count for this thread and for threads that have not computed yet
    (what a command does at its start; a flow run leases instead, so that its caller's count comes back).
    The inter-op pool gets the budget the first time, if torch still allows it."""
    global _budget, _interop_set
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    with _budget_lock:
        if threads is None and _budget is not None:
            budget = _budget
        else:
            share = None
            if threads is not None:
                total = threads
            elif explicit_threads() is not None or heavy_at_once is not None:
                total = default_threads(heavy_at_once or 1)
            else:  # a run by hand, on the default: its part of the cores, as the runs by hand come and go
                register_run_by_hand()
                total = machine_cores()
                share = lambda: total // runs_by_hand()  # noqa: E731 (available() keeps it >= 1)
            if _budget is None:
                _budget = ThreadBudget(total, share)
            else:  # changed in place: leases held now stay counted
                _budget.total, _budget.share = total, share
            budget = _budget
        now = budget.available()
        if not _interop_set:
            _interop_set = True
            try:
                torch.set_num_interop_threads(now)
            except RuntimeError:  # already set, or inter-op work has started: it stays as it is
                pass
    if set_default:
        torch.set_num_threads(now)
    return now


def budget_is_set() -> bool:
    """Whether this process has a thread budget yet (a flow run started by a command keeps the command's).
    A function, not the global itself, in the flow's wrapper: a flow run's context is pickled for the task
    runs a Dask cluster computes (tasks/cluster.py), and the budget holds a lock, which does not pickle."""
    return _budget is not None


def thread_budget() -> ThreadBudget:
    """This process's budget (configure_threads() with the defaults, if nothing set one yet)."""
    if _budget is None:
        configure_threads(set_default=False)
    assert _budget is not None  # configure_threads set it
    return _budget


@contextmanager
def compute_threads(work_per_op: float | None = None) -> Iterator[int]:
    """Run this Python thread's torch ops inside on threads leased from the process's budget: as many as
    ops of `work_per_op` (parameters x tokens per forward: threads_for) use well, or all available when
    None; yields the count. For a stage's compute, e.g.

        with compute_threads(parameter_count(drafter) * tokens_per_forward):
            results = replay(...)
    """
    budget = thread_budget()
    want = None if work_per_op is None else threads_for(work_per_op, budget.total)
    with budget.lease(want) as n:
        yield n


def replay_threads(drafter: "DFlashDrafter", references: int, max_blocks: int = 64):
    """compute_threads for replaying the loaded `drafter` over `references` references (the drafts and
    diagnostics stages): each of its forwards drafts up to `max_blocks` blocks of its block size at once
    (dflash_core.replay), one per reference still decoding."""
    return compute_threads(work_per_op=parameter_count(drafter) * min(references, max_blocks) * drafter.block_size)


def leases_threads(heavy_at_once: Callable[[], int | None] = lambda: None, invalid: type[Exception] = ValueError):
    """Decorate a flow function with a `threads` parameter: it sets the process's budget (None: keep the
    one set, e.g. by the command line; else the default, `heavy_at_once()` giving the heavy stages allowed
    at once: None for a run by hand). The run's own glue (fetch's weight checks, scores, the report: small
    ops) computes on its one thread, not counted against the budget (it often only waits, e.g. for the
    references stage's worker); each stage leases what its ops use well. The caller's thread count comes
    back afterwards. A `threads` below 1 raises `invalid`."""

    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)  # keeps the signature: Prefect reads the parameters through it
        def run(*args, **kwargs):
            threads = signature.bind(*args, **kwargs).arguments.get("threads")
            if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
                raise invalid(f"threads must be a whole number of at least 1 (or none: the default), got {threads!r}")
            configure_threads(threads, heavy_at_once() if threads is None and not budget_is_set() else None,
                              set_default=False)
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.set_num_threads(before)

        return run

    return decorate
