"""Fine-tuning, one concern per module: recipe (settings), data (batches), models, losses, checkpoints, metrics,
loop (the Trainer). The entry point is mla_convert.finetune."""
