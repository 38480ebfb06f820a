"""memplan: memory planning for distributed PyTorch Lightning training."""
__version__ = "0.1.0"
