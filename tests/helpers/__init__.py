"""Shared code of the tests, their jobs and the benchmarks: launching jobs, test models, fake services, the model
zoo's families and judgement. Not tests themselves (pytest collects nothing here)."""
