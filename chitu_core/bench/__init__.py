"""Benchmarks, run as ``python -m chitu_core.bench SUBCOMMAND``.

- ``offline``: one fixed batch of random prompts through ``LLM``'s engine, every
  step timed: throughput, prefill time, decode step times, and the share of step
  time spent outside the model forward.
- ``random-model``: write a random-weight HF model directory of a named real
  config (``configs.CONFIGS``), to benchmark a model's shape without its weights.
- ``serve``: latency (TTFT, TPOT, end to end) and throughput of any OpenAI-compatible
  server at several concurrency levels, as a table, JSON or a plot.
"""
