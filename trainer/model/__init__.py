"""The base model: loading and wrapping it for the method (``load``), tiny random-weight models (``tiny``)."""
