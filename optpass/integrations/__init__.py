"""optpass inside the training loops people already run: ``optpass.integrations.transformers``
(Hugging Face ``Trainer``). Each module imports its library only when it is imported itself."""
