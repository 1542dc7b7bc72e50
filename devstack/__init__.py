"""Development tooling on top of every layer: a whole stack of processes on one machine (Redis, workers, router,
standby, gateways) for the demo, the end-to-end tests and the benchmarks, plus a stock SGLang server to compare
against."""
