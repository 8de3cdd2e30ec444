"""The tiny trained target: corpus, tokenizer, training, checkpoints, held-out prompts.

Training here runs a handful of steps on a shrunken config: these tests check
behaviour (determinism, shapes, round trips, identical logits), not quality.
"""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3ForCausalLM

from dflash_core.target import load_target
from dflash_eval.tiny import target as tiny_target
from tests.tiny_models import CORPUS_BYTES, SHRUNK, SHRUNK_LINEAR

# A shrunken model so that a few training steps take well under a second. `corpus` and `tokenizer` are
# conftest's (the tiny target's corpus cut to CORPUS_BYTES, and its tokenizer).
SMALL = dict(SHRUNK, num_hidden_layers=2)
SMALL_QWEN3_5 = dict(SMALL, **SHRUNK_LINEAR, layer_types=["linear_attention", "full_attention"])
TRAIN = dict(steps=4, batch_size=2, seq_len=32)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3_model(tokenizer, corpus):
    model, _ = tiny_target.train_target(tokenizer, corpus[0], arch="qwen3", **TRAIN, **SMALL)
    return model


@pytest.fixture(scope="module")
def qwen3_5_model(tokenizer, corpus):
    model, _ = tiny_target.train_target(tokenizer, corpus[0], arch="qwen3_5", **TRAIN, **SMALL_QWEN3_5)
    return model


# --- corpus


def test_corpus_is_deterministic_and_hash_pins_it(corpus):
    text, digest = corpus
    assert tiny_target.build_corpus(max_bytes=CORPUS_BYTES) == (text, digest)
    assert digest == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert CORPUS_BYTES * 0.9 < len(text.encode("utf-8")) <= CORPUS_BYTES


def test_corpus_is_python_documents_each_ending_with_eos(corpus):
    text, _ = corpus
    assert text.endswith(tiny_target.EOS_TOKEN)
    documents = text.split(tiny_target.EOS_TOKEN)[:-1]
    assert len(documents) > 100
    assert all(d.strip() and d.endswith("\n") for d in documents)
    assert sum(d.lstrip().startswith(("def ", "class ", "@", "async def ")) for d in documents) > len(documents) / 2


def test_corpus_size_follows_max_bytes():
    small, small_digest = tiny_target.build_corpus(max_bytes=50_000)
    assert len(small.encode("utf-8")) <= 50_000
    assert small_digest != tiny_target.build_corpus(max_bytes=CORPUS_BYTES)[1]


def test_split_corpus_holds_out_whole_documents_at_the_tail(corpus):
    text, _ = corpus
    train, held_out = tiny_target.split_corpus(text)
    assert train + held_out == text
    assert train.endswith(tiny_target.EOS_TOKEN) and held_out.endswith(tiny_target.EOS_TOKEN)
    assert 0.03 < len(held_out) / len(text) <= 0.05


# --- tokenizer


def test_tokenizer_size_and_special_tokens_are_single_ids(tokenizer):
    assert len(tokenizer) == 512
    ids = {}
    for token in tiny_target.SPECIAL_TOKENS:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        assert len(encoded) == 1, token
        ids[token] = encoded[0]
    assert len(set(ids.values())) == len(ids)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == ids["<|endoftext|>"]
    assert tokenizer.mask_token_id == ids["<|mask|>"]
    # special tokens stay whole inside text too
    assert ids["<|im_end|>"] in tokenizer.encode("x = 1<|im_end|>\n", add_special_tokens=False)


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x + 1\n",
        "héllo wörld, naïve café; 日本語のテキスト; Ελληνικά; emoji 🙂🚀\n",
        "\t tabs\r\nand CRLF\r\n   trailing spaces   \n\n\n",
        "\x00\x01 control bytes \x7f and a lone combining mark \u0301",
        "<|im_start|>user\nmixed <|mask|> text<|im_end|>\n",
        "",
    ],
)
def test_tokenizer_round_trips_any_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < len(tokenizer) for i in ids)


def test_tokenizer_compresses_python(tokenizer, corpus):
    # a BPE, not bytes: fewer tokens than bytes on the text it was trained on
    sample = corpus[0][:20_000]
    assert len(tokenizer.encode(sample, add_special_tokens=False)) < len(sample.encode("utf-8")) / 1.8


def test_tokenizer_training_is_deterministic(tokenizer, corpus):
    again = tiny_target.train_tokenizer(corpus[0])
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    other = tiny_target.train_tokenizer(corpus[0], vocab_size=300)
    assert len(other) == 300


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Sort a list."},
        {"role": "assistant", "content": "sorted(xs)"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nSort a list.<|im_end|>\n"
        "<|im_start|>assistant\nsorted(xs)<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nSort a list.<|im_end|>\n<|im_start|>assistant\n")
    for enable_thinking in (True, False):
        assert (
            tokenizer.apply_chat_template(
                messages[:2], tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
            )
            == prompt
        )
    parts = [{"role": "user", "content": [{"type": "text", "text": "Sort a list."}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nSort a list.<|im_end|>\n"
    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, return_dict=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(ids) == prompt


# --- training


def test_train_target_builds_the_requested_architecture(tokenizer, qwen3_model, qwen3_5_model):
    assert isinstance(qwen3_model, Qwen3ForCausalLM)
    assert isinstance(qwen3_5_model, Qwen3_5ForCausalLM)
    assert set(qwen3_5_model.config.layer_types) == {"linear_attention", "full_attention"}
    for model in (qwen3_model, qwen3_5_model):
        assert not model.training
        assert model.config.vocab_size == len(tokenizer)
        assert model.config.max_position_embeddings >= 512
        assert model.config.eos_token_id == tokenizer.eos_token_id
        assert not model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_default_configs_are_a_few_million_parameters(tokenizer):
    for arch, config in (
        ("qwen3", tiny_target.qwen3_config(len(tokenizer), tokenizer.eos_token_id)),
        ("qwen3_5", tiny_target.qwen3_5_text_config(len(tokenizer), tokenizer.eos_token_id)),
    ):
        model_class = Qwen3ForCausalLM if arch == "qwen3" else Qwen3_5ForCausalLM
        with torch.device("meta"):
            num_params = sum(p.numel() for p in model_class(config).parameters())
        assert 1_000_000 < num_params < 10_000_000, arch
        assert config.num_key_value_heads < config.num_attention_heads  # GQA


@pytest.mark.slow  # trains a model
def test_training_is_deterministic_and_reports_stats(tokenizer, corpus, qwen3_model):
    model, stats = tiny_target.train_target(tokenizer, corpus[0], arch="qwen3", **TRAIN, **SMALL)
    for (name, a), (_, b) in zip(model.state_dict().items(), qwen3_model.state_dict().items()):
        assert torch.equal(a, b), name
    assert stats.steps == TRAIN["steps"] and len(stats.loss_curve) == TRAIN["steps"]  # < 10 steps: one point each
    assert stats.tokens_seen == TRAIN["steps"] * TRAIN["batch_size"] * TRAIN["seq_len"]
    assert stats.num_params == sum(p.numel() for p in model.parameters())
    assert stats.final_loss == stats.loss_curve[-1]  # the last 10% of 4 steps is the last step
    assert 0 < stats.held_out_loss < 10 and stats.seconds > 0
    _, other_seed = tiny_target.train_target(tokenizer, corpus[0], arch="qwen3", seed=1, **TRAIN, **SMALL)
    assert other_seed.loss_curve != stats.loss_curve


@pytest.mark.slow  # trains a model
def test_training_lowers_the_loss(tokenizer, corpus):
    # a higher learning rate than the default: the shrunken model has 30 steps to show progress
    _, stats = tiny_target.train_target(
        tokenizer, corpus[0], arch="qwen3", steps=30, batch_size=4, seq_len=32, lr=5e-3, **SMALL
    )
    assert len(stats.loss_curve) == 10
    assert stats.final_loss == pytest.approx(stats.loss_curve[-1])  # last tenth = last 3 of 30 steps
    assert stats.final_loss < stats.loss_curve[0] - 0.5


def test_train_target_rejects_unknown_arch(tokenizer, corpus):
    with pytest.raises(ValueError, match="arch"):
        tiny_target.train_target(tokenizer, corpus[0], arch="llama", steps=1)


# --- held-out prompts


def test_prompt_snippets_are_deterministic_held_out_windows(tokenizer, corpus):
    text, _ = corpus
    _, held_out = tiny_target.split_corpus(text)
    prompts = tiny_target.prompt_snippets(tokenizer, text, n=8, length=24, seed=0)
    assert prompts == tiny_target.prompt_snippets(tokenizer, text, n=8, length=24, seed=0)
    assert prompts != tiny_target.prompt_snippets(tokenizer, text, n=8, length=24, seed=1)
    assert len(prompts) == 8 and len({tuple(p) for p in prompts}) == 8
    for prompt in prompts:
        assert len(prompt) == 24
        assert tokenizer.eos_token_id not in prompt
        snippet = tokenizer.decode(prompt)
        assert snippet in held_out
        # windows start at a line start (documents start after an eos)
        assert any(
            i == 0 or held_out[i - 1] == "\n" or held_out[:i].endswith(tiny_target.EOS_TOKEN)
            for i in _occurrences(held_out, snippet)
        )
    with pytest.raises(ValueError, match="fewer than"):
        tiny_target.prompt_snippets(tokenizer, text, n=100_000, length=24, seed=0)


def _occurrences(text, snippet):
    start = text.find(snippet)
    while start >= 0:
        yield start
        start = text.find(snippet, start + 1)


# --- checkpoints


def test_save_target_round_trips_through_load_target_and_auto_tokenizer(tmp_path, tokenizer, qwen3_model):
    path = tiny_target.save_target(qwen3_model, tokenizer, tmp_path / "qwen3")
    assert (path / "model.safetensors").is_file()
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False

    loaded_tokenizer = AutoTokenizer.from_pretrained(path)
    text = "def héllo():\n    return '🙂'<|im_end|>"
    assert loaded_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert loaded_tokenizer.eos_token_id == tokenizer.eos_token_id
    assert loaded_tokenizer.pad_token_id == tokenizer.pad_token_id
    assert loaded_tokenizer.mask_token_id == tokenizer.mask_token_id
    messages = [{"role": "user", "content": "hi"}]
    assert loaded_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    target = load_target(path, dtype=torch.float32)
    input_ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        expected = qwen3_model(input_ids=input_ids).logits
    assert torch.equal(target(input_ids).logits, expected)
    assert target.vocab_size == len(tokenizer) and target.num_layers == 2


def test_qwen3_5_target_and_vlm_wrapper_give_identical_logits(tmp_path, tokenizer, qwen3_5_model):
    text_path = tiny_target.save_target(qwen3_5_model, tokenizer, tmp_path / "text")
    vlm_path = tiny_target.save_qwen3_5_vlm(qwen3_5_model, tokenizer, tmp_path / "vlm")

    with safe_open(str(vlm_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert any(k.startswith("model.visual.") for k in keys)
    assert "lm_head.weight" in keys
    text_keys = {k.removeprefix("model.") for k in qwen3_5_model.state_dict() if k.startswith("model.")}
    assert {f"model.language_model.{k}" for k in text_keys} <= keys

    config = json.loads((vlm_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert "architectures" not in config["text_config"]  # as in the published checkpoints
    assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert AutoTokenizer.from_pretrained(vlm_path).eos_token_id == tokenizer.eos_token_id

    input_ids = torch.tensor([tokenizer.encode("for i in range(10):\n    print(i)\n", add_special_tokens=False)])
    with torch.no_grad():
        expected = qwen3_5_model(input_ids=input_ids).logits
        vlm = Qwen3_5ForConditionalGeneration.from_pretrained(vlm_path, dtype=torch.float32).eval()
        assert torch.equal(vlm(input_ids=input_ids).logits, expected)
    for path in (text_path, vlm_path):
        assert torch.equal(load_target(path, dtype=torch.float32)(input_ids).logits, expected), path


def test_save_qwen3_5_vlm_rejects_other_models(tmp_path, tokenizer, qwen3_model):
    with pytest.raises(TypeError):
        tiny_target.save_qwen3_5_vlm(qwen3_model, tokenizer, tmp_path / "vlm")


# --- quality report


def test_continuation_variety_counts_loops_and_eos(tokenizer, qwen3_model):
    prompts = tiny_target.prompt_snippets(tokenizer, tiny_target.build_corpus(CORPUS_BYTES)[0], n=4, length=16, seed=0)
    report = tiny_target.continuation_variety(qwen3_model, prompts, tokenizer.eos_token_id, max_new_tokens=20)
    assert report["num_prompts"] == 4 and len(report["continuations"]) == 4
    for continuation in report["continuations"]:
        assert 1 <= len(continuation) <= 20
        assert tokenizer.eos_token_id not in continuation[:-1]
    assert 0.0 <= report["eos_fraction"] <= 1.0
    assert tiny_target._loop_period([5] * 16, 8, 16) == 1
    assert tiny_target._loop_period([1, 2] * 8, 8, 16) == 2
    assert tiny_target._loop_period(list(range(16)), 8, 16) is None
