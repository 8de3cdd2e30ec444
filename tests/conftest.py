"""Shared fixtures: the tiny target's corpus and tokenizer, tiny target checkpoints, the trained tiny runs
(and a short-prompt view of the Qwen3 one), one Prefect test server. Plain builders live in tests/tiny_models.py.

`slow` (pyproject's marker): a test that trains a model, starts a server or a process, or sleeps or waits on
purpose is marked `@pytest.mark.slow` unless it takes well under a second; `pytest -m "not slow"` is the fast
lane and stays under 2 minutes on 2 cores. Every slow test still runs in CI.
"""

import copy
import os
import tempfile
from pathlib import Path

import pytest

# Prefect reads these when first used: a throwaway home (its database, result storage), no telemetry
# (there is no network), quiet logs. Set before anything imports prefect.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="dflash-eval-prefect-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_LEVEL"] = "WARNING"
# Checkpoints the tests write are finished when written: no 30 s settle wait before fetching them
# (tests of the settle rule pass their own settle_seconds).
os.environ["DFLASH_SETTLE_SECONDS"] = "0"
# Rich wraps CLI error panels at the terminal width (80 when there is none), which splits messages
# holding long temp paths mid-phrase; tests read whole messages.
os.environ["TERMINAL_WIDTH"] = "1000"
# Under pytest-xdist (the README's `pytest -n 2`) the workers share the cores: each computes on one thread,
# and so does every process a test starts (it inherits this). Read by torch when it is first imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests import tiny_models
from tests.tiny_models import first_prompts


@pytest.fixture(scope="module")
def one_thread():
    """Models this small run faster on one thread; on a busy machine, more threads only wait for each other.
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus():
    """(text, sha256) of the tiny target's corpus, cut to `tiny_models.CORPUS_BYTES` of standard library
    documents (a few seconds the first time: the standard library is parsed once per process)."""
    from dflash_eval.tiny import target as tiny_target

    return tiny_target.build_corpus(max_bytes=tiny_models.CORPUS_BYTES)


@pytest.fixture(scope="session")
def tokenizer(corpus):
    """The tiny target's tokenizer trained on `corpus`: a 512-token byte-level BPE with ChatML and DFlash
    special tokens and a ChatML chat template. Shared: copy it (`copy.deepcopy`) before changing it."""
    from dflash_eval.tiny import target as tiny_target

    return tiny_target.train_tokenizer(corpus[0])


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return tiny_models.build_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def qwen3_sharded_dir(tmp_path_factory):
    # ~40 KB shards split the 3-layer model into many files; embedding and lm_head land in different ones
    return tiny_models.build_qwen3(tmp_path_factory.mktemp("qwen3_sharded"), max_shard_size="40KB")


@pytest.fixture(scope="session")
def llama_tied_dir(tmp_path_factory):
    return tiny_models.build_llama_tied(tmp_path_factory.mktemp("llama_tied"))


@pytest.fixture(scope="session")
def qwen3_5_dirs(tmp_path_factory):
    """(text-only Qwen3_5ForCausalLM dir, Qwen3_5ForConditionalGeneration dir) with identical text weights."""
    return tiny_models.build_qwen3_5_pair(tmp_path_factory.mktemp("qwen3_5_text"), tmp_path_factory.mktemp("qwen3_5_vlm"))


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory):
    return tiny_models.build_gemma3_vlm(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory):
    return tiny_models.build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


def pytest_sessionstart(session):
    """A parallel run of the whole suite (`pytest -n 2`, the README's) first builds the trained tiny runs the cache
    lacks, two at a time, and trains the planted drafters beside the tests (tests/trained_runs.py): the workers
    would otherwise build them one by one while the other waits."""
    config = session.config
    parallel = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    whole = not config.args or all(Path(a).is_dir() for a in config.args)
    if parallel and whole and "not slow" not in (config.option.markexpr or ""):
        from tests.trained_runs import build_before_a_parallel_session

        config.stash[PLANTED_BUILDER] = build_before_a_parallel_session()


def pytest_sessionfinish(session):
    builder = session.config.stash.get(PLANTED_BUILDER, None)
    if builder is not None and builder.poll() is None:  # the session ended early: it is not needed any more
        builder.kill()
        builder.wait()


PLANTED_BUILDER = pytest.StashKey()


# Under `pytest -n 2` a module's tests run on one worker (--dist loadscope), handed out in collection order: the
# modules that take longest go first, so that the session does not end with one worker on a long module while the
# other idles: the slowest modules of a parallel run's `--durations` (setup and calls together), slowest first.
# test_planted_bugs goes last: its drafters train meanwhile (pytest_sessionstart).
LONGEST_FIRST = ("test_sampling", "test_deployments", "test_faults", "test_cluster", "test_ui_screenshots",
                 "test_pipeline_s3", "test_first_run", "test_serve_killed", "test_reference_backends",
                 "test_served_settings", "test_pipeline", "test_dflash2_golden", "test_dflash010_golden",
                 "test_given_sampled_drafts")
LAST = ("test_planted_bugs",)


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in LAST:
            return len(LONGEST_FIRST) + 1
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module's own order is kept


# The tiny TRAINED target and drafter runs: built once per machine (cached by a hash of the builder's
# code and settings under $DFLASH_TINY_CACHE or ~/.cache/dflash-eval/tiny), a few minutes when missing.
@pytest.fixture(scope="session")
def tiny_qwen3_run():
    from tests.trained_runs import trained_run

    return trained_run("qwen3")


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_run, tmp_path_factory):
    """The tiny Qwen3 run with `.prompts`, a file of its first `tiny_models.SHORT_PROMPTS` held-out prompts
    (a new file per module; the session's run itself stays as it is)."""
    prompts = first_prompts(tiny_qwen3_run, tiny_models.SHORT_PROMPTS, tmp_path_factory.mktemp("prompts") / "prompts.jsonl")
    tiny = copy.copy(tiny_qwen3_run)
    tiny.prompts = prompts
    return tiny


@pytest.fixture(scope="session")
def tiny_qwen3_5_run():
    from tests.trained_runs import trained_run

    return trained_run("qwen3_5")


@pytest.fixture(scope="session")
def tiny_dflash2_run():
    """A DFlash2 drafter (convolutions and candidate selector) trained on the Qwen3 run's target."""
    from tests.trained_runs import trained_run

    return trained_run("qwen3_dflash2")


@pytest.fixture(scope="module")
def tiny_dflash2(tiny_dflash2_run, tmp_path_factory):
    """The DFlash2 run with `.prompts`, its first `tiny_models.SHORT_PROMPTS` held-out prompts (as `tiny`)."""
    prompts = first_prompts(tiny_dflash2_run, tiny_models.SHORT_PROMPTS,
                            tmp_path_factory.mktemp("prompts") / "prompts.jsonl")
    run = copy.copy(tiny_dflash2_run)
    run.prompts = prompts
    return run


@pytest.fixture(scope="session")
def dflash2_evaluated(tiny_dflash2_run, prefect_api_url, tmp_path_factory):
    """The DFlash2 run's first and last saves evaluated through the flow on its first `tiny_models.SHORT_PROMPTS`
    prompts (tests/evaluations.py: Evaluated): what every view of its selector reads, evaluated once a session."""
    from tests.evaluations import evaluate_saves

    root = tmp_path_factory.mktemp("dflash2-evaluated")
    prompts = first_prompts(tiny_dflash2_run, tiny_models.SHORT_PROMPTS, root / "prompts.jsonl")
    return evaluate_saves(tiny_dflash2_run, prompts, root, max_new_tokens=64)


@pytest.fixture(scope="session")
def prefect_api_url():
    """One Prefect server for the whole session (flows run in-process report to it); its URL lets
    subprocesses (the command line) report to it too instead of starting servers of their own."""
    import prefect.testing.utilities
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from dflash_eval.flows.local_server import TiedServer

    # Prefect's harness waits through a refused connection only: on busy cores its server answers a first request
    # after httpx's timeout, and the session errored. Our tied server waits through any answer short of ready (and
    # goes with this process if it is killed).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefect.testing.utilities, "SubprocessASGIServer", TiedServer)
        with prefect_test_harness(server_startup_timeout=90):
            yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def s3_server():
    """An S3 API server (moto's, a process on loopback) for the session, with the AWS_* environment that
    points obstore (and child processes) at it: its endpoint URL. Starting it takes about 2 s, once; the tests
    that use it stay in the fast lane."""
    from tests.s3_server import running_s3_server

    with running_s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_url(s3_server, request):
    """A fresh s3:// store URL (its own prefix in the session's bucket) for one test."""
    from tests.s3_server import fresh_prefix

    return fresh_prefix(request.node.name)


@pytest.fixture(params=["local", "s3"])
def any_store(request, tmp_path, monkeypatch):
    """The conformance tests' store: a local folder, then a prefix on the S3 server, this machine's copy of it
    in tmp_path/cache ($DFLASH_STORE_CACHE, so child processes share it)."""
    from dflash_eval.storage import Store

    if request.param == "local":
        return Store(tmp_path / "store")
    request.getfixturevalue("s3_server")
    from tests.s3_server import fresh_prefix

    monkeypatch.setenv("DFLASH_STORE_CACHE", str(tmp_path / "cache"))
    return Store(fresh_prefix(request.node.name))
