"""The serving engine: scheduler, paged attention, runner, sampler and the `LLM` API."""
