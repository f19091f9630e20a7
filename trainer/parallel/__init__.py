"""Several ranks: who this process is (``distributed``), how the model is spread over them
(``strategy``: DDP or FSDP2) and the OOM ladder that steps the activation policy down (``oom_ladder``)."""
