"""CUDA semantics emulated on CPU: autocast lists, the SDPA backend choice, composite ops' real paths,
and the memory a CUDA process uses besides its tensors (context, cuBLAS workspaces, NCCL buffers)."""
