"""Expert parallelism for Qwen3.5-MoE, a package like `context_parallel` and `tensor_parallel`.

Modules: `experts` (the ep groups carved out of dp_shard × cp, whole experts per rank, tokens
by all-to-all, the experts' FSDP2 units; `ExpertMesh`), `over_tensor_parallel` (ep beside tp:
each tp rank's experts split over the dense FSDP2 mesh), `router` (the router's load-balancing
loss: its coefficient as Transformers reads it, the global balance over dp_shard × cp).
"""
