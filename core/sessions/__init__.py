"""Chat sessions (issue 26): a job of kind ``session`` that holds a GPU slot for a model and its
adapters, and the relay through the store that carries its requests and replies."""
