"""Data: tokenizers, corpus preparation into megatron-core indexed datasets, training datasets.

Modules (import them directly; this package imports nothing, so worker processes start fast):
  tokenizer    load_tokenizer / train_sentencepiece
  corpus       reading text files, directories and JSONL; bad-input accounting
  indexed      write_indexed_dataset (<prefix>.bin/.idx/.json), read_tokens
  prepare      prepare_corpus: inputs -> tokenizer -> prefix, idempotent
  shakespeare  the embedded default corpus and its by-work split
  datasets     build_gpt_datasets (megatron GPTDataset/BlendedDataset), check_vocab_fits
  unigram      the unigram-perplexity baseline
  synthetic    random-token dataset for tests and benchmarks
See docs/DATA.md.
"""
