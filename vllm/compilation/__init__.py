"""Our torch.compile stack: the model decorator, the backend, passes, CUDA graphs, cache.

Entry points: `decorators.support_torch_compile` (model classes), `counter.compilation_counter`
(tests), `cudagraph_dispatcher.CudagraphDispatcher` and `cuda_graph.CUDAGraphWrapper` (the
model runner), `monitor.get_startup_timer()` (start-up report).
"""
