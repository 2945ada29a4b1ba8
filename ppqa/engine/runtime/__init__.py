"""The engine's bookkeeping and execution: requests, the scheduler, the KV cache, stream layout,
sampling, the cost model that picks modes, the model runner and its CUDA graphs."""
