"""Kept for scripts that name it: the entry point is memplan.train, shipped in the package.

    python -m torch.distributed.run --nproc-per-node=4 --standalone launch/train.py fit --config planned.yaml
is the same as
    python -m torch.distributed.run --nproc-per-node=4 --standalone -m memplan.train fit --config planned.yaml
"""
from memplan.train import main

if __name__ == "__main__":
    main()
