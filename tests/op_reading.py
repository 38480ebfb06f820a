"""Reading one op's transient in a memplan trace as the GPU campaign read it on a GPU (benchmarks.op_transients)."""
from __future__ import annotations


def op_transients(monkeypatch, op) -> list[int]:
    """Patch the tracker to read each call of `op` as benchmarks.op_transients does: peak inside - max(before,
    after), in allocated bytes of the caching allocator model."""
    from memplan.estimator.allocator import CachingAllocatorModel
    from memplan.estimator.tracker import StorageTracker

    seen, state = [], {"peak": None}
    malloc, dispatch = CachingAllocatorModel.malloc, StorageTracker.__torch_dispatch__

    def recording_malloc(self, nbytes, stream=0):
        handle = malloc(self, nbytes, stream)
        if state["peak"] is not None:
            state["peak"] = max(state["peak"], self.allocated_bytes)
        return handle

    def recording_dispatch(self, func, types, args=(), kwargs=None):
        if func is not op:
            return dispatch(self, func, types, args, kwargs)
        before = state["peak"] = self.memory.allocated_bytes
        out = dispatch(self, func, types, args, kwargs)
        seen.append(state["peak"] - max(before, self.memory.allocated_bytes))
        state["peak"] = None
        return out

    monkeypatch.setattr(CachingAllocatorModel, "malloc", recording_malloc)
    monkeypatch.setattr(StorageTracker, "__torch_dispatch__", recording_dispatch)
    return seen
