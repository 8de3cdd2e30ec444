"""The DFlash math and model handling: the drafter, the target, features, offline replay, decoding and metrics
(plain torch and transformers; no Prefect, no store)."""
