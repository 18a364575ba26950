"""Data: the Zipf-PCFG synthetic language and token shards on disk."""
