"""Training records: reading and tokenizing them (``dataset``, ``chat_labels``), packing them into
micro-batches (``packing``) and the packed rows' metadata (``packed_metadata``). Also package data:
``corpus.txt``, the plain-English text tiny tokenizers are trained on."""
