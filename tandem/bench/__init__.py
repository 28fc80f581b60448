"""`tandem bench`: a load generator for any OpenAI-compatible or SGLang endpoint (flags named as in
SGLang's bench_serving and vLLM's benchmark_serving). Torch-free, so it starts in a second.

flags -> workload (prompts as token ids) + arrivals -> runner (client per request) -> stats -> report, plot.
"""
