"""A Dask scheduler and workers, each a process of its own on loopback, as tests/test_cluster.py and
benchmarks/bench_cluster.py start them (`dask scheduler`, `dask worker --nthreads 1`)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.ports import free_port
from tests.waiting import NeverReady, wait_until

DASK = Path(sys.executable).parent / "dask"


class Cluster:
    """A Dask scheduler and its workers, each a process of its own (workers without a nanny: killing one
    kills that worker, and nothing restarts it)."""

    def __init__(self, logs: Path, *, workers: int = 2, api_url: str | None = None, preload: Path | None = None,
                 env: dict[str, str] | None = None):
        self.logs, self.address, self.preload = logs, f"tcp://127.0.0.1:{free_port()}", preload
        # the workers' environment: this one (PREFECT_HOME, PATH, AWS_*), the Prefect server's API (else the
        # flow's context tells them), one torch thread each
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "DASK_TEMPORARY_DIRECTORY": str(logs), **(env or {})}
        if api_url:
            self.env["PREFECT_API_URL"] = api_url
        self.env.pop("DFLASH_DASK_ADDRESS", None)
        self.scheduler = self._start("scheduler", "scheduler", "--host", "127.0.0.1",
                                     "--port", self.address.rsplit(":", 1)[1], "--no-dashboard")
        self.workers: list[subprocess.Popen] = []
        for _ in range(workers):
            self.start_worker()
        self.wait_for_workers(workers)

    def _start(self, name: str, *arguments: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        return subprocess.Popen([str(DASK), *arguments], env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def start_worker(self) -> None:
        # each worker a machine of its own: its own copy of a store on object storage
        self.env["DFLASH_STORE_CACHE"] = str(self.logs / f"store-copy-{len(self.workers)}")
        self.workers.append(self._start(f"worker-{len(self.workers)}", "worker", self.address, "--nthreads", "1",
                                        "--no-nanny", "--no-dashboard", "--host", "127.0.0.1",
                                        "--death-timeout", "60",
                                        *(["--preload", str(self.preload)] if self.preload else [])))

    def client(self, timeout: float = 30):
        import distributed

        return distributed.Client(self.address, timeout=timeout, set_as_default=False)

    def wait_for_workers(self, n: int) -> None:
        # the scheduler may not take connections yet, or answer late on busy cores: both are waited through
        with wait_until(lambda: self.client(timeout=10), 180, "the Dask scheduler", self.scheduler) as client:
            try:  # exactly n: a killed worker has left
                wait_until(lambda: len(client.nthreads()) == n, 180, f"{n} Dask workers", every=0.2)
            except NeverReady as e:
                raise AssertionError(f"{e}: {self.log_tails()}") from None

    def worker_pids(self) -> dict[str, int]:
        """{worker address: its process id}."""
        with self.client() as client:
            return client.run(os.getpid)

    def kill_busy_worker(self) -> tuple[str, bool]:
        """SIGKILL a worker that has a shard to run now (else any worker); returns (its address, whether it had
        one)."""
        with self.client() as client:
            processing = client.processing()
            pids = client.run(os.getpid)
        busy = [address for address, keys in processing.items() if keys and address in pids]
        victim = (busy or sorted(pids))[0]
        os.kill(pids[victim], signal.SIGKILL)
        return victim, bool(busy)

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.logs.glob("*.log")))

    def stop(self) -> None:
        # the workers first: one whose scheduler has gone waits for it (--death-timeout) before it exits
        for group in (self.workers, [self.scheduler]):
            for process in group:
                if process.poll() is None:
                    process.terminate()
            for process in group:
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
