"""`memplan report` on a run whose ranks are more than its data-parallel ranks (ModelParallelStrategy() on one
node: data_parallel_size=1): the apply record's `ranks` counts the ranks that write, `layout.world_size` the
data-parallel ones."""
from __future__ import annotations

from memplan.callback.rank_log import RankLog
from memplan.commands.run_logs import load_run

LAYOUT = {"loader_batch_size": 8, "micro_batch_size": 2, "accumulate_grad_batches": 1, "world_size": 1,
          "gradient_checkpointing": False, "micro_batches_per_step": 4, "global_batch_size": 8}


def write_apply(log_dir, rank: int, **fields) -> None:
    log = RankLog(log_dir, rank, "20261126-050000-aaaaaa")
    log.write("apply", 0, source="plan", layout=LAYOUT, **fields)
    log.close()


def test_a_missing_rank_is_counted_from_the_ranks_that_write_not_the_data_parallel_ones(tmp_path):
    write_apply(tmp_path, 0, ranks=2)  # rank 1 of 2 wrote nothing; one data-parallel rank
    assert load_run(tmp_path).missing_ranks == [1]


def test_a_log_without_ranks_counts_its_layout_s_world_size(tmp_path):
    write_apply(tmp_path, 0)  # a log written before `ranks`: the layout's world size was every rank
    assert load_run(tmp_path).missing_ranks == []
