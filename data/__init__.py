"""Token data: the on-disk shard format, corpus preparation and the memory-mapped loader."""
