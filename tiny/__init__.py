"""The tiny trained run: a corpus, a tokenizer, a small Qwen3 target and a DFlash drafter trained on it, built once
and cached (demo, test fixtures, smoke runs)."""
