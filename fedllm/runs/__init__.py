"""What persists a run: run directories, the one-writer lock, checkpoints, base history, per-client state."""
