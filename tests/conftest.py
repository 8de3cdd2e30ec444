"""Shared fixtures: the tiny target's corpus and tokenizer, tiny target checkpoints, the trained tiny runs
(and a short-prompt view of the Qwen3 one), one Prefect test server. Plain builders live in tests/tiny_models.py.

`slow` (pyproject's marker): a test that trains a model, starts a server or a process, or sleeps or waits on
purpose is marked `@pytest.mark.slow` unless it takes well under a second; `pytest -m "not slow"` is the fast
lane and stays under 2 minutes on 2 cores. Every slow test still runs in CI.
"""

import copy
import os
import tempfile

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
    from dflash_core.tiny import target as tiny_target

    return tiny_target.build_corpus(max_bytes=tiny_models.CORPUS_BYTES)


@pytest.fixture(scope="session")
def tokenizer(corpus):
    """The tiny target's tokenizer trained on `corpus`: a 512-token byte-level BPE with ChatML and DFlash
    special tokens and a ChatML chat template. Shared: copy it (`copy.deepcopy`) before changing it."""
    from dflash_core.tiny import target as tiny_target

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


# The tiny TRAINED target and drafter run: built once per machine (cached by a hash of the builder's
# code and settings under $DFLASH_TINY_CACHE or ~/.cache/dflash-eval/tiny), a few minutes when missing.
@pytest.fixture(scope="session")
def tiny_qwen3_run():
    from dflash_core.tiny.build import TinyBuildSettings, default_cache_root, tiny_run

    return tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))


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
    from dflash_core.tiny.build import TinyBuildSettings, default_cache_root, tiny_run
    from dflash_core.tiny.training import DrafterTrainingSettings

    # two saved steps are enough here (the Qwen3 fixture covers tau rising with training)
    settings = TinyBuildSettings(arch="qwen3_5", drafter_training=DrafterTrainingSettings(steps=200, save_every=100))
    return tiny_run(default_cache_root(), settings)


@pytest.fixture(scope="session")
def prefect_api_url():
    """One Prefect server for the whole session (flows run in-process report to it); its URL lets
    subprocesses (the command line) report to it too instead of starting servers of their own."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

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
