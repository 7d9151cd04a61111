"""Tensor parallelism with torch.distributed: per-rank shards (`parallel`), vocabulary-parallel
embedding and lm_head (`layers`), and the processes that run them (`runtime`)."""
