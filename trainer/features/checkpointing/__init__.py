"""The activation policy (``gradient_checkpointing``): which decoder layers are checkpointed (``policy``)."""
