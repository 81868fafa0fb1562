"""Fake serving layer: ContinuousBatchingEngine, Scheduler (with the 2-D verify budgets), SamplingParams."""
