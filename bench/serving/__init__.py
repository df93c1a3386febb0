"""The serving benchmark: rate sweeps, reports and plots of the load generator (`pdserve.tune`'s,
for any OpenAI-compatible completions endpoint); `bench/compare.py` runs it against pdserve's
configurations and vLLM."""
