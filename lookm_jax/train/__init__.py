"""Training the demo's vision side: scene batches (data), tower pretraining (tower), alignment (vision)."""
