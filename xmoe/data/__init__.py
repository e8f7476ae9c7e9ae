"""Corpora into training data: `xmoe data prepare` (inputs, tokenizers, shards, manifest) and the prepared sets it
writes, read back by the trainer. Imports numpy and the tokenizers library, never torch."""
