"""Tools around the model and the engine: checkpoint conversion from GPT-2 and Megatron-LM
(`convert`), the per-rank memory estimator (`memory`), and `spawn`, which runs a function on N gloo
processes on one machine (the tests' and benchmarks' launcher)."""
