"""The serving benchmark: a load generator for any OpenAI-compatible completions endpoint, its
metrics, rate sweeps and plots; `bench/compare.py` runs it against pdserve's configurations."""
