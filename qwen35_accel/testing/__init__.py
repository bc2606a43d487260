"""Scaffolding for tests and benchmarks: test batches, launches and process trees with hard
timeouts (the tiny models and the local gloo world live in the product and are re-exported
here). The product does not import it. Imports nothing at import."""
