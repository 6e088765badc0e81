"""Data: the shard format (shards), tokenizer training and byte accounting (tokenizer), text -> shards
(prepare), the training/validation loaders (loader), the published export (download), the demo corpus
with a known entropy rate (demo, demo_source), and a shard checker (inspect)."""
