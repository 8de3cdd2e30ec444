"""Session-wide tiny target checkpoints (built from configs, saved once per test session)."""

import pytest

from tests import tiny_models


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
    from dflash_core.tiny_build import TinyBuildSettings, default_cache_root, tiny_run

    return tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen3_5_run():
    from dflash_core.tiny_build import TinyBuildSettings, default_cache_root, tiny_run

    return tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3_5"))
