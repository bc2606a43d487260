"""Scaffolding for tests, the demo and benchmarks: tiny models built in code, local gloo
worlds and launches with hard timeouts. Not needed to train; imports nothing at import."""
