"""Package data for the trainer: ``corpus.txt``, the plain-English text tiny tokenizers are trained on."""
