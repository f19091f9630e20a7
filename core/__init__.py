"""What the API and the worker share: settings, the job spec, job states, store models, errors."""
